"""A client process of one uid, for tests/security/test_tenants.py: it drops root to that uid
(after its imports: this Python's files need not be that user's to read), does one thing with
ecd's Client, and prints what it saw as one JSON line.

    tenant_client.py ENDPOINT UID GID GROUPS put NS KEY SEED   put 1 MiB of float32 from torch.manual_seed(SEED)
    tenant_client.py ENDPOINT UID GID GROUPS probe NS KEY...  what get, exists, view and keys say of each key
    tenant_client.py ENDPOINT UID GID GROUPS check NS KEY SEED whether KEY holds SEED's bytes
    tenant_client.py ENDPOINT UID GID GROUPS evict-all NS     evict(everything=True): how many went
    tenant_client.py ENDPOINT UID GID GROUPS fill NS PREFIX N SEED  put PREFIX-0..N-1 (SEED+i's bytes): the refusals
    tenant_client.py ENDPOINT UID GID GROUPS survey NS PREFIX N SEED which of PREFIX-i hold SEED+i's bytes
    tenant_client.py ENDPOINT UID GID GROUPS put-big NS KEY MIB   put MIB MiB of zeros: its refusal, if any
    tenant_client.py ENDPOINT UID GID GROUPS fetch NS PEER KEY SEED fetch KEY from PEER: whether it came, and SEED's bytes
    tenant_client.py ENDPOINT UID GID GROUPS secret NS KEY SEED  put 16 MiB of random bytes from SEED
    tenant_client.py ENDPOINT UID GID GROUPS scan NS SEED        whether any pool mapping it holds has 4 KiB of them
    tenant_client.py ENDPOINT UID GID GROUPS fds NS              ask the fd socket for the pool (no hello): what came
(GROUPS: comma-separated supplementary gids, "-" for none.)
"""
from __future__ import annotations

import ctypes
import json
import os
import sys

import torch

from ecd import Client
from ecd.errors import EcdError, KeyNotFound

PATTERN_ELEMENTS = 1 << 18  # 1 MiB of float32
SECRET_BYTES = 16 << 20


def pattern(seed: int) -> torch.Tensor:
    return torch.randn(PATTERN_ELEMENTS, generator=torch.Generator().manual_seed(seed))


