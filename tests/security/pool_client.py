"""An honest client process for test_pool_truncation.py: it maps the pool, so a truncated pool
file could kill it (SIGBUS) without taking the test runner with it. One command per line on
stdin, one answer per line on stdout. Tensors derive from a seed, so the test knows the truth:
  put KEY SEED NUMEL [persist]  -> ok | error NAME MESSAGE
  get KEY SEED NUMEL            -> ok | mismatch | missing | error NAME MESSAGE   (verify=True)
"""
from __future__ import annotations

import sys

import torch

from ecd import Client, EcdError, KeyNotFound


def make_tensor(seed: int, numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=g) + 1.0  # never all zeros: a cut reads as zeros


def main() -> None:
    client = Client(sys.argv[1], timeout=10.0)
    for line in sys.stdin:
        cmd, key, seed, numel, *rest = line.split()
        try:
            if cmd == "put":
                client.put(key, make_tensor(int(seed), int(numel)), checksum=True, persist=rest == ["persist"])
                answer = "ok"
            else:
                got = client.get(key, verify=True)
                answer = "ok" if torch.equal(got, make_tensor(int(seed), int(numel))) else "mismatch"
        except KeyNotFound:
            answer = "missing"
        except EcdError as exc:
            answer = f"error {type(exc).__name__} {exc}"
        print(answer, flush=True)
    client.close()


if __name__ == "__main__":
    main()
