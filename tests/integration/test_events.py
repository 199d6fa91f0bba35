"""[events]: what a real daemon holds, published as vLLM KV events, read by a ZeroMQ subscriber
that decodes the frames with plain msgspec (field names and tags as they are on the wire; the
same stream through vLLM's own classes: tests/vllm/test_events_vllm.py)."""
from __future__ import annotations

import shutil
import signal
import time

import msgspec
import pytest
import torch
import zmq

from conftest import wait_for
from ecd.config import load_config
from ecd.errors import ConfigError
from ecd.protocol import EncoderMeta, KVBlockMeta
from kv_events import END_SEQ, Subscriber, event_dir, events_config, removed, replay, stored

KV_FIELDS = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"]


@pytest.fixture
def evdir():
    path = event_dir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def sub(evdir):
    s = Subscriber(evdir)
    yield s
    s.close()


def test_puts_deletes_and_replacements_are_published_as_vllm_events(daemon_factory, evdir, sub):
    daemon = daemon_factory(extra=events_config(evdir))
    with daemon.client() as c:
        sub.connect_with(c)
        meta = KVBlockMeta(0xABCDEF, 0x1234, [1, 2, 3, 4], 4, lora_name="adapter", group_idx=1)
        c.put("block-1", torch.zeros(16), meta=meta)
        c.put_many({"m1": torch.ones(8), "m2": torch.ones(8)},
                   meta={"m1": KVBlockMeta(b"\x01" * 32), "m2": KVBlockMeta(7, 6, [9], 1)})
        c.put("plain", torch.zeros(4))  # no meta: its key is its block hash
        c.put("big", torch.zeros(1 << 20, dtype=torch.uint8), meta=KVBlockMeta(99))  # not inline
        events = sub.wait_for(lambda ev: stored(ev, 99) != [])
        [e] = stored(events, 0xABCDEF)
        assert list(e)[:len(KV_FIELDS)] == KV_FIELDS  # vLLM's field order
        assert e == {"type": "BlockStored", "block_hashes": [0xABCDEF], "parent_block_hash": 0x1234,
                     "token_ids": [1, 2, 3, 4], "block_size": 4, "lora_id": None, "medium": "CPU",
                     "lora_name": "adapter", "group_idx": 1}
        assert stored(events, b"\x01" * 32)[0]["parent_block_hash"] is None
        assert stored(events, 7)[0]["parent_block_hash"] == 6
        assert stored(events, b"plain")[0] == {"type": "BlockStored", "block_hashes": [b"plain"],
                                                "parent_block_hash": None, "token_ids": [], "block_size": 0,
                                                "lora_id": None, "medium": "CPU", "lora_name": None}
        c.delete(["block-1"])
        events = sub.wait_for(lambda ev: removed(ev, 0xABCDEF) != [])
        assert removed(events, 0xABCDEF) == [{"type": "BlockRemoved", "block_hashes": [0xABCDEF], "medium": "CPU",
                                             "group_idx": 1}]
        # a replace: the old value's removal, then the new one
        c.put("plain", torch.ones(4), meta=KVBlockMeta(1001))
        events = sub.wait_for(lambda ev: stored(ev, 1001) != [])
        tail = events[-2:]
        assert tail[0] == {"type": "BlockRemoved", "block_hashes": [b"plain"], "medium": "CPU"}
        assert tail[1]["block_hashes"] == [1001]
    kv_seqs = sub.seqs(b"kv")
    assert kv_seqs == list(range(kv_seqs[0], kv_seqs[0] + len(kv_seqs)))  # contiguous per topic


