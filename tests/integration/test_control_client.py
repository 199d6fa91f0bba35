"""ecd.ControlClient (the control plane without torch or numpy) and Client.request(), the public
low-level round trip, against a real daemon."""
from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import ecd
from ecd import ControlClient, KeyNotFound, LimitExceeded, StaleGeneration
from ecd.protocol import (Acked, Acquire, Acquired, Alloc, AllocItem, Allocated, Bye, Commit, Exists, Failure,
                          Flags, Hello, Location, Ping, Pong, Release, Report, Stats, StatsReply)

from conftest import REPO, metric_by_label, scrape_metrics


def test_control_client_does_every_control_operation(daemon):
    with daemon.client() as c:
        c.put("a", torch.ones(1000))
        c.put("b", torch.ones(10))
        with ControlClient(daemon.endpoint, timeout=5.0) as cc:
            assert isinstance(cc, ControlClient) and not isinstance(cc, ecd.Client)
            assert cc.ping() == cc.epoch == c.epoch
            assert cc.exists("a") is True and cc.exists(["a", "b", "nope"]) == [True, True, False]
            assert cc.exists("a", pin_s=30) is True and cc.stats()["pins"] == 1
            assert cc.unpin("a") is True and cc.stats()["pins"] == 0
            total, entries = cc.keys()
            assert total == 2 and [e["key"] for e in entries] == ["a", "b"]
            assert cc.delete(["b", "nope"]) == [True, False]
            assert not c.exists("b")
            with c.view("a"):
                draining = cc.evict(["a"], force=True)["draining"]
                assert len(draining) == 1 and cc.held(draining) == [True]
            c.ping()  # the view's release (fire-and-forget) is ordered before c's next request
            assert cc.held(draining) == [False]
            assert cc.stats()["entries_ready"] == 0 and cc.stats()["clients"] == 2
            assert cc.limits.max_batch > 0 and cc.verify_namespaces == frozenset()
            with pytest.raises(LimitExceeded):
                cc.exists(["k"] * (cc.limits.max_batch + 1))
        with pytest.raises(ecd.EcdError, match="closed"):
            cc.ping()


def test_pins_sent_without_waiting_hold_and_are_dropped_in_order(daemon):
    """send_pin / send_unpin: exists(pin_s) and unpin as messages nobody waits for (the vLLM
    schedulers' pins). They are handled in order before the client's next request, pin only
    what is present, and are not counted as requests that wanted an answer."""
    with daemon.client() as c, ControlClient(daemon.endpoint, timeout=5.0) as cc:
        c.put("a", torch.ones(8))
        c.put("b", torch.ones(8))
        cc.send_pin(["a", "b", "absent"], 30.0)
        assert cc.exists("a") is True  # a round trip after the pin: the daemon handled it first
        assert cc.stats()["pins"] == 2  # absent keys are not pinned, nor made
        assert {e["key"]: e["pins"] for e in cc.keys()[1]} == {"a": 1, "b": 1}
        cc.send_pin(["a"], 30.0)  # again: extends the same pin, still one
        cc.send_unpin(["b", "absent"])
        assert cc.stats()["pins"] == 1
        cc.send_unpin(["a"])
        assert cc.stats()["pins"] == 0
        with pytest.raises(ecd.InvalidRequest, match="pin_s"):
            cc.send_pin(["a"], 0)
        with pytest.raises(ecd.InvalidRequest, match="UTF-8"):
            cc.send_pin(["bad\udc80"], 1.0)
        many = [f"k{i}" for i in range(cc.limits.max_batch + 3)]  # split at max_batch, not refused
        cc.send_pin(many, 1.0)
        cc.send_unpin(many)
        assert cc.ping() == cc.epoch
    dropped = metric_by_label(scrape_metrics(daemon.metrics_port), "ecd_frames_dropped_total", "reason")
    assert dropped.get("unanswerable", 0) == 0, dropped


def test_control_client_loads_neither_torch_nor_numpy(daemon):
    script = textwrap.dedent(f"""
        import sys
        import ecd
        from ecd.protocol import Exists
        with ecd.ControlClient({daemon.endpoint!r}, namespace="n") as c:
            assert c.exists(["x", "y"]) == [False, False] and c.delete("x") is False
            c.keys(); c.stats(); c.ping(); c.evict(namespace="n")
            assert c.request(Exists(0, "n", ["x"])).values == [False]
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "numpy"))
        print(heavy or "none")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0 and out.stdout.strip() == "none", out.stdout + out.stderr


def test_request_numbers_sends_and_types_the_reply(daemon):
    with daemon.client() as c:
        c.put("k", torch.arange(10, dtype=torch.uint8))
        pong = c.request(Ping(0))
        assert isinstance(pong, Pong) and pong.epoch == c.epoch and pong.id > 0
        assert c.request(Ping(0)).id > pong.id  # numbered by the client, whatever the message said
        assert isinstance(c.request(Stats(0)), StatsReply)
        flags = c.request(Exists(0, "default", ["k", "nope"]))
        assert isinstance(flags, Flags) and flags.values == [True, False]

        # per-item failures come back as they are; the leases taken are the caller's to release
        acquired = c.request(Acquire(0, "default", ["k", "nope"]))
        assert isinstance(acquired, Acquired)
        loc, missing = acquired.results
        assert isinstance(loc, Location) and loc.nbytes == 10
        assert isinstance(missing, Failure) and missing.code == KeyNotFound.code
        assert c.stats()["read_leases"] == 1
        acked = c.request(Release(0, [loc.generation]))
        assert isinstance(acked, Acked) and acked.results == [None]
        assert c.stats()["read_leases"] == 0

        # an Error reply raises the error its code maps to
        with pytest.raises(LimitExceeded, match="max_batch"):
            c.request(Exists(0, "default", ["k"] * (c.limits.max_batch + 1)))

        # the client's own messages and non-requests are refused before anything is sent
        for own in (Hello(0, 1, 1), Bye(0), Report(0, 1)):
            with pytest.raises(ValueError, match="sent by the client itself"):
                c.request(own)
        for wrong in (Pong(0, 1), "ping", None):
            with pytest.raises(TypeError, match="expected an ecd.protocol request"):
                c.request(wrong)
        assert c.ping() == c.epoch  # the session is unharmed


def test_request_waits_for_an_acquire_and_reconnects_like_every_call(daemon):
    with daemon.client() as c, daemon.client() as producer:
        # a waiting Acquire outlives the client's timeout by its wait_s
        c.timeout = 0.5
        timer = threading.Timer(1.0, lambda: producer.put("late", torch.ones(4)))
        timer.start()
        try:
            (loc,) = c.request(Acquire(0, "default", ["late"], 3.0)).results
        finally:
            timer.join()
        assert isinstance(loc, Location)
        c.request(Release(0, [loc.generation]))
        c.timeout = 5.0

        (ext,) = c.request(Alloc(0, "default", [AllocItem("w", "uint8", [8], 8)])).results
        assert isinstance(c.request(Ping(0)), Pong)
        epoch = c.epoch
        daemon.stop(signal.SIGKILL)  # SIGTERM would wait for the write in progress
        daemon.start()
        # a restarted daemon is greeted again; a request naming the old run's generations fails
        with pytest.raises(StaleGeneration):
            c.request(Commit(0, [ext.generation]))
        assert c.epoch != epoch
        allocated = c.request(Alloc(0, "default", [AllocItem("w", "uint8", [8], 8)]))
        assert isinstance(allocated, Allocated) and not isinstance(allocated.results[0], Failure)
