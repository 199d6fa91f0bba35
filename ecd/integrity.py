"""The checksum ecd stores with an entry: xxh3-64 of its bytes, in row-major order.

Torch-free, so the daemon (which never imports torch) checks inline puts with the same function
clients use. 0 means "no checksum" on the wire, so the one digest that is 0 is sent as 1.
"""
from __future__ import annotations

import xxhash

EMPTY_CHECKSUM = xxhash.xxh3_64_intdigest(b"") or 1


def finish(digest: int) -> int:
    return digest or 1


def checksum(buf, offset: int = 0, nbytes: int | None = None) -> int:
    """xxh3-64 of buf[offset:offset + nbytes] (never 0), read in place (any buffer: bytes, mmap,
    numpy array). The memoryviews are released before returning, so an mmap can still close."""
    with memoryview(buf) as mv:
        end = mv.nbytes if nbytes is None else offset + nbytes
        with mv.cast("B")[offset:end] as part:
            return finish(xxhash.xxh3_64_intdigest(part))


def describe(value: int) -> str:
    return f"{value:#018x}"