def test_evictions_from_a_full_pool_are_block_removed(daemon_factory, evdir, sub):
    daemon = daemon_factory(size="8MiB", extra=events_config(evdir))
    with daemon.client() as c:
        sub.connect_with(c)
        for i in range(24):  # 1 MiB each through an 8 MiB pool
            c.put(f"k{i}", torch.zeros(1 << 20, dtype=torch.uint8), meta=KVBlockMeta(i + 1))
        assert c.stats()["evictions"] > 0
        events = sub.wait_for(lambda ev: stored(ev, 24) != [])
        gone = [i for i in range(24) if removed(events, i + 1, "CPU")]
        assert gone and gone[0] == 0  # least recently used first
        held = [i for i in range(24) if c.exists([f"k{i}"])[0]]
        assert set(gone) == set(range(24)) - set(held)  # removed = exactly what is no longer held


def test_encoder_entries_go_on_their_own_topic(daemon_factory, evdir):
    daemon = daemon_factory(extra=events_config(evdir))
    kv, ec = Subscriber(evdir, (b"kv",)), Subscriber(evdir, (b"ec",))
    try:
        with daemon.client() as c:
            kv.connect_with(c)
            c.put("img-1", torch.zeros(64), meta=EncoderMeta("mm-abc", 576))
            c.put("img-2", torch.zeros(64), meta=EncoderMeta(num_tokens=9))  # mm_hash "": the key
            events = ec.wait_for(lambda ev: stored(ev, b"img-2") != [], topic=b"ec")
            assert stored(events, b"mm-abc") == [{
                "type": "BlockStored", "block_hashes": [b"mm-abc"], "parent_block_hash": None, "token_ids": [],
                "block_size": 576, "lora_id": None, "medium": "CPU", "lora_name": None,
                "kv_cache_spec_kind": "encoder"}]
            c.delete(["img-1"])
            ec.wait_for(lambda ev: removed(ev, b"mm-abc", "CPU") != [], topic=b"ec")
            c.put("kv-after", torch.zeros(4))
            kv.wait_for(lambda ev: stored(ev, b"kv-after") != [])
        assert not any(b"mm-abc" in e.get("block_hashes", []) or b"img-2" in e.get("block_hashes", [])
                       for e in kv.events())
        assert {t for t, _, _ in ec.received} == {b"ec"}
    finally:
        kv.close()
        ec.close()


def test_replay_of_a_missed_range_and_the_cold_start(daemon_factory, evdir):
    daemon = daemon_factory(extra=events_config(evdir, "batch_events = 1\n"))
    with daemon.client() as c:
        for i in range(10):
            c.put(f"r{i}", torch.zeros(4), meta=KVBlockMeta(500 + i))
        c.put("e", torch.zeros(4), meta=EncoderMeta("mm"))
        wait_for(lambda: c.stats()["events"]["waiting"] == 0, timeout=10)
    everything = replay(evdir, 0)
    # a cold start: AllBlocksCleared is the first batch of the topic
    assert everything[0][1] == 0 and everything[0][2][1] == [{"type": "AllBlocksCleared"}]
    assert [s for _, s, _ in everything] == list(range(len(everything)))
    assert {t for t, _, _ in everything} == {b"kv"}
    hashes = [e["block_hashes"][0] for _, _, b in everything for e in b[1] if e["type"] == "BlockStored"]
    assert hashes == [500 + i for i in range(10)]
    # a subscriber that missed seqs 4.. asks from 4
    missed = replay(evdir, 4)
    assert [s for _, s, _ in missed] == list(range(4, len(everything)))
    assert [b for _, _, b in missed] == [b for _, _, b in everything[4:]]
    assert replay(evdir, 10_000) == []  # nothing that new: only the marker
    # the encoder topic: named in a fourth frame (ecd's extension of vLLM's request)
    enc = replay(evdir, 0, [b"ec"])
    assert [b[1][0]["type"] for _, _, b in enc] == ["AllBlocksCleared", "BlockStored"]
    assert {t for t, _, _ in enc} == {b"ec"}


