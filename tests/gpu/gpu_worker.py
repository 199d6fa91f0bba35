"""A producer or consumer process for the GPU tests: one command, one line of output.

    gpu_worker.py ENDPOINT put KEY SEED NUMEL DTYPE DEVICE TIER [hold]
    gpu_worker.py ENDPOINT get KEY DEVICE
    gpu_worker.py ENDPOINT view KEY
    gpu_worker.py ENDPOINT put-stall KEY SEED NUMEL DTYPE DEVICE

Prints "ok <checksum> <device>" (put: of the tensor it stored; get/view: of what it read).
With `hold`, put prints its line and then sleeps until killed (a producer SIGKILLed after
publishing). TIER is none, host or cuda; DEVICE of get is none, cpu or cuda:N.

put-stall is a producer caught mid-put: it allocates an extent for KEY in the arena of DEVICE
(a raw Alloc, as the put route's own allocate sends it), copies the first HALF of the tensor's
bytes into it on the device, synchronizes, prints "allocated <pool> <offset>" and sleeps until
killed, never committing.
"""
from __future__ import annotations

import sys
import time

import torch

from ecd import Client
from ecd.client.cuda import tensor_checksum
from ecd.client.tensors import dtype_name
from ecd.protocol import Alloc, AllocItem, Extent


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
    elif cmd == "put-stall":
        seed, numel, dtype, device = rest
        t = make(int(seed), int(numel), dtype, device)
        nbytes = t.numel() * t.element_size()
        plane = c.cuda_plane()
        arena = plane.tier_for(t, "cuda")  # the arena on the tensor's device (raises without one)
        item = AllocItem(key, dtype_name(t.dtype), list(t.shape), nbytes)
        (ext,) = c.request(Alloc(0, c.namespace, [item], arena=arena)).results
        if not isinstance(ext, Extent):
            raise SystemExit(f"alloc failed: {ext!r}")
        half = nbytes // 2
        dst = plane.arena_bytes(ext.pool, ext.offset, nbytes)  # a CUDA uint8 tensor over the extent
        dst[:half].copy_(t.reshape(-1).view(torch.uint8)[:half])
        torch.cuda.synchronize(t.device)
        print(f"allocated {ext.pool} {ext.offset}", flush=True)
        while True:  # never commits: killed mid-put
            time.sleep(60)
    else:
        raise SystemExit(f"unknown command {cmd!r}")
    c.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
