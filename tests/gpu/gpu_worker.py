"""A producer or consumer process for the GPU tests: one command, one line of output.

    gpu_worker.py ENDPOINT put KEY SEED NUMEL DTYPE DEVICE TIER [hold]
    gpu_worker.py ENDPOINT get KEY DEVICE
    gpu_worker.py ENDPOINT view KEY

Prints "ok <checksum> <device>" (put: of the tensor it stored; get/view: of what it read).
With `hold`, put prints its line and then sleeps until killed (a producer SIGKILLed after
publishing). TIER is none, host or cuda; DEVICE of get is none, cpu or cuda:N.
"""
from __future__ import annotations

import sys
import time

import torch

from ecd import Client
from ecd.client.cuda import tensor_checksum


def make(seed: int, numel: int, dtype: str, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=g).to(getattr(torch, dtype)).to(device)


def main(argv: list[str]) -> int:
    endpoint, cmd, key, *rest = argv
    c = Client(endpoint, timeout=30)
    if cmd == "put":
        seed, numel, dtype, device, tier, *hold = rest
        t = make(int(seed), int(numel), dtype, device)
        c.put(key, t, tier=None if tier == "none" else tier)
        print(f"ok {tensor_checksum(t)} {t.device}", flush=True)
        if hold:
            while True:
                time.sleep(60)
    elif cmd == "get":
        device = None if rest[0] == "none" else rest[0]
        t = c.get(key, timeout=10, device=device)
        print(f"ok {tensor_checksum(t)} {t.device}", flush=True)
    elif cmd == "view":
        with c.view(key, timeout=10) as v:
            print(f"ok {tensor_checksum(v)} {v.device}", flush=True)
    else:
        raise SystemExit(f"unknown command {cmd!r}")
    c.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