def test_hostile_replay_requests_are_ignored_and_replay_keeps_serving(daemon_factory, evdir):
    daemon = daemon_factory(extra=events_config(evdir))
    ctx = zmq.Context()
    bad = ctx.socket(zmq.DEALER)
    bad.linger = 0
    bad.connect(f"ipc://{evdir}/replay")
    hostile = [[b"garbage"], [b"", b"\x00" * 7], [b"", b"\x00" * 9], [b"x", b"\x00" * 8],
               [b"", b"\x00" * 8, b"no-such-topic"], [b"", b"\x00" * 8, b"kv", b"more"], [b"\xff" * 3000],
               [b""] * 40]
    for _ in range(50):
        for frames in hostile:
            bad.send_multipart(frames)
    # a raw TCP-less flood of one oversized message: cut off by the ROUTER's size limit
    bad.send(b"\x00" * 100_000)
    assert not bad.poll(500)  # nothing is answered to any of them
    bad.close(0)
    ctx.term()
    got = replay(evdir, 0)
    assert got[0][2][1] == [{"type": "AllBlocksCleared"}]
    with daemon.client() as c:
        # the publisher takes 16 requests per 20 ms wake: the backlog drains after the good replay
        assert wait_for(lambda: c.stats()["events"]["bad_replay_requests"] >= 50 * len(hostile) - 50,
                        timeout=15), c.stats()["events"]  # (50 of slack: what close(0) may drop unsent)
        assert c.stats()["events"]["replays"] >= 1
    assert daemon.proc.poll() is None
    log = daemon.log_path.read_text()
    assert log.count("ignored a replay request") == 1  # rate-limited


def test_a_subscriber_that_never_reads_does_not_grow_the_daemon(daemon_factory, evdir):
    daemon = daemon_factory(extra=events_config(evdir))
    ctx = zmq.Context()
    deaf = ctx.socket(zmq.SUB)
    deaf.rcvhwm = 10
    deaf.linger = 0
    deaf.subscribe(b"")
    deaf.connect(f"ipc://{evdir}/pub")
    try:
        with daemon.client() as c:
            rss = []
            tensors = {f"k{i}": torch.zeros(4) for i in range(1000)}
            metas = {f"k{i}": KVBlockMeta(i, i - 1, list(range(16)), 16) for i in range(1000)}
            for rnd in range(50):  # 1000 replaced 50 times: ~100k events (stored + removed)
                c.put_many(tensors, meta=metas)
                if rnd in (10, 49):
                    wait_for(lambda: c.stats()["events"]["waiting"] == 0, timeout=30)
                    rss.append(int(open(f"/proc/{daemon.proc.pid}/statm").read().split()[1]) * 4096)
            # (counted after each batch is sent, a step after "waiting" drops)
            assert wait_for(lambda: c.stats()["events"]["events"] >= 99_000, timeout=30), c.stats()["events"]
            # 40 more rounds after the first measure: bounded by the HWM and the replay buffer, not the rounds
            assert rss[1] - rss[0] < 48 << 20, rss
    finally:
        deaf.close(0)
        ctx.term()


def test_an_overflowing_backlog_is_dropped_and_resynced(daemon_factory, evdir, sub):
    # a tiny backlog: a put_many of 1000 overflows it at once
    daemon = daemon_factory(extra=events_config(evdir, "queue_events = 64\nbatch_events = 16\n"))
    with daemon.client() as c:
        sub.connect_with(c)
        c.put_many({f"o{i}": torch.zeros(4) for i in range(1000)})
        wait_for(lambda: c.stats()["events"]["resyncs"] >= 2 and c.stats()["events"]["waiting"] == 0, timeout=20)
        stats = c.stats()["events"]
        assert stats["dropped"] > 0
        keys = {f"o{i}".encode() for i in range(1000)}

        def snapshot(events: list) -> set:
            """What was stored since the last AllBlocksCleared."""
            if {"type": "AllBlocksCleared"} not in events:
                return set()
            after = events[len(events) - events[::-1].index({"type": "AllBlocksCleared"}):]
            return {e["block_hashes"][0] for e in after if e["type"] == "BlockStored"}

        # the snapshot after the clear: every key held
        sub.wait_for(lambda ev: keys <= snapshot(ev))
        assert sub.seqs(b"kv") == list(range(sub.seqs(b"kv")[0], sub.seqs(b"kv")[-1] + 1))


