"""lazy_client.StepPins, the vLLM schedulers' pins kept off the engine's critical path, against a
real daemon: counted per key across requests, sent with the step (never waited for), unpins
ordered before pins, and sent by themselves when no step comes. Needs no vLLM."""
from __future__ import annotations

import logging
import time

import torch

from ecd.client.testing import intercept_round_trips
from ecd.integrations.vllm.lazy_client import IDLE_FLUSH_S, LazyClient, StepPins
from ecd.integrations.vllm.ratelimit import RateLimitedLog
from ecd.integrations.vllm.settings import ConnectorSettings


def pins_of(daemon, keys: list[str]) -> dict[str, int]:
    with daemon.client(namespace="ns") as c:
        return {e["key"]: e["pins"] for e in c.keys("ns")[1] if e["key"] in keys}


def settle(daemon, keys: list[str], want: dict[str, int], timeout_s: float = 5.0) -> dict[str, int]:
    deadline = time.monotonic() + timeout_s
    while (seen := pins_of(daemon, keys)) != want and time.monotonic() < deadline:
        time.sleep(0.01)
    return seen


def make_pins(daemon) -> tuple[LazyClient, StepPins]:
    settings = ConnectorSettings(endpoint=daemon.endpoint, pin_seconds=30.0)
    client = LazyClient(settings, "ns", "test-step-pins", RateLimitedLog(logging.getLogger("test.step_pins"), 30.0),
                        populate=False)
    return client, StepPins(client, settings.pin_seconds)


def test_counted_across_requests_sent_with_the_step_and_never_waited_for(daemon):
    keys = ["a", "b", "c"]
    with daemon.client(namespace="ns") as c:
        for k in keys:
            c.put(k, torch.ones(4))
    client, pins = make_pins(daemon)
    client.call("hello", lambda c: c.ping())  # connect outside what is counted below
    asked: list[str] = []
    with intercept_round_trips(client.get("count"), lambda req, send: asked.append(type(req).__name__) or send(req)):
        pins.hold("r1", ["a", "b"])
        pins.hold("r2", ["b", "c"])
        pins.hold("r3", ["c"])
        pins.release("r3")  # finished before its step: "c" still held by r2, nothing sent for r3
        assert pins_of(daemon, keys) == dict.fromkeys(keys, 0)  # nothing goes before the step
        pins.flush()
        assert settle(daemon, keys, dict.fromkeys(keys, 1)) == dict.fromkeys(keys, 1)
        pins.release("r1")  # "b" stays: r2 holds it
        pins.flush()
        assert settle(daemon, keys, {"a": 0, "b": 1, "c": 1}) == {"a": 0, "b": 1, "c": 1}
        assert pins.holds("r2") == {"b", "c"}
        # Unpinned and pinned again within one step: the unpins go first, so it ends pinned.
        pins.release("r2")
        pins.hold("r4", ["b"])
        pins.flush()
        assert settle(daemon, keys, {"a": 0, "b": 1, "c": 0}) == {"a": 0, "b": 1, "c": 0}
    assert asked == []  # not one round trip: every pin and unpin went without waiting
    pins.close()
    client.close()


def test_unpins_go_by_themselves_when_no_step_comes_and_close_flushes(daemon):
    with daemon.client(namespace="ns") as c:
        c.put("k", torch.ones(4))
        c.put("j", torch.ones(4))
    client, pins = make_pins(daemon)
    pins.hold("r", ["k"])
    pins.flush()
    assert settle(daemon, ["k"], {"k": 1}) == {"k": 1}
    released = time.monotonic()
    pins.release("r")  # the engine finished its last request and went idle: no flush() follows
    assert settle(daemon, ["k"], {"k": 0}) == {"k": 0}
    assert time.monotonic() - released >= IDLE_FLUSH_S * 0.5
    pins.hold("s", ["j"])
    pins.close()  # shutting down sends what is queued
    assert settle(daemon, ["j"], {"j": 1}) == {"j": 1}
    client.close()  # the session ends: the daemon drops its pins
    assert settle(daemon, ["j"], {"j": 0}) == {"j": 0}


def test_pins_held_across_a_daemon_restart_are_taken_again(daemon):
    """The restarted daemon adopts the pool ([restart]) but not the old run's sessions, whose pins
    kept the keys the scheduler promised from eviction: the next step pins them again."""
    keys = ["a", "b"]
    with daemon.client(namespace="ns") as c:
        for k in keys:
            c.put(k, torch.ones(4))
    client, pins = make_pins(daemon)
    pins.hold("r1", keys)
    pins.flush()
    assert settle(daemon, keys, dict.fromkeys(keys, 1)) == dict.fromkeys(keys, 1)
    daemon.stop()
    daemon.start()
    assert pins_of(daemon, keys) == dict.fromkeys(keys, 0)  # adopted, unpinned
    client.call("lookup", lambda c: c.ping())  # the scheduler's next lookup meets the new daemon
    pins.flush()
    assert settle(daemon, keys, dict.fromkeys(keys, 1)) == dict.fromkeys(keys, 1)
    pins.release("r1")
    pins.flush()
    assert settle(daemon, keys, dict.fromkeys(keys, 0)) == dict.fromkeys(keys, 0)
    pins.close()
    client.close()
