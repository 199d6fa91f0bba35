"""A client process as a container would run it, for test_memfd_pool.py: started by the test under
`unshare --ipc --mount --pid --fork` with a private tmpfs on /dev/shm, it drops to another uid
and uses the daemon through nothing but the socket directory.

    memfd_ns_client.py --uid UID roundtrip ENDPOINT HOST_KEY NBYTES
        connect; get HOST_KEY (a uint8 pattern the test put from the host: byte i = i % 251) and
        compare it byte for byte; view it and say whether the view's memory is the daemon's memfd
        mapped read-only (zero copy); put "from-ns" (byte i = (i * 7) % 253) for the test to read
    memfd_ns_client.py --uid UID attack FD_SOCKET
        fetch the pool's descriptors like a client and try to change their size, and to get the
        ring writable (re-opened through /proc/self/fd, mapped PROT_WRITE, written)

--uid: started as root, it drops to that uid (and its group, no supplementary groups) once its
modules are imported (this Python's files may sit where that user cannot read), as
tests/cluster/peer_intruder.py does. Prints one JSON line.
"""
from __future__ import annotations

import encodings.idna  # noqa: F401 - looked up lazily; after the drop it may not be readable
import errno
import json
import mmap
import os
import sys
from pathlib import Path

import torch

import ecd.client.mapping  # noqa: F401 - everything a Client loads, before the drop
from ecd import Client
from ecd.fd_passing import receive

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: privileges.py
from privileges import drop_if_asked  # noqa: E402


def pattern(nbytes: int, mul: int, mod: int) -> torch.Tensor:
    return ((torch.arange(nbytes, dtype=torch.int64) * mul) % mod).to(torch.uint8)


def mapping_of(address: int) -> str:
    """The /proc/self/maps line (less its addresses) of the mapping that holds `address`."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, rest = line.split(" ", 1)
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= address < hi:
                return rest.strip()
    return ""


def roundtrip(endpoint: str, host_key: str, nbytes: str) -> dict:
    n = int(nbytes)
    out: dict = {"shm": sorted(os.listdir("/dev/shm")), "pid": os.getpid()}
    try:
        _roundtrip(endpoint, host_key, n, out)
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


def _roundtrip(endpoint: str, host_key: str, n: int, out: dict) -> None:
    with Client(endpoint, timeout=10.0) as c:
        out["local"] = c.mapping.local
        got = c.get(host_key)
        out["get_exact"] = bool(torch.equal(got, pattern(n, 1, 251)))
        with c.view(host_key) as view:
            out["view_exact"] = bool(torch.equal(view, pattern(n, 1, 251)))
            out["view_mapping"] = mapping_of(view.data_ptr())
        c.put("from-ns", pattern(n, 7, 253))


def attack(fd_socket: str) -> dict:
    header, items = receive(fd_socket, 5.0)
    out: dict = {"epoch": header.epoch, "kinds": sorted({item.kind for item, _ in items})}
    for item, fd in items:
        if item.kind == "pool" and item.index == 0:
            for name, size in (("shrink", 0), ("grow", item.size * 2)):
                try:
                    os.ftruncate(fd, size)
                    out[name] = "done"
                except OSError as exc:
                    out[name] = errno.errorcode[exc.errno]
            out["pool_size_after"] = os.fstat(fd).st_size
        if item.kind == "ring":
            try:
                mmap.mmap(fd, item.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                out["ring_map_rw"] = "done"
            except OSError as exc:
                out["ring_map_rw"] = errno.errorcode[exc.errno]
            try:  # a memfd's inode is 0777: re-opening it read-write through /proc works...
                rw = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
            except OSError as exc:
                out["ring_reopen_rw"] = errno.errorcode[exc.errno]
            else:  # ...but F_SEAL_FUTURE_WRITE refuses every write through it
                out["ring_reopen_rw"] = "done"
                for name, act in (("ring_reopened_map_rw", lambda: mmap.mmap(rw, item.size, mmap.MAP_SHARED,
                                                                             mmap.PROT_READ | mmap.PROT_WRITE)),
                                  ("ring_reopened_write", lambda: os.pwrite(rw, b"\0" * 8, 0))):
                    try:
                        act()
                        out[name] = "done"
                    except OSError as exc:
                        out[name] = errno.errorcode[exc.errno]
                os.close(rw)
        os.close(fd)
    return out


def main() -> None:
    mode, *args = drop_if_asked(sys.argv[1:])
    try:
        result = roundtrip(*args) if mode == "roundtrip" else attack(*args)
    except Exception as exc:  # the verdict says what failed, with the reason
        result = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps({"uid": os.getuid(), **result}), flush=True)


if __name__ == "__main__":
    main()