def test_bad_events_config_is_refused_naming_the_key():
    cases = {
        "events.publish": {"publish": "udp://x"},
        "events.replay": {"publish": "ipc:///tmp/a", "replay": "http://x"},
        "events.encoder_topic": {"publish": "ipc:///tmp/a", "topic": "kv", "encoder_topic": "kv-enc"},
        "events.buffer_batches": {"buffer_batches": 0},
        "events.batch_interval": {"batch_interval": "1h"},
        "events.batch_events": {"batch_events": 0},
        "events.queue_events": {"batch_events": 100, "queue_events": 10},
        "events.hwm": {"hwm": -1},
        "events.curve_allowed_keys": {"curve_secret_key": "/x.key_secret"},
    }
    for key, table in cases.items():
        with pytest.raises(ConfigError, match=f"^{key}: "):
            load_config({"events": table})
    with pytest.raises(ConfigError, match=r"^events.publish: tcp://0.0.0.0:5557: a tcp endpoint .* is open to"):
        load_config({"events": {"publish": "tcp://0.0.0.0:5557"}})
    with pytest.raises(ConfigError, match=r"^events.publish: tcp://127.0.0.1:5557: a tcp endpoint \(loopback "
                                          r"included\) is open to every local user"):
        load_config({"events": {"publish": "tcp://127.0.0.1:5557"}})
    with pytest.raises(ConfigError, match=r"^events.replay: tcp://\*:5558: a tcp endpoint"):
        load_config({"events": {"publish": "ipc:///tmp/pub", "replay": "tcp://*:5558"}})
    assert load_config({"events": {"publish": "tcp://0.0.0.0:5557", "insecure": True}}).events.enabled
    assert load_config({"events": {"publish": "ipc:///tmp/pub", "replay": "ipc:///tmp/replay"}}).events.topic == "kv"


def test_a_daemon_that_cannot_bind_its_events_endpoint_does_not_start(daemon_factory, evdir):
    blocker = zmq.Context().socket(zmq.PUB)
    blocker.bind("tcp://127.0.0.1:0")
    port = int(blocker.getsockopt_string(zmq.LAST_ENDPOINT).rpartition(":")[2])
    daemon = daemon_factory(extra=f'[events]\npublish = "tcp://127.0.0.1:{port}"\ninsecure = true\n', start=False)
    with pytest.raises(RuntimeError, match="exited") as failed:
        daemon.start(timeout=10)
    assert "events.publish: cannot bind" in str(failed.value)
    blocker.close(0)


def test_curve_protected_events(daemon_factory, evdir, tmp_path):
    from ecd.curve import load_keyfile, write_keypair
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    _, server_secret = write_keypair(str(tmp_path), "server")
    client_public, client_secret = write_keypair(str(tmp_path), "sub")
    shutil.copy(client_public, allowed / "sub.key")
    port_sock = zmq.Context.instance().socket(zmq.PUB)
    port_sock.bind("tcp://127.0.0.1:0")
    port = int(port_sock.getsockopt_string(zmq.LAST_ENDPOINT).rpartition(":")[2])
    port_sock.close(0)
    daemon = daemon_factory(extra=f'[events]\npublish = "tcp://127.0.0.1:{port}"\n'
                                  f'curve_secret_key = "{server_secret}"\ncurve_allowed_keys = "{allowed}"\n')
    server_public = load_keyfile(server_secret, need_secret=True)[0]
    ctx = zmq.Context()

    def subscriber(public: bytes, secret: bytes) -> zmq.Socket:
        s = ctx.socket(zmq.SUB)
        s.linger = 0
        s.curve_serverkey, s.curve_publickey, s.curve_secretkey = server_public, public, secret
        s.subscribe(b"")
        s.connect(f"tcp://127.0.0.1:{port}")
        return s

    late_public, late_secret = write_keypair(str(tmp_path), "late")
    good = subscriber(*load_keyfile(client_secret, need_secret=True))
    stranger = subscriber(*load_keyfile(late_secret, need_secret=True))
    late = None
    try:
        with daemon.client() as c:
            deadline = time.monotonic() + 10
            while not good.poll(100):
                c.put("x", torch.zeros(1))
                assert time.monotonic() < deadline
            assert not stranger.poll(300)
            assert c.stats()["events"]["rejected"] > 0
            # its key allowed, then SIGHUP: a new connection with it is admitted
            shutil.copy(late_public, allowed / "late.key")
            daemon.proc.send_signal(signal.SIGHUP)
            wait_for(lambda: "SIGHUP: 2 allowed CURVE client key(s) in events" in daemon.log(), timeout=10)
            late = subscriber(*load_keyfile(late_secret, need_secret=True))
            deadline = time.monotonic() + 10
            while not late.poll(100):
                c.put("x", torch.zeros(1))
                assert time.monotonic() < deadline
    finally:
        for s in (good, stranger, late):
            if s is not None:
                s.close(0)
        ctx.term()


