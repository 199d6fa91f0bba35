"""Producer and consumer in separate processes against a real daemon."""
from __future__ import annotations

import threading
import time

import torch

from actor import make_tensor
from conftest import wait_for


def test_put_in_one_process_get_and_view_in_another(daemon, actors):
    producer, consumer = actors(daemon.endpoint), actors(daemon.endpoint)
    assert producer.ask("put img-1 11 300000") == "ok"  # 1.2 MB: through the pool
    assert producer.ask("put img-2 12 100") == "ok"  # 400 B: inline
    assert consumer.ask("get img-1 11 300000") == "ok"
    assert consumer.ask("get img-2 12 100") == "ok"
    assert consumer.ask("view-hold img-1 11 300000") == "holding"
    assert consumer.ask("drop") == "ok"
    assert consumer.ask("get img-3 13 100") == "missing"
    assert consumer.ask("exists img-1 img-2 img-3") == "ok True True False"


def test_bfloat16_and_int_tensors_round_trip_bit_identical(daemon, actors):
    producer = actors(daemon.endpoint)
    assert producer.ask("put b 5 70000 bfloat16") == "ok"
    with daemon.client() as c:
        got = c.get("b")
        want = make_tensor(5, 70000, "bfloat16")
        assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_get_waits_for_a_producer_in_another_process(daemon, actors):
    consumer, producer = actors(daemon.endpoint), actors(daemon.endpoint)
    consumer.send("get late 21 200000 10")
    with daemon.client() as c:
        assert wait_for(lambda: c.stats()["waiters"] == 1, timeout=10)  # the consumer is parked in the daemon
    started = time.monotonic()
    assert producer.ask("put late 21 200000") == "ok"
    assert consumer.read() == "ok"
    assert time.monotonic() - started < 3.0  # answered on commit, not at the 10 s timeout


def test_waiting_get_times_out_with_key_not_found(daemon):
    with daemon.client() as c:
        started = time.monotonic()
        try:
            c.get("never", timeout=0.4)
        except KeyError:
            pass
        else:
            raise AssertionError("expected KeyNotFound")
        assert 0.35 < time.monotonic() - started < 3.0
        assert c.stats()["waiters"] == 0


def test_namespaces_are_separate(daemon, actors):
    a, b = actors(daemon.endpoint, "model-a"), actors(daemon.endpoint, "model-b")
    assert a.ask("put shared 1 1000") == "ok"
    assert b.ask("get shared 1 1000") == "missing"
    assert a.ask("get shared 1 1000") == "ok"


def test_non_contiguous_and_scalar_tensors(daemon):
    with daemon.client() as c:
        base = torch.arange(600 * 400, dtype=torch.float32).reshape(600, 400)
        for key, t in {"t": base.t(), "slice": base[::3, 5:300], "scalar": torch.tensor(2.5),
                       "empty": torch.empty(0, 7), "big-nc": torch.randn(512, 1024).t()}.items():
            c.put(key, t)
            got = c.get(key)
            assert got.shape == t.shape and got.is_contiguous() and torch.equal(got, t), key
            with c.view(key) as v:
                assert torch.equal(v, t), key


def run_threads(work, n: int, timeout: float) -> None:
    """work(0) .. work(n - 1), each on a thread of its own; whatever any of them raised, raised here."""
    errors: list[BaseException] = []

    def run(tid: int) -> None:
        try:
            work(tid)
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(tid,)) for tid in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not errors, errors


def test_threads_share_one_client(daemon):
    with daemon.client() as c:
        def work(tid: int) -> None:
            for i in range(30):
                t = torch.full((20_000 + tid,), float(tid * 1000 + i))
                c.put(f"th{tid}-{i}", t)
                assert torch.equal(c.get(f"th{tid}-{i}"), t)
                with c.view(f"th{tid}-{i}") as v:
                    assert v[0].item() == tid * 1000 + i
                assert c.exists([f"th{tid}-{i}", f"none-{tid}"]) == [True, False]

        run_threads(work, 4, timeout=60)
        stats = c.stats()
        assert stats["entries_ready"] == 120 and stats["read_leases"] == 0


def test_writing_into_a_view_faults_instead_of_corrupting_the_cache(daemon):
    import subprocess
    import sys
    with daemon.client() as c:
        c.put("ro", torch.ones(100_000))
        script = ("import sys, torch, ecd\n"
                  "c = ecd.Client(sys.argv[1])\n"
                  "with c.view('ro') as v:\n"
                  "    v.fill_(5.0)\n"
                  "print('wrote')\n")
        result = subprocess.run([sys.executable, "-c", script, daemon.endpoint],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == -11 and "wrote" not in result.stdout  # SIGSEGV
        assert torch.equal(c.get("ro"), torch.ones(100_000))
        assert wait_for(lambda: c.stats()["read_leases"] == 0)  # the crashed reader was reclaimed


def test_threads_putting_without_waiting_while_others_ask_the_daemon(daemon):
    """A put holds its record's sequence number from its place to its post, and copies between: a
    round trip in another thread (under the client's lock) settles the puts posted so far and
    must not wait for that one, nor that put for the lock (the two would wait on each other)."""
    with daemon.client() as c:
        def work(tid: int) -> None:
            for i in range(40):
                c.put(f"nw{tid}-{i}", torch.full((1 << 15,), float(tid * 1000 + i)), wait=False)
                if i % 2:
                    assert c.stats()["entries_ready"] >= 1  # a round trip under the lock
                else:
                    assert c.delete([f"nw{tid}-{i - 2}"] if i else ["absent"]) == [bool(i)]

        run_threads(work, 4, timeout=120)
        c.flush()
        for tid in range(4):
            for i in range(40):  # deleted: every even one but the last; each a thread's put before its delete
                deleted = i % 2 == 0 and i < 38
                assert c.exists(f"nw{tid}-{i}") != deleted, (tid, i)
            assert c.get(f"nw{tid}-39")[0].item() == tid * 1000 + 39
