"""Client processes for the chaos tests, and the payload scheme every chaos test writes.

A key is `NAME#NUMEL`; its payload is NUMEL int32 values derived from the key alone, so any
process can recompute what a read must return and a corrupted read is always detected.

Run as a script, one mode per process (all output is flushed line by line):
  serve ENDPOINT [NS]          stdin commands, one answer line each:
      put KEY | get KEY [WAIT] | view-hold KEY | drop | exists KEY... | ring | ping |
      alloc-stuck KEY NBYTES | quit
      get/view-hold answer ok / mismatch / missing / error NAME MESSAGE; ring answers
      "ok OVERRUNS CACHED" (this client's ring-reader overruns and cached locations)
  probe ENDPOINT               a fresh process: put, get, view, delete one new key -> "ok"
  loop ENDPOINT ID LOG STOP TIMEOUT
                               put/get forever (until the file STOP exists) with a Client of that
                               timeout; one JSON line per call in LOG
  mixed ENDPOINT ID SEED       random put/get/view/exists(pin)/parked get/delete forever; says
                               "tick N" every 10 calls and "MISMATCH KEY" on a corrupted read
  slow-put ENDPOINT KEY NUMEL  a put of garbage under KEY whose copy stops halfway: says
                               "copying" with half the bytes written, then sleeps
  stop-after-alloc ENDPOINT KEY NUMEL
                               a put of garbage under KEY that SIGSTOPs itself right after its
                               Alloc is answered; after SIGCONT says "ok" or "error NAME MESSAGE"
  produce ENDPOINT N           N puts of small keys plus deletes: ring events -> "done SECONDS"
"""
from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
import zlib

import numpy as np
import torch

import ecd
from ecd import Client, EcdError, KeyNotFound


def payload(key: str) -> torch.Tensor:
    """The only bytes a read of `key` may return."""
    numel = int(key.rsplit("#", 1)[1])
    seed = np.uint32(zlib.crc32(key.encode()))
    values = (np.arange(numel, dtype=np.uint32) * np.uint32(2654435761)) ^ seed
    return torch.from_numpy(values.view(np.int32))


def garbage(numel: int) -> torch.Tensor:
    """Bytes no key's payload has (every payload word differs between neighbours)."""
    return torch.full((numel,), 0x7BADBEEF, dtype=torch.int32)


def matches(key: str, tensor: torch.Tensor) -> bool:
    return tensor.dtype == torch.int32 and torch.equal(tensor, payload(key))


def say(text: str) -> None:
    print(text, flush=True)


def serve(endpoint: str, namespace: str = "default") -> None:
    from ecd.protocol import Alloc, AllocItem
    client = Client(endpoint, namespace=namespace, timeout=10.0)
    held = None
    say("ready")
    for line in sys.stdin:
        cmd, *args = line.split()
        try:
            if cmd == "quit":
                break
            if cmd == "ping":
                client.ping()
                say("ok")
            elif cmd == "put":
                client.put(args[0], payload(args[0]))
                say("ok")
            elif cmd == "get":
                got = client.get(args[0], timeout=float(args[1]) if len(args) > 1 else None)
                say("ok" if matches(args[0], got) else "mismatch")
            elif cmd == "view-hold":
                held = client.view(args[0])
                view = held.__enter__()
                say("ok" if matches(args[0], view) else "mismatch")
            elif cmd == "drop":
                held.__exit__(None, None, None)
                held = None
                client.ping()  # the release is ordered before this round trip
                say("ok")
            elif cmd == "exists":
                say("ok " + " ".join(str(x) for x in client.exists(args)))
            elif cmd == "ring":
                say(f"ok {client.mapping.ring.overruns} {len(client.location_cache)}")
            elif cmd == "alloc-stuck":
                nbytes = int(args[1])
                reply = client.request(Alloc(0, namespace,
                                             [AllocItem(args[0], "uint8", [nbytes], nbytes)]))
                say(f"allocated {reply.results[0].generation}")
            else:
                say(f"error Unknown {cmd}")
        except KeyNotFound:
            say("missing")
        except EcdError as exc:
            say(f"error {type(exc).__name__} {exc}")
    client.close()


def probe(endpoint: str) -> None:
    key = f"probe-{os.getpid()}#300000"  # 1.2 MB: the Alloc/copy/Commit path, not inline
    with Client(endpoint, timeout=10.0) as c:
        c.put(key, payload(key))
        assert matches(key, c.get(key)), "probe: get returned other bytes"
        with c.view(key) as v:
            assert matches(key, v), "probe: view shows other bytes"
        assert c.exists(key) is True
        assert c.delete(key) is True
        assert c.exists(key) is False
    say("ok")


