"""Corrupt entries in place, in the daemon's pool, for the engine tests' failure paths
(corrupting_kv_connector.py, faulty_ec.py's "corrupt" mode): a bit-flip in shared memory, as bad
RAM or a stray write would make one. The entry stays indexed, with its producer's checksum; only a
verifying reader can tell."""
from __future__ import annotations

from ecd import Client
from ecd.protocol import Acquire, Location, Release


def corrupt_entries(client: Client, keys: list[str]) -> int:
    """Flip the first byte of each of `keys` in `client`'s namespace (through the client's
    read-write mapping of the pool); returns how many were there, stored with a checksum, and
    flipped."""
    if not keys:
        return 0
    results = client.request(Acquire(0, client.namespace, list(keys), 0.0)).results
    found = [r for r in results if isinstance(r, Location)]
    if found:
        client.request(Release(0, [r.generation for r in found]))
    flipped = 0
    for loc in found:
        if not loc.checksum:  # no checksum: a corruption nobody could catch; leave it alone
            continue
        buf = client.mapping.rw_for(loc.pool, loc.offset, loc.nbytes)
        buf[loc.offset] ^= 0xFF
        flipped += 1
    return flipped