def secret(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (SECRET_BYTES,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def main() -> None:
    endpoint, uid, gid, groups, what, ns, *rest = sys.argv[1:]
    os.setgroups([int(g) for g in groups.split(",")] if groups != "-" else [])
    os.setgid(int(gid))
    os.setuid(int(uid))
    out: dict = {"uid": os.getuid()}
    if what == "fds":  # the fd socket alone, as a process would that never says hello
        from ecd.fd_passing import FdFetchError, fd_socket_path, receive
        try:
            _, items = receive(fd_socket_path(endpoint.removeprefix("ipc://")), 10.0)
            out["fds"] = len(items)
            out["items"] = sorted([item.kind, item.index] for item, _ in items)
            for _, fd in items:
                os.close(fd)
        except FdFetchError as exc:
            out["refused"] = str(exc)
        print(json.dumps(out), flush=True)
        return
    try:
        with Client(endpoint, namespace=ns, timeout=30.0) as c:
            out["tenant"] = c.welcome.tenant
            if what == "put":
                c.put(rest[0], pattern(int(rest[1])))
                out["put"] = True
            elif what == "evict-all":  # the operator request at its widest: "everything"
                out["evicted"] = c.evict(everything=True)["evicted"]
            elif what == "fill":
                prefix, n, seed = rest[0], int(rest[1]), int(rest[2])
                refused = []
                for i in range(n):
                    try:
                        c.put(f"{prefix}-{i}", pattern(seed + i))
                    except EcdError as exc:
                        refused.append(f"{i}: {type(exc).__name__}: {exc}")
                out["refused"] = refused
            elif what == "survey":
                prefix, n, seed = rest[0], int(rest[1]), int(rest[2])
                out["intact"], out["wrong"] = [], []
                for i in range(n):
                    try:
                        same = bool(torch.equal(c.get(f"{prefix}-{i}"), pattern(seed + i)))
                    except KeyNotFound:
                        continue
                    out["intact" if same else "wrong"].append(i)
            elif what == "fetch":
                out["fetched"] = c.fetch([rest[1]], peer=rest[0], timeout=20)[0]
                if out["fetched"]:
                    out["same"] = bool(torch.equal(c.get(rest[1]), pattern(int(rest[2]))))
            elif what == "secret":
                c.put(rest[0], secret(int(rest[1])))
                out["put"] = True
            elif what == "scan":  # every shared mapping and memfd this process can reach, read whole
                needle = secret(int(rest[0]))[SECRET_BYTES // 2:SECRET_BYTES // 2 + 4096].numpy().tobytes()
                out.update(scan_reachable(needle))
                if len(rest) > 1:  # and a tenant's stored namespace (as the rings' entry index names it)
                    out["name_found"] = scan_reachable(f"{rest[1]}\0{ns}".encode())["found"]
            elif what == "local":  # where its pages are; a put, a get and a view of it, and the round trips they took
                out["pools"] = [p.index for p in c.welcome.pools]
                out["read_slots"], out["submissions"] = c.welcome.ring.read_slots, c.welcome.ring.submissions
                before = c.stats()["ops"]
                c.put(rest[0], pattern(int(rest[1])))
                same = bool(torch.equal(c.get(rest[0]), pattern(int(rest[1]))))
                with c.view(rest[0]) as viewed:
                    out["same"] = same and bool(torch.equal(viewed, pattern(int(rest[1]))))
                after = c.stats()["ops"]
                out["ops"] = {op: after.get(op, 0) - before.get(op, 0) for op in ("alloc", "acquire", "commit")}
            elif what == "forge-slots":  # every slot of its page names generations 1..N (views of whatever
                import numpy as np  # they are), held until stdin closes
                pool, offset, slots = c.welcome.ring.read_slots
                words = np.frombuffer(c.mapping.rw[pool], np.uint64, count=2 * slots, offset=offset)
                first = int(rest[0])
                words[0::2] = np.arange(first, first + slots, dtype=np.uint64)
                words[1::2] = 0
                print(json.dumps({"forged": slots, "pool": pool}), flush=True)
                sys.stdin.read()
            elif what == "pin-fill":  # n 1 MiB entries, then a pin of each: how many were taken
                keys = [f"{rest[0]}-{i}" for i in range(int(rest[1]))]
                for i, key in enumerate(keys):
                    c.put(key, pattern(int(rest[2]) + i))
                out["pinned"] = sum(c.exists(keys, pin_s=600))
            elif what == "pools":  # Stats' (capacity, used) per pool, as this client is shown them
                out["pools"] = c.stats()["pools"]
            elif what == "put-big":
                c.put(rest[0], torch.zeros(int(rest[1]) << 18))
                out["put"] = True
            elif what == "check":  # (and how many Acquires the daemon saw meanwhile: the node's count)
                before = c.stats()["ops"].get("acquire", 0)
                out["same"] = bool(torch.equal(c.get(rest[0]), pattern(int(rest[1]))))
                out["acquires"] = c.stats()["ops"].get("acquire", 0) - before
            elif what == "probe":
                for key in rest:
                    seen = {"exists": c.exists(key)}
                    try:
                        c.get(key)
                        seen["get"] = "hit"
                    except KeyNotFound:
                        seen["get"] = "miss"
                    try:
                        with c.view(key):
                            seen["view"] = "hit"
                    except KeyNotFound:
                        seen["view"] = "miss"
                    out[key] = seen
                out["keys"] = sorted(f"{info['ns']}/{info['key']}" for info in c.keys()[1])
                out["session_tenants"] = sorted({s["tenant"] for s in c.stats()["sessions"]})
    except EcdError as exc:
        out.update(error=type(exc).__name__, message=str(exc))
    print(json.dumps(out), flush=True)


def scan_reachable(needle: bytes) -> dict:
    """Look for `needle` in every mapping of shared memory in /proc/self/maps (memfds, /dev/shm
    files; read through /proc/self/mem) and in every memfd among /proc/self/fd."""
    mapped = held = 0
    found = False
    ctypes.CDLL(None, use_errno=True).prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE (setuid cleared it): /proc/self/mem
    with open("/proc/self/maps") as maps, open("/proc/self/mem", "rb", buffering=0) as mem:
        for line in maps:
            fields = line.split(maxsplit=5)
            name = fields[5].strip() if len(fields) == 6 else ""
            if "r" not in fields[1] or not (name.startswith("/memfd:") or name.startswith("/dev/shm/")):
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            mem.seek(start)
            data = mem.read(end - start)
            mapped += len(data)
            found = found or data.find(needle) >= 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:"):
                continue
            data = os.pread(int(fd), os.fstat(int(fd)).st_size, 0)
        except OSError:
            continue
        held += len(data)
        found = found or data.find(needle) >= 0
    return {"mapped_bytes": mapped, "memfd_bytes": held, "found": found}


if __name__ == "__main__":
    main()