def test_events_end_with_msgspec_decodable_batches_and_metrics(daemon_factory, evdir, sub):
    from conftest import scrape_metrics
    daemon = daemon_factory(extra=events_config(evdir))
    with daemon.client() as c:
        sub.connect_with(c)
        c.put("m", torch.zeros(4))
        sub.wait_for(lambda ev: stored(ev, b"m") != [])
    for _, _, batch in sub.received:
        assert isinstance(batch, list) and isinstance(batch[0], float) and len(batch) == 3 and batch[2] is None
        msgspec.msgpack.encode(batch)
    text = scrape_metrics(daemon.metrics_port)
    assert "ecd_events_batches_total" in text and "ecd_events_events_total" in text
    assert END_SEQ == b"\xff" * 8


def test_spills_to_disk_and_promotions(daemon_factory, evdir, sub, tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    daemon = daemon_factory(size="16MiB", extra=events_config(evdir) + f'[pool.disk]\npath = "{disk}"\nsize = "1GiB"\n')
    with daemon.client() as c:
        sub.connect_with(c)
        for i in range(12):  # 2 MiB each through a 16 MiB pool: the first ones spill
            c.put(f"d{i}", torch.full((1 << 21,), i, dtype=torch.uint8), meta=KVBlockMeta(700 + i, None, [i], 1))
        events = sub.wait_for(lambda ev: stored(ev, 700, "STORAGE") != [])
        assert removed(events, 700, "CPU")  # it left the host pool ...
        assert stored(events, 700, "STORAGE")[0]["token_ids"] == [0]  # ... and its meta stayed with it
        assert events.index(removed(events, 700, "CPU")[0]) < events.index(stored(events, 700, "STORAGE")[0])
        assert torch.equal(c.get("d0"), torch.full((1 << 21,), 0, dtype=torch.uint8))  # promoted
        events = sub.wait_for(lambda ev: len(stored(ev, 700, "CPU")) == 2)
        assert stored(events, 700, "CPU")[1]["token_ids"] == [0]  # promoted with its meta
        c.delete(["d0"])
        events = sub.wait_for(lambda ev: removed(ev, 700, "STORAGE") != [])
        assert removed(events, 700, "CPU")[-1] is not removed(events, 700, "CPU")[0]  # both copies went


def test_an_adopting_restart_publishes_a_clear_then_what_it_adopted(daemon_factory, evdir):
    daemon = daemon_factory(extra=events_config(evdir))
    with daemon.client() as c:
        for i in range(5):
            c.put(f"a{i}", torch.zeros(8))
        c.delete(["a4"])
    daemon.stop()
    daemon.start()
    with daemon.client() as c:
        assert c.stats()["restart"]["adopted"]
        wait_for(lambda: c.stats()["events"]["waiting"] == 0)
    got = replay(evdir, 0)
    events = [e for _, _, b in got for e in b[1]]
    assert events[0] == {"type": "AllBlocksCleared"}
    assert sorted(e["block_hashes"][0] for e in events[1:] if e["type"] == "BlockStored") == [
        b"a0", b"a1", b"a2", b"a3"]


def test_ecd_status_shows_the_events(daemon_factory, evdir):
    import json
    import os
    import subprocess
    import sys
    daemon = daemon_factory(extra=events_config(evdir))
    with daemon.client() as c:
        c.put("s", torch.zeros(4))
        wait_for(lambda: c.stats()["events"]["waiting"] == 0)
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    run = [sys.executable, "-m", "ecd", "status", "--config", str(daemon.config), "--interval", "0"]
    result = subprocess.run(run, capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 0, result.stderr
    [line] = [line for line in result.stdout.splitlines() if line.startswith("kv events")]
    assert f"ipc://{evdir}/pub" in line and "0 dropped" in line
    doc = json.loads(subprocess.run(run + ["--json"], capture_output=True, text=True, timeout=60, env=env).stdout)
    assert doc["events"]["endpoints"] == [f"ipc://{evdir}/pub", f"ipc://{evdir}/replay"]
    assert doc["events"]["events"] >= 1 and doc["events"]["resyncs"] == 1


def test_disk_records_reindexed_at_start_are_in_the_start_snapshot(daemon_factory, evdir, tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    daemon = daemon_factory(extra=events_config(evdir) + f'[restart]\nadopt = false\n[pool.disk]\npath = "{disk}"\n'
                                                          'size = "1GiB"\n')
    with daemon.client() as c:
        c.put("kept", torch.zeros(1024), persist=True, meta=KVBlockMeta(42))
        c.put("memory-only", torch.zeros(1024))
    daemon.stop()
    daemon.start()
    with daemon.client() as c:
        wait_for(lambda: c.stats()["events"]["waiting"] == 0)
    events = [e for _, _, b in replay(evdir, 0) for e in b[1]]
    # a cold start: cleared, then the re-indexed record (its meta is not in the file: its key)
    assert events == [{"type": "AllBlocksCleared"},
                      {"type": "BlockStored", "block_hashes": [b"kept"], "parent_block_hash": None, "token_ids": [],
                       "block_size": 0, "lora_id": None, "medium": "STORAGE", "lora_name": None}]


def test_check_config_refuses_missing_events_keys(tmp_path):
    import subprocess
    import sys
    config = tmp_path / "node.toml"
    config.write_text(f'[control]\nendpoint = "ipc://{tmp_path}/ecd.sock"\n[events]\npublish = "tcp://127.0.0.1:5557"\n'
                      f'curve_secret_key = "{tmp_path}/none.key_secret"\ncurve_allowed_keys = "{tmp_path}"\n')
    result = subprocess.run([sys.executable, "-m", "ecd", "check-config", str(config)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "events.curve_secret_key:" in result.stdout + result.stderr and "does not exist" in result.stdout + result.stderr


def test_garbage_bytes_on_the_replay_port_leave_it_serving(daemon_factory, evdir):
    import socket

    from ports import free_port
    ports = [free_port(), free_port()]
    daemon = daemon_factory(extra=f'[events]\npublish = "tcp://127.0.0.1:{ports[0]}"\n'
                                  f'replay = "tcp://127.0.0.1:{ports[1]}"\ninsecure = true\n')
    for garbage in (b"\xff" * 64, b"GET / HTTP/1.1\r\n\r\n", bytes(range(256)) * 40):
        with socket.create_connection(("127.0.0.1", ports[1])) as raw:
            raw.sendall(garbage)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(f"tcp://127.0.0.1:{ports[1]}")
    sock.send_multipart([b"", (0).to_bytes(8, "big")])
    assert sock.poll(5000)
    frames = sock.recv_multipart()
    assert frames[1] == b"kv" and frames[2] == (0).to_bytes(8, "big")  # the cold start's AllBlocksCleared
    sock.close(0)
    ctx.term()
    assert daemon.alive()
