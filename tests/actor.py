"""A client process for tests: reads one command per line on stdin, answers one line on stdout.

Tensors are derived from a seed so producer and consumer agree without sharing bytes:
  put KEY SEED NUMEL [DTYPE]        -> ok
  put-nowait KEY SEED NUMEL         -> ok (returns once copied: put(wait=False))
  flush                             -> ok | error NAME MESSAGE
  get KEY SEED NUMEL [TIMEOUT]      -> ok | mismatch | missing | error NAME MESSAGE
  view-hold KEY SEED NUMEL          -> holding (then keeps the view until `drop`) | mismatch
  drop                              -> ok (ends a view-hold)
  alloc-stuck KEY NBYTES            -> allocated GENERATION (never commits)
  exists KEY...                     -> ok True False ...
  ping                              -> ok
"""
from __future__ import annotations

import sys

import torch

from ecd import Client, EcdError, KeyNotFound
from ecd.protocol import Alloc, AllocItem

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int64": torch.int64, "uint8": torch.uint8}


def make_tensor(seed: int, numel: int, dtype: str = "float32") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(numel, generator=g) * 100).to(DTYPES[dtype])


def main() -> None:
    endpoint, namespace = sys.argv[1], sys.argv[2]
    client = Client(endpoint, namespace=namespace, timeout=5.0)
    held = None

    def say(text: str) -> None:
        print(text, flush=True)

    for line in sys.stdin:
        cmd, *args = line.split()
        try:
            if cmd == "ping":
                client.ping()
                say("ok")
            elif cmd == "put":
                dtype = args[3] if len(args) > 3 else "float32"
                client.put(args[0], make_tensor(int(args[1]), int(args[2]), dtype))
                say("ok")
            elif cmd == "put-nowait":
                client.put(args[0], make_tensor(int(args[1]), int(args[2])), wait=False)
                say("ok")
            elif cmd == "flush":
                client.flush()
                say("ok")
            elif cmd == "get":
                timeout = float(args[3]) if len(args) > 3 else None
                got = client.get(args[0], timeout=timeout)
                say("ok" if torch.equal(got, make_tensor(int(args[1]), int(args[2]))) else "mismatch")
            elif cmd == "view-hold":
                held = client.view(args[0])
                view = held.__enter__()
                say("holding" if torch.equal(view, make_tensor(int(args[1]), int(args[2]))) else "mismatch")
            elif cmd == "drop":
                held.__exit__(None, None, None)
                held = None
                say("ok")
            elif cmd == "alloc-stuck":
                reply = client.request(Alloc(0, namespace,
                                             [AllocItem(args[0], "uint8", [int(args[1])], int(args[1]))]))
                say(f"allocated {reply.results[0].generation}")
            elif cmd == "exists":
                say("ok " + " ".join(str(x) for x in client.exists(args)))
            elif cmd == "pin":  # pin SECONDS KEY...
                say("ok " + " ".join(str(x) for x in client.exists(args[1:], pin_s=float(args[0]))))
            else:
                say(f"error Unknown {cmd}")
        except KeyNotFound:
            say("missing")
        except EcdError as exc:
            say(f"error {type(exc).__name__} {exc}")
    client.close()


if __name__ == "__main__":
    main()
