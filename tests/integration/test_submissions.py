"""Puts without a message (issue 43): put leases placed in by the client, records on its
submission page committed by the daemon, flush and wait, and refusals with a reason."""
from __future__ import annotations

import threading

import pytest
import torch

from conftest import metric, metric_by_label, scrape_metrics, wait_for
from ecd.client.testing import intercept_round_trips, submission_page
from ecd.errors import LimitExceeded, QuotaExceeded

N = 16384  # 64 KiB of float32


def test_a_stream_of_puts_sends_the_daemon_no_message_per_put(daemon_factory):
    """1000 puts: the only requests are the lease the first one asks for (the daemon grants the
    next ones ahead, on the page), and every entry is there with its bytes."""
    daemon = daemon_factory(size="1GiB")  # 8 MiB slabs: 128 puts of 64 KiB each, once grown
    sent: list[str] = []
    with daemon.client() as c:
        with intercept_round_trips(c, lambda request, send: (sent.append(type(request).__name__), send(request))[1]):
            for i in range(1000):
                c.put(f"k{i}", torch.full((N,), float(i)), wait=False)
            c.flush()
        # 1000 x 64 KiB through ~15 leases (64 KiB doubling to the 8 MiB slab), granted ahead on the
        # page; a daemon slower than the producer (a loaded machine) leaves it to ask for some of
        # them: one request per lease at most, 2 % of the puts
        assert sent.count("LeaseSpace") <= 20, sent
        assert set(sent) <= {"LeaseSpace"}, sent
        with daemon.client() as other:
            for i in (0, 1, 500, 999):
                assert torch.equal(other.get(f"k{i}"), torch.full((N,), float(i)))
        body = scrape_metrics(daemon.metrics_port)
        assert metric_by_label(body, "ecd_submission_records_total", "outcome")["committed"] == 1000
        assert metric_by_label(body, "ecd_put_leases_total", "outcome")["granted"] >= max(8, sent.count("LeaseSpace"))


def test_a_stream_into_a_full_pool_asks_for_a_lease_once_per_slab_not_once_per_put(daemon):
    """The steady state of a cache: its pool is full. A lease asked for evicts for the session's
    next size (the 64 MiB pool's 512 KiB slab: 8 puts of 64 KiB), not for just the one put."""
    sent: list[str] = []
    replies = []
    with daemon.client() as c:
        for i in range(1200):  # 75 MiB through a 64 MiB pool: full of entries of the stream's size
            c.put(f"fill{i}", torch.ones(N), wait=False)
        c.flush()
        def hook(request, send):
            sent.append(type(request).__name__)
            replies.append(send(request))
            return replies[-1]
        with intercept_round_trips(c, hook):
            for i in range(400):
                c.put(f"k{i}", torch.full((N,), float(i)), wait=False)
            c.flush()
        refused = [(a, b) for a, b in zip(sent, replies) if a != "LeaseSpace" or "Failure" in str(b)]
        assert not refused, refused[:3]
        assert sent.count("LeaseSpace") <= 400 // 4, len(sent)  # ~50 (one per slab); one per put was 400
        with daemon.client() as other:
            for i in (0, 200, 399):
                assert torch.equal(other.get(f"k{i}"), torch.full((N,), float(i)))
        assert not c.exists("fill0")  # the coldest went for the leases


def test_a_put_not_waited_for_is_visible_to_another_process_after_flush(daemon, actors):
    producer, consumer = actors(daemon.endpoint), actors(daemon.endpoint)
    for i in range(20):
        assert producer.ask(f"put-nowait e{i} {i} 5000") == "ok"
    assert producer.ask("flush") == "ok"
    for i in range(20):
        assert consumer.ask(f"get e{i} {i} 5000") == "ok"


def test_a_client_reads_its_own_writes_at_once(daemon):
    with daemon.client() as c:
        for i in range(50):
            c.put("same", torch.full((N,), float(i)), wait=False)
            assert c.exists("same")
            assert float(c.get("same")[0]) == i  # the record before it committed first
        c.delete("same")
        assert not c.exists("same")


