"""The submission area: where a put is handed to the daemon without a message (issue 43).

A region of shared memory after the host pool's first segment (before the read slots), laid out
once at start and read by both sides:

    area header (4096 bytes)   u32 sleeping at 64 (the daemon's, 1 while asleep: a client then
                               rings the doorbell, the eventfd the fd socket hands out), u64
                               epoch at 128 (the daemon run's)
    page 0 .. pages-1          one per session that got one (Welcome's RingInfo.submissions)

A page (PAGE_HEADER bytes, then `records` RECORD-byte records):

    0    u64 consumed      daemon: the last record sequence number it has read
    8    u64 committed     daemon: the last sequence number settled (stored or refused); a futex
                           word (its low half) the client waits on, woken when `waiting` is set
    16   u64 grants        daemon: how many put leases it has granted (GRANTS slots at 128)
    24   u64 revoked       daemon: leases of a generation below it are being taken back (unused
                           for the write TTL; freed LEASE_GRACE of the TTL later): placed in no more
    64   u32 waiting       client: 1 while it waits on `committed`
    128  GRANTS x (generation, pool, offset, size) u64: lease grant i is in slot i % GRANTS
    256  u64 errors        daemon: how many records it refused (ERRORS slots at 264)
    264  ERRORS x ERROR:   (seq u64, code u32, length u32, message bytes)
    1024 records           record seq lies in slot (seq - 1) % records

A record: RECORD_FORMAT, the sequence number (from 1) stored last, after a barrier where the CPU
needs one: a reader that sees the number sees the rest. The daemon reads every record as
untrusted input (daemon/writes/consumer.py). A record asks the daemon to commit `nbytes` bytes at
`offset` of the lease `lease` (offsets only grow within a lease) as the entry `key` of the
lease's namespace; FLAG_ABORT says the put failed after its place was taken (nothing to store).
A record with a meta length has the entry's EntryMeta (msgpack) in the lease right after its
bytes' aligned end; the daemon decodes it and gives those bytes back.
"""
from __future__ import annotations

import struct

from ..memory.allocator import align_up
from ..protocol import DTYPE_ITEMSIZE

AREA_HEADER = 4096
SLEEPING_AT = 64
EPOCH_AT = 128  # u64: the daemon run's epoch (a client of another run posts nothing)
PAGE_HEADER = 1024
CONSUMED_AT, COMMITTED_AT, GRANTS_COUNT_AT, REVOKED_AT, WAITING_AT = 0, 8, 16, 24, 64
# A lease unused for the write TTL is marked revoked on its page and freed LEASE_GRACE x the TTL
# later; a client copies into a lease at most COPY_WINDOW x the TTL after it saw it unrevoked.
LEASE_GRACE, COPY_WINDOW = 0.5, 0.25
GRANTS, GRANTS_AT, GRANT = 4, 128, struct.Struct("<4Q")
ERRORS_COUNT_AT, ERRORS_AT, ERRORS = 256, 264, 7
ERROR = struct.Struct("<QII80s")  # seq, code, length of the message, the message (utf-8, cut)

# seq, lease, offset, nbytes, checksum, flags, dtype, ndim, key length, meta length, shape[8], key
RECORD = 256
MAX_NDIM = 8
MAX_KEY = 136
MAX_META = 1 << 20  # the entry's EntryMeta, msgpack, in the lease right after its bytes
RECORD_FORMAT = struct.Struct(f"<QQQQQHBBH2xI4x{MAX_NDIM}Q{MAX_KEY}s")
assert RECORD_FORMAT.size == RECORD
RECORD_BODY = struct.Struct(f"<QQQQHBBH2xI4x{MAX_NDIM}Q{MAX_KEY}s")  # all but seq, at offset 8
SEQ = struct.Struct("<Q")

FLAG_CHECKSUM = 1  # `checksum` is the bytes' xxh3-64 digest
FLAG_ABORT = 2  # the put failed: its place is given back, nothing is stored
FLAGS_KNOWN = FLAG_CHECKSUM | FLAG_ABORT

# dtype codes: the index of its name (the order is the wire's: append only)
DTYPES: tuple[str, ...] = tuple(DTYPE_ITEMSIZE)
DTYPE_CODES = {name: code for code, name in enumerate(DTYPES)}


def page_bytes(records: int) -> int:
    """Bytes of one session's page, a whole number of 4 KiB pages."""
    return align_up_page(PAGE_HEADER + records * RECORD)


def align_up_page(nbytes: int) -> int:
    return -(-nbytes // 4096) * 4096


def area_bytes(pages: int, records: int) -> int:
    """Bytes of the submission area (0: off)."""
    return AREA_HEADER + pages * page_bytes(records) if pages and records else 0


def page_offset(area_offset: int, page: int, records: int) -> int:
    return area_offset + AREA_HEADER + page * page_bytes(records)


def record_offset(page_at: int, records: int, seq: int) -> int:
    """Where record `seq` (from 1) of the page at `page_at` lies."""
    return page_at + PAGE_HEADER + ((seq - 1) % records) * RECORD


def slab_bytes(configured: int, pool_bytes: int) -> int:
    """A put lease's size: the configured slab, at most 1/128 of its tier (the host pool, or a
    CUDA arena: every producing session holds up to two per tier, the one it fills and the
    next), at least 64 KiB."""
    return align_up(max(64 << 10, min(configured, pool_bytes // 128)))
