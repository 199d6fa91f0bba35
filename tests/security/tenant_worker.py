"""Hostile-tenant client processes for tests/security/test_tenant_angles.py.

Run as a script, one mode per process (output flushed line by line):
  park ENDPOINT N KEYS WAIT_S TAG [SESSIONS]
      SESSIONS raw DEALER sessions (default 1), each says Hello with this pid (so the daemon
      watches it) and then sends N Acquire requests on keys that never come (KEYS keys each,
      wait WAIT_S), without waiting for replies; then reads what came back within a second and
      says "parked SENT REFUSED OTHER": REFUSED requests were answered LIMIT (OTHER: any other
      answer). Then sleeps until killed.
  produce ENDPOINT ID LOG STOP TIMEOUT
      puts versioned large tensors (versioned_payload) under KEYS_PER_PRODUCER keys of its own,
      forever (until the file STOP exists); one JSON line per put in LOG: key, version, start,
      end, outcome (ok / unavailable / an error name)
  consume ENDPOINT ID LOG STOP TIMEOUT PRODUCERS [THREADS]
      THREADS threads (default 2) sharing one Client get or view random keys of the producers
      until STOP exists, each read checked against versioned_payload; one JSON line per read:
      key, version read (or null), start, end, outcome (ok / missing / unavailable / mismatch /
      an error name)
  fleet ENDPOINT WORKDIR STOP TIMEOUT PRODUCERS CONSUMERS THREADS
      that many produce and consume processes, forked after one import of torch
"""
from __future__ import annotations

import json
import os
import random
import sys
import time
import zlib

import numpy as np
import zmq

from ecd.errors import Code
from ecd.protocol import PROTOCOL_VERSION, Acquire, Error, Hello, Welcome, encoder, pid_namespace, reply_decoder


def say(text: str) -> None:
    print(text, flush=True)


def park(endpoint: str, n: int, nkeys: int, wait_s: float, tag: str, sessions: int = 1) -> None:
    ctx = zmq.Context()
    decoder = reply_decoder()
    socks = []
    for _ in range(sessions):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.connect(endpoint)
        sock.send(encoder.encode(Hello(1, PROTOCOL_VERSION, os.getpid(), f"park-{tag}", pid_namespace())))
        if not sock.poll(10_000):
            raise SystemExit("no Welcome")
        assert isinstance(decoder.decode(sock.recv()), Welcome)
        socks.append(sock)
    for s, sock in enumerate(socks):
        for i in range(n):
            keys = [f"never-{tag}-{s}-{i}-{j}" for j in range(nkeys)]
            sock.send(encoder.encode(Acquire(i + 2, "default", keys, wait_s)))
    # Replies: a refusal comes at once; a parked request is answered only when its wait ends.
    # Count what comes until the daemon has been quiet for a while.
    refused, other = 0, 0
    poller = zmq.Poller()
    for sock in socks:
        poller.register(sock, zmq.POLLIN)
    deadline = time.monotonic() + 1.5
    while (left := deadline - time.monotonic()) > 0:
        for sock, _ in poller.poll(int(left * 1000) + 1):
            reply = decoder.decode(sock.recv())
            if isinstance(reply, Error) and reply.code == Code.LIMIT:
                refused += 1
            else:
                other += 1
            deadline = max(deadline, time.monotonic() + 0.5)
    say(f"parked {n * sessions} {refused} {other}")
    while True:
        time.sleep(60)


KEYS_PER_PRODUCER = 3
HEADER = 2  # int32 words: crc32 of the key, version


def versioned_payload(key: str, version: int) -> np.ndarray:
    """The only bytes a read of `key` at `version` may return: header [crc32(key), version], then
    words derived from both; 1 to 2.5 MiB depending on the version (extents of several sizes)."""
    numel = (256 << 10) + (version % 4) * (128 << 10)
    seed = np.uint32(zlib.crc32(f"{key}@{version}".encode()))
    values = (np.arange(numel, dtype=np.uint32) * np.uint32(2654435761)) ^ seed
    values[0], values[1] = zlib.crc32(key.encode()), version
    return values.view(np.int32)


def version_of(key: str, data: np.ndarray) -> int | None:
    """The version `data` claims to be, if it is exactly that version's payload; else None."""
    if data.dtype != np.int32 or data.size < HEADER or np.uint32(data[0]) != zlib.crc32(key.encode()):
        return None
    version = int(data[1])
    if version < 0:
        return None
    want = versioned_payload(key, version)
    return version if want.size == data.size and np.array_equal(want, data) else None


def _log_call(log, record: dict) -> None:
    log.write(json.dumps(record) + "\n")