def test_a_refused_put_names_its_key_and_reason(daemon_factory):
    """The daemon refuses a record whose key breaks [limits]: put(wait=True) raises it; puts
    with wait=False raise it at flush (naming the key), and the rest of them are stored."""
    d = daemon_factory(extra="[limits]\nmax_key_bytes = 16\n")
    with d.client() as c:
        with pytest.raises(LimitExceeded, match="max_key_bytes"):
            c.put("a-key-of-twenty-b", torch.ones(N))
        c.put("fine-1", torch.ones(N), wait=False)
        c.put("another-long-key!", torch.ones(N), wait=False)
        c.put("fine-2", torch.ones(N), wait=False)
        with pytest.raises(LimitExceeded, match="another-long-key!"):
            c.flush()
        c.flush()  # raised once
        assert c.exists(["fine-1", "another-long-key!", "fine-2", "a-key-of-twenty-b"]) == [True, False, True, False]
        assert metric_by_label(scrape_metrics(d.metrics_port), "ecd_submission_records_total", "outcome")["refused"] == 2


def test_a_put_larger_than_the_slab_takes_a_lease_of_its_own(daemon):
    big = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB: eight times the 64 MiB pool's 512 KiB slab
    with daemon.client() as c:
        c.put("big", big, wait=False)
        c.put("small", torch.ones(10), wait=False)
        c.flush()
        with daemon.client() as other:
            assert torch.equal(other.get("big"), big)
            assert torch.equal(other.get("small"), torch.ones(10))


def test_lease_space_goes_back_when_the_client_goes(daemon):
    with daemon.client() as c:
        for i in range(10):
            c.put(f"k{i}", torch.ones(N), wait=False)
        c.flush()
        leased = metric(scrape_metrics(daemon.metrics_port), "ecd_leased_bytes")
        assert leased > 0
    wait_for(lambda: metric(scrape_metrics(daemon.metrics_port), "ecd_leased_bytes") == 0)
    with daemon.client() as c:
        stats = c.stats()
        assert stats["used_bytes"] == 10 * N * 4  # the entries only: every leased byte returned
        assert stats["entries_ready"] == 10


def test_leases_a_live_client_left_unused_are_revoked_and_it_puts_on_after(daemon_factory):
    """A client the daemon watches (same pid namespace) holds its leases while it lives; unused
    for the write TTL they are marked revoked on its page and freed half a TTL later. The client
    places in none of them after the mark: its next puts ask for a new lease and are stored."""
    d = daemon_factory(extra='[leases]\nwrite_ttl = "2s"\n')
    sent: list[str] = []
    with d.client() as c:
        for i in range(10):
            c.put(f"k{i}", torch.full((N,), float(i)), wait=False)
        c.flush()
        assert metric(scrape_metrics(d.metrics_port), "ecd_leased_bytes") > 0
        # unused for 2 s: marked; 1 s later freed (the daemon looks each second)
        wait_for(lambda: metric(scrape_metrics(d.metrics_port), "ecd_leased_bytes") == 0, timeout=10)
        assert metric_by_label(scrape_metrics(d.metrics_port), "ecd_put_leases_total", "outcome")["expired"] >= 1
        assert c.stats()["used_bytes"] == 10 * N * 4  # the entries only: every leased byte returned
        with intercept_round_trips(c, lambda request, send: (sent.append(type(request).__name__), send(request))[1]):
            for i in range(10, 20):
                c.put(f"k{i}", torch.full((N,), float(i)))  # waited: a record in a freed lease is refused
        assert sent[:1] == ["LeaseSpace"], sent
        with d.client() as other:
            for i in range(20):
                assert torch.equal(other.get(f"k{i}"), torch.full((N,), float(i)))


def test_a_namespace_quota_holds_at_every_instant(daemon_factory):
    """Leased plus committed bytes never pass the quota while a producer streams puts into it."""
    d = daemon_factory(size="64MiB", extra='[namespaces.capped]\nquota = "4MiB"\n')
    peaks: list[float] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            peaks.append(metric_by_label(scrape_metrics(d.metrics_port), "ecd_namespace_used_bytes", "namespace")
                         .get("capped", 0.0))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with d.client(namespace="capped") as c:
            for i in range(300):
                c.put(f"k{i}", torch.full((N,), float(i)), wait=False)
            c.flush()
            assert float(c.get("k299")[0]) == 299
    finally:
        done.set()
        watcher.join()
    assert peaks and max(peaks) <= 4 << 20


