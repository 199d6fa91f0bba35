"""Daemon restarts, malformed frames, lease ownership: the daemon keeps serving (client kills and
other faults: tests/chaos)."""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import zmq

import ecd
from conftest import wait_for
from ecd.client.testing import acquire
from ecd.errors import Code
from ecd.memory.ring import key_hash
from ecd.protocol import (PROTOCOL_VERSION, Commit, Error, Hello, Ping, Release, Welcome, encoder,
                          reply_decoder)


def test_graceful_restart_is_seen_by_the_next_call(daemon):
    with daemon.client() as c:
        c.put("x", torch.ones(300_000))
        daemon.stop(signal.SIGTERM)
        daemon.start()
        c.put("y", torch.ones(300_000))  # NOT_REGISTERED -> hello again -> works
        assert torch.equal(c.get("y"), torch.ones(300_000))
        assert c.exists(["x", "y"]) == [True, True]  # "x": the restarted daemon adopted the pool
        assert torch.equal(c.get("x"), torch.ones(300_000))


def test_graceful_cold_restart_forgets_the_pool(daemon_factory):
    daemon = daemon_factory(extra="[restart]\nadopt = false\n")
    with daemon.client() as c:
        c.put("x", torch.ones(1000))
        daemon.stop(signal.SIGTERM)
        daemon.start()
        c.put("y", torch.ones(1000))
        assert c.exists(["x", "y"]) == [False, True]


@pytest.mark.timing
def test_client_without_daemon_raises_daemon_unavailable(tmp_path):
    started = time.monotonic()
    with pytest.raises(ecd.DaemonUnavailable):
        ecd.Client(f"ipc://{tmp_path}/nobody.sock", timeout=0.5)
    assert time.monotonic() - started < 2.0