def produce(endpoint: str, ident: str, log_path: str, stop_path: str, timeout: float) -> None:
    import torch
    import ecd
    from ecd import Client, EcdError
    log = open(log_path, "a", buffering=1)
    client, version = None, 0
    while not os.path.exists(stop_path):
        start = time.monotonic()
        if client is None:
            try:
                client = Client(endpoint, timeout=timeout)
            except ecd.DaemonUnavailable:
                time.sleep(0.05)
            continue
        version += 1
        key = f"p{ident}-k{version % KEYS_PER_PRODUCER}"
        outcome = "ok"
        try:
            client.put(key, torch.from_numpy(versioned_payload(key, version)))
        except ecd.DaemonUnavailable:
            outcome = "unavailable"
        except EcdError as exc:
            outcome = type(exc).__name__
        _log_call(log, {"op": "put", "key": key, "version": version, "start": start,
                        "end": time.monotonic(), "outcome": outcome})
        if outcome != "ok":
            time.sleep(0.05)
    if client is not None:
        client.close()
    _log_call(log, {"op": "stopped"})


def consume(endpoint: str, ident: str, log_path: str, stop_path: str, timeout: float, producers: int,
            threads: int = 2) -> None:
    """`threads` reader threads sharing one Client (as an engine's threads do)."""
    import threading

    import ecd
    from ecd import Client, EcdError, KeyNotFound
    log = open(log_path, "a", buffering=1)
    log_lock = threading.Lock()
    client = None
    while client is None and not os.path.exists(stop_path):
        try:
            client = Client(endpoint, timeout=timeout)
        except ecd.DaemonUnavailable:
            time.sleep(0.05)

    def reader(n: int) -> None:
        rng = random.Random(f"{ident}-{n}")
        while not os.path.exists(stop_path):
            start = time.monotonic()
            key = f"p{rng.randrange(producers)}-k{rng.randrange(KEYS_PER_PRODUCER)}"
            outcome, version = "ok", None
            try:
                if rng.random() < 0.5:
                    version = version_of(key, client.get(key).numpy())
                else:
                    with client.view(key) as v:
                        version = version_of(key, v.numpy())
                if version is None:
                    outcome = "mismatch"
            except KeyNotFound:
                outcome = "missing"
            except ecd.DaemonUnavailable:
                outcome = "unavailable"
            except EcdError as exc:
                outcome = type(exc).__name__
            with log_lock:
                _log_call(log, {"op": "get", "key": key, "version": version, "start": start,
                                "end": time.monotonic(), "outcome": outcome})
            if outcome == "unavailable":
                time.sleep(0.05)

    if client is not None:
        workers = [threading.Thread(target=reader, args=(n,)) for n in range(threads)]
        for t in workers:
            t.start()
        for t in workers:
            t.join()
        client.close()
    _log_call(log, {"op": "stopped"})


def fleet(endpoint: str, workdir: str, stop_path: str, timeout: float, producers: int, consumers: int,
          threads: int) -> None:
    """`producers` produce and `consumers` consume processes, forked from this one once it has
    imported torch and ecd (nine cold starts of torch would take most of a test's time on a
    small machine). Each child is its own process, pid and daemon session; logs go to
    WORKDIR/p<i>.jsonl and WORKDIR/c<i>.jsonl. Exits when every child has."""
    import torch  # noqa: F401  (imported before the fork, in no thread of its own yet)
    import ecd.client.client  # noqa: F401
    children = []
    jobs = [(produce, (endpoint, str(i), f"{workdir}/p{i}.jsonl", stop_path, timeout)) for i in range(producers)]
    jobs += [(consume, (endpoint, str(i), f"{workdir}/c{i}.jsonl", stop_path, timeout, producers, threads))
             for i in range(consumers)]
    for job, args in jobs:
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                job(*args)
            except BaseException:
                import traceback
                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                os._exit(code)
        children.append(pid)
    failed = 0
    for pid in children:
        _, status = os.waitpid(pid, 0)
        failed += status != 0
    sys.exit(1 if failed else 0)


def main() -> None:
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "park":
        park(args[0], int(args[1]), int(args[2]), float(args[3]), args[4], int(args[5]) if len(args) > 5 else 1)
    elif mode == "fleet":
        fleet(args[0], args[1], args[2], float(args[3]), int(args[4]), int(args[5]), int(args[6]))
    elif mode == "produce":
        produce(args[0], args[1], args[2], args[3], float(args[4]))
    elif mode == "consume":
        consume(args[0], args[1], args[2], args[3], float(args[4]), int(args[5]), *map(int, args[6:7]))
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