def test_a_batch_refused_after_its_first_puts_were_placed_leaves_the_page_serving(daemon_factory):
    """put_many: the first tensor takes its place in the current lease, the second, over the quota,
    is refused (its own LeaseSpace): the first one's record is posted aborted, so the records after
    it commit. Before: it was never posted, and the daemon, reading records in order, committed
    nothing of this client's again (the next waited put: DaemonUnavailable after the timeout)."""
    d = daemon_factory(extra='[namespaces.capped]\nquota = "1MiB"\n')
    with d.client(namespace="capped", timeout=3.0) as c:
        c.put("warm", torch.ones(1024))  # a lease of the page, with room left
        with pytest.raises(QuotaExceeded, match="at its quota"):
            c.put_many({"small": torch.ones(1024), "over": torch.ones(1 << 19)})  # 2 MiB: over the quota
        c.put("after", torch.full((1024,), 7.0))  # waits for its commit
        assert torch.equal(c.get("after"), torch.full((1024,), 7.0))
        assert not c.exists("small") and c.exists("warm")
        c.flush()


def test_a_quota_smaller_than_a_slab_is_refused_a_lease_and_puts_go_the_ordinary_way(daemon_factory):
    d = daemon_factory(extra='[namespaces.tiny]\nquota = "256KiB"\n')
    with d.client(namespace="tiny") as c:
        c.put("a", torch.ones(N), wait=False)  # a lease of the put's size fits; a slab would not
        c.flush()
        with pytest.raises(QuotaExceeded):
            c.put("huge", torch.ones(1 << 17))  # 512 KiB: over the quota whatever the route
        assert torch.equal(c.get("a"), torch.ones(N))


def test_submissions_off_puts_go_the_ordinary_way(daemon_factory):
    d = daemon_factory(extra="[leases]\nsubmit_records = 0\n")
    sent: list[str] = []
    with d.client() as c:
        assert submission_page(c) is None
        with intercept_round_trips(c, lambda request, send: (sent.append(type(request).__name__), send(request))[1]):
            c.put("a", torch.ones(N), wait=False)
        c.flush()
        assert sent == ["PutInline"]
        assert torch.equal(c.get("a"), torch.ones(N))


DOORBELL_THIEF = """
import os, sys, time
from ecd.fd_passing import receive
_, items = receive(sys.argv[1], 10.0)
bell = next(fd for item, fd in items if item.kind == "doorbell")
print("ready", flush=True)
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:  # swallow every ring, and now and then fill the counter to its top
    try:
        os.eventfd_read(bell)
    except BlockingIOError:
        pass
    try:
        os.eventfd_write(bell, 0xFFFFFFFFFFFFFFFE)
    except BlockingIOError:
        pass
"""


def test_a_client_that_swallows_and_floods_the_doorbell_stops_no_put(daemon):
    """Every client holds the doorbell (an eventfd): one may read other clients' rings off it, or
    fill its counter so that writes would block. Waiting clients ring again each slice and the
    daemon looks at every page each second, so waited puts and flushes all complete."""
    import subprocess
    import sys

    from conftest import REPO
    fds = daemon.socket_path + ".fds"
    thief = subprocess.Popen([sys.executable, "-c", DOORBELL_THIEF, fds, "20"], cwd=REPO, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert thief.stdout.readline().strip() == "ready"
        with daemon.client() as c:
            for i in range(30):
                c.put(f"w{i}", torch.full((N,), float(i)))  # waited: visible on return
                c.put(f"n{i}", torch.full((N,), float(i)), wait=False)
            c.flush()
            with daemon.client() as other:
                for i in range(30):
                    assert torch.equal(other.get(f"w{i}"), torch.full((N,), float(i)))
                    assert torch.equal(other.get(f"n{i}"), torch.full((N,), float(i)))
        assert thief.poll() is None  # it was at it the whole time
    finally:
        thief.kill()
        thief.wait()


def test_a_read_waits_only_for_pending_puts_of_the_keys_it_reads(daemon):
    """With the daemon stopped (SIGSTOP), puts made with wait=False stay posted and uncommitted:
    a get of another key is served at once (its own writes need not settle first); a get of a
    pending key would wait for the commit, and does once the daemon runs again."""
    import os
    import signal

    with daemon.client(timeout=2.0) as c:
        c.put("old", torch.full((N,), 1.0))
        for i in range(4):  # a lease with room left, granted before the daemon stops
            c.put(f"warm{i}", torch.ones(N), wait=False)
        c.flush()
        assert torch.equal(c.get("old"), torch.full((N,), 1.0))  # its location is known now
        os.kill(daemon.proc.pid, signal.SIGSTOP)
        try:
            c.put("new", torch.full((N,), 2.0), wait=False)
            assert submission_page(c).pending() and submission_page(c).pending(["new"])
            assert not submission_page(c).pending(["old"])
            assert torch.equal(c.get("old"), torch.full((N,), 1.0))  # no wait for "new" to commit
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        assert torch.equal(c.get("new"), torch.full((N,), 2.0))  # settled first: read-your-writes
