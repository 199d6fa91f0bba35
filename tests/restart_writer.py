"""A writer process for the restart tests (tests/integration/test_restart.py).

  write ENDPOINT ID SEED ENTRIES LOG NAMESPACES
      ENTRIES puts of new keys (1 byte to 3 MiB, spread over the comma-separated NAMESPACES,
      some with checksums), with replaces and deletes of earlier keys among them, in an order
      SEED fixes. One Client per namespace, made once at the start and never made again: across a
      daemon restart they must carry on by themselves. Each operation is retried until it
      returns (a restart makes some fail); LOG gets one JSON line when an operation begins
      (op, ns, key, and for a put the blake2b digest and size of the bytes it writes), one per
      failed try and one when it returned, then {"end": ...}.
  stale-put ENDPOINT KEY NBYTES [COUNT]
      a put of NBYTES (the bytes `payload(KEY, 0, NBYTES)`; with COUNT, a put_many of COUNT such
      keys KEY0, KEY1, ...) that says "allocated POOL OFFSET" (the first extent) once its first
      Alloc is answered and SIGSTOPs itself there; after SIGCONT it copies and commits, and says
      "ok" or "error NAME MESSAGE".
  hold ENDPOINT
      stdin commands, one answer line each: "view KEY VERSION NBYTES" takes a view of KEY and
      keeps it ("ok", or "mismatch" when it does not show payload(KEY, VERSION, NBYTES));
      "check" says "ok" while the view still shows those bytes, "changed" once it does not;
      "drop" releases it ("ok"); "ping" makes one round trip ("ok": after a restart, the
      client's reconnection).
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import sys
import time

import numpy as np
import torch

from ecd import Client, EcdError

RETRY_FOR_S = 120.0  # an operation that has not returned by then ends the writer (the test fails)


def payload(key: str, version: int, nbytes: int) -> torch.Tensor:
    """The bytes a put of `key`'s `version` writes: any process can make them again."""
    seed = int.from_bytes(hashlib.blake2b(f"{key}@{version}".encode(), digest_size=8).digest(), "little")
    data = np.random.default_rng(seed).bytes(nbytes)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def digest(tensor: torch.Tensor) -> str:
    return hashlib.blake2b(tensor.numpy().tobytes(), digest_size=16).hexdigest()


def entry_size(rng: random.Random) -> int:
    r = rng.random()
    if r < 0.79:
        return rng.randint(1, 4096)
    if r < 0.99:
        return rng.randint(4097, 96 << 10)
    return rng.randint(256 << 10, 3 << 20)


def plan(ident: str, seed: int, entries: int, namespaces: list[str]) -> list[dict]:
    """The writer's operations, in order: puts of new keys, replaces and deletes of live ones."""
    rng = random.Random(seed)
    ops: list[dict] = []
    live: list[tuple[str, str]] = []
    versions: dict[tuple[str, str], int] = {}
    for i in range(entries):
        ns, key = rng.choice(namespaces), f"w{ident}-{i}"
        ops.append({"op": "put", "ns": ns, "key": key, "version": 0, "nbytes": entry_size(rng),
                    "checksum": rng.random() < 0.2})
        live.append((ns, key))
        versions[(ns, key)] = 0
        r = rng.random()
        if r < 0.08 and len(live) > 1:  # replace an earlier key (maybe with another size)
            ns_old, old = rng.choice(live[:-1])
            versions[(ns_old, old)] += 1
            ops.append({"op": "put", "ns": ns_old, "key": old, "version": versions[(ns_old, old)],
                        "nbytes": entry_size(rng), "checksum": rng.random() < 0.2})
        elif r < 0.12 and len(live) > 1:  # delete an earlier key
            ns_old, old = live.pop(rng.randrange(len(live) - 1))
            ops.append({"op": "delete", "ns": ns_old, "key": old})
    return ops


def write(endpoint: str, ident: str, seed: int, entries: int, log_path: str, namespaces: list[str]) -> None:
    clients = {ns: Client(endpoint, namespace=ns, timeout=2.0) for ns in namespaces}
    log = open(log_path, "a", buffering=1)

    def note(record: dict) -> None:
        log.write(json.dumps(record) + "\n")

    for i, op in enumerate(plan(ident, seed, entries, namespaces)):
        client = clients[op["ns"]]
        tensor = payload(op["key"], op["version"], op["nbytes"]) if op["op"] == "put" else None
        note({"i": i, "op": op["op"], "ns": op["ns"], "key": op["key"],
              **({"digest": digest(tensor), "nbytes": op["nbytes"]} if tensor is not None else {})})
        give_up = time.monotonic() + RETRY_FOR_S
        tries = 0
        while True:
            tries += 1
            try:
                if tensor is not None:
                    client.put(op["key"], tensor, checksum=op["checksum"])
                else:
                    client.delete(op["key"])
                break
            except EcdError as exc:
                note({"i": i, "fail": type(exc).__name__})
                if time.monotonic() > give_up:
                    raise
                time.sleep(0.05)
        note({"i": i, "done": time.monotonic(), "tries": tries})
    note({"end": time.monotonic(), "epochs": sorted({c.epoch for c in clients.values()})})
    for client in clients.values():
        client.close()


def stale_put(endpoint: str, key: str, nbytes: int, count: int = 0) -> None:
    from ecd.client.testing import intercept_round_trips
    from ecd.protocol import Alloc
    client = Client(endpoint, timeout=5.0, submit=False)  # the round-trip route: it stops after its Alloc
    stopped = []

    def call(request, send):
        reply = send(request)
        if isinstance(request, Alloc) and not stopped:
            stopped.append(True)
            extent = reply.results[0]
            print(f"allocated {extent.pool} {extent.offset}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)  # here until SIGCONT: the daemon is restarted meanwhile
        return reply

    try:
        with intercept_round_trips(client, call):
            if count:
                client.put_many({f"{key}{i}": payload(f"{key}{i}", 0, nbytes) for i in range(count)})
            else:
                client.put(key, payload(key, 0, nbytes))
        print("ok", flush=True)
    except EcdError as exc:
        print(f"error {type(exc).__name__} {exc}", flush=True)
    client.close()


def hold(endpoint: str) -> None:
    client = Client(endpoint, timeout=5.0)
    held = view = expected = None
    for line in sys.stdin:
        cmd, *args = line.split()
        try:
            if cmd == "view":
                expected = digest(payload(args[0], int(args[1]), int(args[2])))
                held = client.view(args[0])
                view = held.__enter__()
                print("ok" if digest(view) == expected else "mismatch", flush=True)
            elif cmd == "check":
                print("ok" if digest(view) == expected else "changed", flush=True)
            elif cmd == "ping":
                client.ping()
                print("ok", flush=True)
            elif cmd == "drop":
                held.__exit__(None, None, None)
                held = view = None
                print("ok", flush=True)
        except EcdError as exc:
            print(f"error {type(exc).__name__} {exc}", flush=True)
    client.close()


def main() -> None:
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "write":
        write(args[0], args[1], int(args[2]), int(args[3]), args[4], args[5].split(","))
    elif mode == "hold":
        hold(args[0])
    elif mode == "stale-put":
        stale_put(args[0], args[1], int(args[2]), int(args[3]) if len(args) > 3 else 0)
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