class RawPeer:
    """A DEALER speaking the wire protocol by hand (or not speaking it at all)."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, 3000)
        self.sock.connect(endpoint)
        self.decoder = reply_decoder()

    def send_frames(self, *frames: bytes):
        self.sock.send_multipart(list(frames))
        return self.decoder.decode(self.sock.recv())

    def request(self, msg):
        return self.send_frames(encoder.encode(msg))

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


@pytest.mark.parametrize("frames, code", [
    ((b"",), Code.PROTOCOL),
    ((b"\xc1\xff\x00garbage",), Code.PROTOCOL),
    ((os.urandom(64),), Code.PROTOCOL),
    ((b"\xa2\xbc\x00",), Code.PROTOCOL),  # a msgpack str that is not UTF-8
    ((encoder.encode(["no-such-tag", 7]),), Code.PROTOCOL),
    ((encoder.encode(["ping", "not-an-int"]),), Code.PROTOCOL),
    ((encoder.encode(["alloc", 9, "ns", [["k", "float32", [-1], 4]]]),), Code.PROTOCOL),
    ((encoder.encode(Ping(1)), b"extra frame"), Code.PROTOCOL),
    ((encoder.encode(Ping(5)),), Code.NOT_REGISTERED),
])
def test_malformed_frames_get_typed_errors_and_the_daemon_keeps_serving(daemon, frames, code):
    peer = RawPeer(daemon.endpoint)
    try:
        reply = peer.send_frames(*frames)
        assert isinstance(reply, Error) and reply.code == code and reply.message
    finally:
        peer.close()
    assert daemon.alive()
    with daemon.client() as c:
        c.put("still", torch.ones(3))
        assert torch.equal(c.get("still"), torch.ones(3))


def test_random_frames_each_get_an_error_reply(daemon):
    import random
    rng = random.Random(1234)
    peer = RawPeer(daemon.endpoint)
    try:
        for _ in range(2000):
            frame = bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 96)))
            reply = peer.send_frames(frame)  # raises zmq.Again if the daemon stays silent
            assert isinstance(reply, Error) and reply.code in (Code.PROTOCOL, Code.NOT_REGISTERED)
    finally:
        peer.close()
    with daemon.client() as c:
        assert c.stats()["errors"].get("unhandled", 0) == 0


def test_error_reply_carries_the_request_id_when_it_can_be_read(daemon):
    peer = RawPeer(daemon.endpoint)
    try:
        reply = peer.send_frames(encoder.encode(["alloc", 42, "ns", "not-a-list"]))
        assert isinstance(reply, Error) and reply.id == 42 and "Expected `array`" in reply.message
        reply = peer.request(Hello(1, PROTOCOL_VERSION + 99, os.getpid()))
        assert isinstance(reply, Error) and reply.code == Code.VERSION
    finally:
        peer.close()


def test_leases_and_writes_are_bound_to_their_client(daemon):
    with daemon.client() as owner:
        owner.put("mine", torch.ones(100_000))
        results, release = acquire(owner, ["mine"])
        generation = results[0].generation
        intruder = RawPeer(daemon.endpoint)
        try:
            assert isinstance(intruder.request(Hello(1, PROTOCOL_VERSION, os.getpid())), Welcome)
            reply = intruder.request(Release(2, [generation]))
            assert reply.results[0].code == Code.NOT_OWNER
            reply = intruder.request(Commit(3, [generation]))
            assert reply.results[0].code == Code.STALE
        finally:
            intruder.close()
        assert owner.stats()["read_leases"] == 1  # the intruder could not drop it
        release()
        assert wait_for(lambda: owner.stats()["read_leases"] == 0)


def test_oversized_batches_and_keys_are_refused(daemon):
    with daemon.client() as c:
        with pytest.raises(ecd.LimitExceeded, match="max_batch"):
            c.exists([f"k{i}" for i in range(20_000)], pin_s=1)
        with pytest.raises(ecd.LimitExceeded, match="max_key_bytes"):
            c.put("k" * 5000, torch.ones(2))
        with pytest.raises(ecd.InvalidRequest):
            c.put("", torch.ones(2))
        assert c.ping() > 0


def test_exists_negatives_are_answered_from_the_ring(daemon, actors):
    with daemon.client() as c:
        before = c.stats()["ops"].get("exists", 0)
        assert c.exists([f"absent-{i}" for i in range(100)]) == [False] * 100
        assert c.stats()["ops"].get("exists", 0) == before  # no round trip was needed
        producer = actors(daemon.endpoint)
        assert producer.ask("put fresh 1 10") == "ok"
        assert c.exists("fresh") is True  # published by another process: seen at once


def test_cached_location_is_dropped_when_another_process_evicts(daemon, actors):
    with daemon.client(submit=False) as c:  # the round trip's reply caches the location
        c.put("cached", torch.ones(100_000))
        h = key_hash("default", "cached")
        assert h in c.location_cache
        before = c.stats()["ops"].get("exists", 0)
        assert c.exists("cached") is True
        assert c.stats()["ops"].get("exists", 0) == before  # answered from the cache
        other = actors(daemon.endpoint)
        assert other.ask("put cached 3 10") == "ok"  # replaced by another process
        c.exists("unrelated")  # any call syncs the ring
        assert h not in c.location_cache  # the old generation's location was dropped
        assert c.exists("cached") is True


def test_a_timeout_does_not_cost_the_client_its_leases(daemon_factory):
    d = daemon_factory(size="8MiB")
    with d.client(timeout=0.5) as c, d.client() as other:
        c.put("kept", torch.full((1 << 20,), 7.0))  # 4 of 8 MiB
        with c.view("kept") as v:
            os.kill(d.proc.pid, signal.SIGSTOP)  # the daemon is slow, not gone
            try:
                with pytest.raises(ecd.DaemonUnavailable):
                    c.ping()
            finally:
                os.kill(d.proc.pid, signal.SIGCONT)
            assert c.ping() > 0  # same connection, same session
            assert other.stats()["read_leases"] == 1
            for i in range(4):  # pressure that would evict "kept" if its lease had been dropped
                try:
                    other.put(f"filler-{i}", torch.full((1 << 19,), float(i)))
                except ecd.PoolFull:
                    pass
            assert other.exists("kept") is True
            assert torch.equal(v, torch.full((1 << 20,), 7.0))


def test_leases_of_a_previous_daemon_run_are_not_released_in_the_new_one(daemon):
    with daemon.client() as c, daemon.client() as observer:
        c.put("old", torch.ones(100_000))
        held = c.view("old")
        held.__enter__()
        daemon.stop(signal.SIGKILL)
        daemon.start()
        c.put("new", torch.ones(100_000))
        with c.view("new"):
            held.__exit__(None, None, None)  # its Release names numbers of the dead daemon
            c.ping()  # anything c might have sent is handled before this returns
            assert observer.stats()["read_leases"] == 1


def test_bad_timeouts_are_refused_and_huge_ones_capped(daemon_factory):
    d = daemon_factory(extra='[leases]\nmax_wait = "1s"\n')
    with d.client() as c:
        for bad in (float("inf"), float("nan"), -1.0):
            with pytest.raises(ValueError):
                c.get("k", timeout=bad)
        assert c.stats()["waiters"] == 0
        started = time.monotonic()
        with pytest.raises(ecd.KeyNotFound):
            c.get("k", timeout=1e7)  # capped at leases.max_wait by client and daemon alike
        assert time.monotonic() - started < 5.0
