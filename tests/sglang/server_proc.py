"""One "SGLang server" for test_two_servers.py: its own process, its own real host KV pool and its
own EcdHiCacheStorage made by SGLang's factory. `store` fills its pool from a seed and backs pages
up; `load` asks batch_exists and loads them into other slots of its own pool, then checks them
against the pages the seed makes. Prints one JSON line."""
from __future__ import annotations

import json
import sys

import torch
from sglang_env import fill, make_backend, mha_host_pool, pages, slots


def main() -> None:
    endpoint, role, layout, seed, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    keys = [f"chain-{seed}-{i}" for i in range(n)]
    host = mha_host_pool(layout)
    backend = make_backend(endpoint, host)
    out: dict = {"namespace": backend.namespace}
    if role == "store":
        fill(host, seed)
        out["stored"] = backend.batch_set_v1(keys, slots(0, n))
    else:
        reference = mha_host_pool(layout)
        fill(reference, seed)
        out["exists"] = backend.batch_exists(keys + ["never-stored"])
        out["loaded"] = backend.batch_get_v1(keys, slots(64, n))
        out["exact"] = all(torch.equal(a, b) for a, b in zip(pages(reference, 0, n), pages(host, 64, n)))
        out["counters"] = backend.counters
    backend.close()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