def loop(endpoint: str, ident: str, log_path: str, stop_path: str, timeout: float) -> None:
    """Steady load; every call is timed and logged, whatever it raises."""
    rng = random.Random(ident)
    log = open(log_path, "a", buffering=1)
    client, last_put, i = None, None, 0
    while not os.path.exists(stop_path):
        i += 1
        if client is None:
            op, key = "connect", ""
        elif last_put is None or i % 2:
            op, key = "put", f"w{ident}-{i % 16}#{rng.choice([10, 30_000, 200_000])}"
        else:
            op, key = "get", last_put
        start = time.monotonic()
        outcome = "ok"
        try:
            if op == "connect":
                client = Client(endpoint, timeout=timeout)
            elif op == "put":
                client.put(key, payload(key))
                last_put = key
            elif not matches(key, client.get(key)):
                outcome = "mismatch"
        except KeyNotFound:
            outcome = "missing"  # lost with a killed daemon: fine, never wrong bytes
        except ecd.DaemonUnavailable:
            outcome = "unavailable"
        except EcdError as exc:
            outcome = type(exc).__name__
        end = time.monotonic()
        log.write(json.dumps({"op": op, "key": key, "start": start, "end": end, "outcome": outcome}) + "\n")
        if outcome == "unavailable":
            time.sleep(0.05)
    if client is not None:
        client.close()
    log.write(json.dumps({"op": "stopped"}) + "\n")


def mixed(endpoint: str, ident: str, seed: int) -> None:
    rng = random.Random(seed)
    with Client(endpoint, timeout=10.0) as c:
        n = 0
        while True:
            n += 1
            key = f"m{rng.randrange(24)}#{rng.choice([16, 20_000, 250_000, 1_000_000])}"
            r = rng.random()
            try:
                if r < 0.35:
                    c.put(key, payload(key))
                elif r < 0.55:
                    if not matches(key, c.get(key)):
                        say(f"MISMATCH {key}")
                elif r < 0.7:
                    with c.view(key) as v:
                        if not matches(key, v):
                            say(f"MISMATCH {key}")
                        time.sleep(rng.random() * 0.05)
                elif r < 0.8:
                    c.exists([key, f"absent-{n}#1"], pin_s=rng.choice([0, 30]))
                elif r < 0.9:
                    got = c.get(key, timeout=rng.random() * 0.3)  # parks until someone puts it
                    if not matches(key, got):
                        say(f"MISMATCH {key}")
                else:
                    c.delete(key)
            except KeyNotFound:
                pass
            except ecd.PoolFull:
                pass
            if n % 10 == 0:
                say(f"tick {n}")


def slow_put(endpoint: str, key: str, numel: int) -> None:
    import ecd.client.put as put_module  # the put route's copy step
    real_copy = put_module.copy_into

    def half_then_hang(buf, offset, tensor, **kwargs):
        half = tensor.numel() // 2
        real_copy(buf, offset, tensor[:half], **kwargs)
        say("copying")
        while True:
            time.sleep(60)

    put_module.copy_into = half_then_hang
    with Client(endpoint, timeout=10.0, submit=False) as c:  # the round-trip route: a WRITING entry
        c.put(key, garbage(numel))


def stop_after_alloc(endpoint: str, key: str, numel: int) -> None:
    from ecd.client.testing import intercept_round_trips
    from ecd.protocol import Alloc
    c = Client(endpoint, timeout=10.0, submit=False)  # the round-trip route: it stops after its Alloc

    def call(request, send):
        reply = send(request)
        if isinstance(request, Alloc):
            say(f"allocated {reply.results[0].generation}")
            os.kill(os.getpid(), signal.SIGSTOP)  # stuck here until SIGCONT
        return reply

    try:
        with intercept_round_trips(c, call):
            c.put(key, garbage(numel))
        say("ok")
    except EcdError as exc:
        say(f"error {type(exc).__name__} {exc}")
    c.close()


def produce(endpoint: str, n: int) -> None:
    start = time.monotonic()
    with Client(endpoint, timeout=10.0) as c:
        for i in range(n):
            key = f"p{i}#4"
            c.put(key, payload(key))  # inline: one round trip, one PUBLISHED event
            if i % 2:
                c.delete(key)  # and a DELETED event
    say(f"done {time.monotonic() - start:.3f}")


def main() -> None:
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "serve":
        serve(*args)
    elif mode == "probe":
        probe(args[0])
    elif mode == "loop":
        loop(args[0], args[1], args[2], args[3], float(args[4]))
    elif mode == "mixed":
        mixed(args[0], args[1], int(args[2]))
    elif mode == "slow-put":
        slow_put(args[0], args[1], int(args[2]))
    elif mode == "stop-after-alloc":
        stop_after_alloc(args[0], args[1], int(args[2]))
    elif mode == "produce":
        produce(args[0], int(args[1]))
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
