"""Someone scribbling over the event ring costs other clients round trips, never wrong answers.
In the named mode (`[pool.host] backing = "named"`, which this test uses) the ring is a /dev/shm
file created 0640, so an engine in node.group cannot write it; the daemon's own user (or root, as
this test runs) still can, and a reader must cope with whatever it finds there.

One real daemon for the module; a producer (this process) put k0..k23 and keeps putting and
deleting other keys so the ring moves; a consumer process that knows the truth calls get, view
and exists in a loop while an attacker process scribbles one pattern over the ring again and
again. Every answer must match the truth, no call may raise anything but KeyNotFound for a
never-put key or take longer than ring_attack.SLOW_CALL_S, the daemon must keep answering, and
once the attacker stops the consumer must be back to answering negatives from the ring.
"""
from __future__ import annotations

import json
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import DaemonProcess, wait_for

sys.path.insert(0, str(Path(__file__).parent))
from ring_attack import payload  # noqa: E402

HELPER = str(Path(__file__).with_name("ring_attack.py"))
SLOTS, BUCKETS = 256, 1024
PRESENT, ABSENT = 24, 24
ATTACK_S = 1.5
PATTERNS = ["header_random", "header_fields", "seq_huge", "seq_back", "seq_ahead", "slots_random",
            "slots_forged_kinds", "presence_zero", "presence_random", "presence_ones", "index_random",
            "index_fields", "everything"]
INDEX_RECORDS = 64


class Consumer:
    def __init__(self, endpoint: str) -> None:
        self.proc = subprocess.Popen([sys.executable, HELPER, "consume", endpoint, str(PRESENT), str(ABSENT)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        assert self.read(60.0) == {"ready": True}

    def read(self, timeout: float) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise AssertionError(f"the consumer did not answer within {timeout:g}s (hung)")
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"the consumer died (exit status {self.proc.wait()})")
        return json.loads(line)

    def ask(self, line: str, timeout: float) -> dict:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.read(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class Node:
    def __init__(self) -> None:
        # named: a memfd ring is sealed against every write but the daemon's mapping (test_memfd_pool.py)
        self.daemon = DaemonProcess(extra=f"[ring]\nslots = {SLOTS}\npresence_buckets = {BUCKETS}\n"
                                          f"index_records = {INDEX_RECORDS}\n",
                                    backing="named")
        self.daemon.start()
        self.ring_path = f"/dev/shm/ecd.{self.daemon.node}.ring"
        self.producer = self.daemon.client()
        for i in range(PRESENT):
            self.producer.put(f"k{i}", payload(i))
        # Connected before any scribbling: a client that connects while the header is being
        # overwritten without pause may fail to attach (it waits RING_REPAIR_WAIT_S for a repair).
        self.churner = self.daemon.client()
        self.consumer: Consumer | None = None

    def fresh_consumer(self) -> Consumer:
        """The consumer, restarted if an earlier pattern killed or hung it."""
        if self.consumer is None or self.consumer.proc.poll() is not None:
            self.consumer = Consumer(self.daemon.endpoint)
        return self.consumer

    def close(self) -> None:
        if self.consumer is not None:
            self.consumer.kill()
        self.producer.close()
        self.churner.close()
        self.daemon.cleanup()


@pytest.fixture(scope="module")
def node():
    n = Node()
    yield n
    n.close()


def churn(c, stop: threading.Event, errors: list) -> None:
    """Puts and deletes of keys the consumer never checks: ring events and presence updates."""
    import torch
    j = 0
    while not stop.is_set():
        try:
            c.put(f"churn{j % 50}", torch.full((64,), j))
            if j % 3 == 0:
                c.delete(f"churn{(j + 25) % 50}")
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
            return
        j += 1
        time.sleep(0.002)


def felt(status: dict) -> list[int]:
    """The reading client's overruns and failed checks (the asker's cache is empty: it never polls)."""
    return [status["overruns"][0], status["corruptions"][0] or 0]


def clean(result: dict) -> bool:
    return not (result["wrong"] or result["errors"] or result["slow"])


@pytest.mark.parametrize("pattern", PATTERNS)
def test_scribbled_ring_costs_round_trips_never_wrong_answers(node, pattern):
    consumer = node.fresh_consumer()
    before = consumer.ask("status", timeout=20)
    attacker = subprocess.Popen([sys.executable, HELPER, "attack", node.ring_path, pattern, str(ATTACK_S),
                                 str(SLOTS), str(BUCKETS)], stdout=subprocess.PIPE, text=True)
    stop, churn_errors = threading.Event(), []
    churner = threading.Thread(target=churn, args=(node.churner, stop, churn_errors))
    churner.start()
    try:
        try:
            during = consumer.ask(f"check {ATTACK_S}", timeout=ATTACK_S + 20)
        except AssertionError:
            consumer.kill()  # hung or died: the next pattern starts a fresh one
            raise
    finally:
        stop.set()
        churner.join(30)
        assert attacker.wait(30) == 0
    assert json.loads(attacker.stdout.read())["scribbles"] > 10

    assert node.daemon.alive(), node.daemon.log()[-3000:]
    assert node.producer.ping() > 0
    assert not churn_errors, churn_errors
    assert during["calls"] > 20, during
    assert clean(during), during
    # ... and the scribbles did reach it: its ring reader (the client that follows events) saw
    # them as overruns or as failed checks
    seen = consumer.ask("status", timeout=20)
    if pattern.startswith("index_"):  # records that fail a reader's checks are asked of the daemon,
        assert "entry index records" in node.daemon.log()  # which rewrote them from its own copy
    else:
        assert sum(felt(seen)) > sum(felt(before)), (before, seen)

    # The attacker is gone: answers stay right, and the consumer trusts the ring again (answers
    # negatives locally) once the daemon has repaired what was scribbled.
    after = consumer.ask("check 0.3", timeout=20)
    assert clean(after), after
    assert wait_for(lambda: all(consumer.ask("status", timeout=20)["usable"]), timeout=5.0), \
        consumer.ask("status", timeout=20)
    assert node.producer.exists([f"k{i}" for i in range(PRESENT)]) == [True] * PRESENT
