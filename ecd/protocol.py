"""Every message on the control socket: tagged, array-like msgspec Structs in two unions.

A client's DEALER sends one msgpack frame per request; the daemon's ROUTER answers with one
frame per reply carrying the same `id`. Requests with `id == 0` are fire-and-forget (Release,
Bye): the daemon never answers them. Many-key requests carry lists, one result per item in order.
Only small metadata crosses the socket; tensor bytes move through the shared-memory pools
(PutInline, for payloads up to `Limits.inline_max_bytes`, is the one exception).
"""
from __future__ import annotations

import math
import os
from typing import Annotated, Union

import msgspec
from msgspec import Meta, Struct

from .cluster_config import DirectoryStats
from .events_config import EventsStats

PROTOCOL_VERSION = 1
# Element sizes of the dtypes ecd stores, by torch's name (the daemon checks nbytes, never imports torch).
DTYPE_ITEMSIZE: dict[str, int] = {"bool": 1, "uint8": 1, "int8": 1, "uint16": 2, "int16": 2, "uint32": 4, "int32": 4,
                                  "uint64": 8, "int64": 8, "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
                                  "complex64": 8, "complex128": 16, "float8_e4m3fn": 1, "float8_e5m2": 1,
                                  "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1}

U64 = Annotated[int, Meta(ge=0, le=2**63 - 1)]
# An xxh3-64 digest of an entry's bytes (ecd.client.tensors.checksum); 0 means "none stored".
Checksum = Annotated[int, Meta(ge=0)]  # msgpack ints stop at 2**64 - 1 anyway
Seconds = Annotated[float, Meta(ge=0.0)]


def pid_namespace() -> int:
    """Inode of this process's pid namespace (0 where /proc does not tell): Hello.pid_ns."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def expected_nbytes(dtype: str, shape: list[int] | tuple[int, ...]) -> int:
    return math.prod(shape) * DTYPE_ITEMSIZE[dtype]


class _Msg(Struct, array_like=True, tag=True, omit_defaults=False): ...


# ---- pieces ---------------------------------------------------------------------------------

class PoolInfo(Struct, array_like=True):
    index: int
    name: str  # /dev/shm/<name> (a memfd's label when Welcome.fd_socket is set)
    size: int


class ArenaInfo(Struct, array_like=True):
    """A daemon-owned CUDA arena: one device allocation exported once.

    `index` is its pool number (Extent.pool / Location.pool): host segments come first, arenas
    after them. Processes see different device ordinals under different CUDA_VISIBLE_DEVICES, so
    clients find the arena's device by `device_uuid` ("GPU-…", as nvidia-smi -L prints it).
    `export` says how a client opens it: "ipc", the 64-byte cudaIpcMemHandle_t in `handle`; "fd",
    a file descriptor from the fd socket (an FdItem of kind "arena" with this index and size)."""

    index: int
    device_uuid: str
    size: int
    handle: bytes  # the 64-byte cudaIpcMemHandle_t of the arena's base pointer (b"" with "fd")
    export: str = "ipc"


class RingInfo(Struct, array_like=True):  # the read path's shared memory (memory/entry_index.py)
    name: str
    size: int
    slots: int
    buckets: int
    index_records: int = 0
    read_slots: list[int] = []  # [pool, offset, slots]: this session's page of read slots (none: empty)
    submissions: list[int] = []  # [pool, page offset, records, area offset]: its submission page (ecd/writes)


class Limits(Struct, array_like=True):
    max_key_bytes: int
    max_batch: int
    max_message_bytes: int
    inline_max_bytes: int
    max_ndim: int
    max_wait_s: float
    max_pin_s: float
    write_ttl_s: float  # a reservation older than this may have been reclaimed: do not use it


# vLLM's ExternalBlockHash: the u64 it publishes by default, or the hash's bytes (msgpack bounds the int).
BlockHash = Union[int, Annotated[bytes, Meta(max_length=64)]]
MAX_LOCAL_READS = 1024  # Report.local_reads: generations read without a round trip (client/local_read.py)
MAX_BLOCK_TOKENS = 1 << 16  # token ids one KV block's metadata may carry


class KVBlockMeta(Struct, array_like=True, tag="kv"):
    """What an entry holding one engine KV block is, for routers ([events]): published as vLLM's
    BlockStored / BlockRemoved with these fields (kv_events.py). The daemon never interprets it."""

    block_hash: BlockHash
    parent_hash: BlockHash | None = None
    token_ids: Annotated[list[int], Meta(max_length=MAX_BLOCK_TOKENS)] = []
    block_size: Annotated[int, Meta(ge=0, le=MAX_BLOCK_TOKENS)] = 0
    lora_name: Annotated[str, Meta(max_length=256)] | None = None
    group_idx: Annotated[int, Meta(ge=0, le=1024)] | None = None  # the KV cache group (hybrid models)


class EncoderMeta(Struct, array_like=True, tag="ec"):
    """An entry holding an encoder's output for one multimodal input (the encoder cache): published
    on [events] encoder_topic, and by default registered in the [cluster] directory."""

    mm_hash: Annotated[str, Meta(max_length=1024)] = ""  # "": the entry's key
    num_tokens: Annotated[int, Meta(ge=0)] = 0  # embeddings it holds (0: not said)


# What a put may say about an entry besides its bytes (None: nothing).
EntryMeta = Union[KVBlockMeta, EncoderMeta]


class AllocItem(Struct, array_like=True):
    key: str
    dtype: str
    shape: list[U64]
    nbytes: U64
    meta: EntryMeta | None = None


class Extent(_Msg, tag="extent"):
    """Where to write an allocated entry; `generation` names it in Commit/Abort."""

    generation: int
    pool: int
    offset: int


class Location(_Msg, tag="location"):
    """A READY entry the caller now holds a read lease on (Release it by generation)."""

    generation: int
    pool: int
    offset: int
    nbytes: int
    dtype: str
    shape: list[int]
    checksum: int = 0  # what the producer stored (0: none): readers asked to verify compare it


class Failure(_Msg, tag="failure"):
    code: int
    message: str


class PeerState(Struct):
    """One peer of the peer plane ([cluster]), as `ecd status` shows it."""
    endpoint: str
    node: str  # "" until its handshake answered
    state: str  # "up" (answered its last ping), "down", "connecting"
    configured: bool  # in cluster.peers (else named by a fetch)
    fetched_entries: int = 0
    fetched_bytes: int = 0
    served_entries: int = 0  # to this peer (matched by node name)
    served_bytes: int = 0
    failures: int = 0  # fetches from it that failed


class SessionInfo(Struct):
    """One client session, as `ecd status` shows it: who connected (the kernel says) and how it is watched."""
    id: int
    name: str  # Hello.name: the client's own word, cut to 64 characters
    pid: int  # in the daemon's pid namespace (SO_PEERCRED); 0: not visible from it (another container), or tcp
    pid_ns: int  # inode of the client's pid namespace (as /proc/PID/ns/pid names it); 0: unknown
    pid_ns_claimed: bool  # pid_ns is Hello's claim: the kernel would not tell the daemon
    uid: int  # -1: a tcp client (no credentials)
    gid: int
    watch: str  # "pidfd": reclaimed the moment its process exits; "heartbeat": after leases.session_ttl of silence
    tenant: str = ""  # "": the default tenant


class DiskStats(Struct):
    """The disk tier, as `ecd status` shows it."""
    path: str
    direct_io: bool
    capacity_bytes: int
    used_bytes: int
    entries: int
    persisted_entries: int
    spills: int  # entries written on eviction
    promotions: int  # entries read back into the host pool
    writes_in_flight: int
    spill_buffer_bytes: int  # evicted bytes waiting in RAM for their write
    integrity_failures: int  # records found corrupt (never served, removed)
    errors: dict[str, int] = {}  # failed disk operations by kind (enospc, eio, readonly, missing, ...)
    dropped: dict[str, int] = {}  # evicted entries not spilled, by reason
    loaded: int = 0  # records re-indexed at start
    load_s: float = 0.0  # how long that took
    degraded: str = ""  # why the filesystem refuses writes (full, read-only: tiers/disk_health.py); "": it takes them
    degraded_s: float = 0.0  # for how long


class RestartStats(Struct):
    """How the daemon's start went ([restart], ecd/daemon/restart/): the pool it adopted, or why not."""
    keeper: str = "none"  # who holds the pool between runs: "systemd", "holder" or "none"
    adopted: bool = False  # the pool and its entries were adopted (False: a cold start)
    entries: int = 0  # entries adopted
    bytes: int = 0  # their bytes
    seconds: float = 0.0  # from taking the pool back to serving its entries
    quarantined: int = 0  # extents of unfinished writes kept out of use for a write TTL
    skipped_records: int = 0  # journal records that failed their checks or lost to a newer one
    refused: str = ""  # why a kept pool was not adopted ("": none was kept, or it was)
    journal_records: int = 0  # records in the journal now
    journal_full: int = 0  # entries not recorded for want of journal space (not adoptable)


class DaemonStats(Struct):
    node: str
    epoch: int
    version: str
    uptime_s: float
    capacity_bytes: int
    used_bytes: int
    pools: list[tuple[int, int]]  # (capacity, used) per pool segment
    entries_ready: int
    entries_writing: int  # puts between alloc and commit (reservations not included)
    reservations: int  # anonymous extents held for clients' next puts
    reserved_bytes: int
    entries_retired: int  # replaced or deleted, bytes held until their readers release
    clients: int
    read_leases: int
    pins: int
    waiters: int
    hits: int
    misses: int
    evictions: int
    reclaimed_sessions: int
    expired_writes: int
    ring_events: int
    ops: dict[str, int]
    errors: dict[str, int]
    integrity_failures: int = 0  # reads clients reported as not matching the stored checksum
    # The peer plane ([cluster]); empty and 0 without it.
    cluster_listen: str = ""
    peers: list[PeerState] = []
    transfer_leases: int = 0  # entries this node holds leased for peers' fetches
    fetches_in_flight: int = 0  # keys this node is pulling from peers now
    fetch_failures: dict[str, int] = {}  # by reason
    disk: "DiskStats | None" = None  # the disk tier ([pool.disk]); None without it
    sessions: list[SessionInfo] = []  # client sessions (not the daemon's internal ones), oldest first
    restart: RestartStats | None = None  # the start: adopted or cold ([restart])
    directory: DirectoryStats | None = None  # [cluster] directory; None without it
    leased_bytes: int = 0  # put leases' bytes not yet carved into entries (ecd/writes), in used_bytes
    events: EventsStats | None = None  # [events]: the KV events this node publishes (None: off)


# ---- requests -------------------------------------------------------------------------------

class Hello(_Msg, tag="hello"):
    id: int
    version: int
    pid: int
    name: str = ""
    # `pid` and the inode of the client's /proc/self/ns/pid (0: unknown) are claims, only logged: the daemon
    # takes a local client's pid from the kernel (SO_PEERCRED) and watches that process; a session it
    # cannot name must heartbeat (Welcome.heartbeat_s).
    pid_ns: int = 0


class Ping(_Msg, tag="ping"):
    id: int


class Alloc(_Msg, tag="alloc"):
    id: int
    ns: str
    items: list[AllocItem]
    # The pool (ArenaInfo.index) of the CUDA arena to place every item in; -1: the host pool.
    arena: int = -1


class Commit(_Msg, tag="commit"):
    id: int
    generations: list[int]
    # Also reserve an anonymous extent of this many bytes for this client's next put (copy first, Publish
    # after: one round trip, not Alloc + Commit), in the tier of the first item: its CUDA arena or the host pool.
    reserve: U64 = 0
    # Per generation, the checksum of the bytes written (0: none). Empty: none for any of them.
    checksums: list[Checksum] = []
    # Also write through to the disk tier ([pool.disk]), answering once durable (per item NOT_DURABLE if not).
    persist: bool = False


class Publish(_Msg, tag="publish"):
    """Commit this client's reservation under a key (its size must match the item's)."""

    id: int
    ns: str
    generation: int
    item: AllocItem
    reserve: U64 = 0
    checksum: Checksum = 0  # of the bytes written (0: none)
    persist: bool = False  # as in Commit


class Abort(_Msg, tag="abort"):
    id: int
    generations: list[int]


class LeaseSpace(_Msg, tag="lease_space"):
    """A put lease of `nbytes` or more in `ns` and `arena` (-1: the host pool), granted on the client's page."""

    id: int
    ns: str
    nbytes: U64 = 0
    arena: int = -1


class PutInline(_Msg, tag="put_inline"):
    id: int
    ns: str
    key: str
    dtype: str
    shape: list[U64]
    data: bytes
    checksum: Checksum = 0  # of `data` (0: none); the daemon checks it before storing
    persist: bool = False  # as in Commit
    meta: EntryMeta | None = None  # as AllocItem.meta


class Acquire(_Msg, tag="acquire"):
    id: int
    ns: str
    keys: list[str]
    wait_s: Seconds = 0.0


class Release(_Msg, tag="release"):
    id: int  # 0: no reply
    generations: list[int]


class Exists(_Msg, tag="exists"):
    id: int
    ns: str
    keys: list[str]
    pin_s: Seconds = 0.0


class Unpin(_Msg, tag="unpin"):
    id: int
    ns: str
    keys: list[str]


class Delete(_Msg, tag="delete"):
    id: int
    ns: str
    keys: list[str]


class Stats(_Msg, tag="stats"):
    id: int


class Keys(_Msg, tag="keys"):
    """List READY entries (for operators: `ecd keys`), ordered by namespace then key."""

    id: int
    ns: str = ""  # "" lists every namespace
    limit: Annotated[int, Meta(ge=1, le=1_000_000)] = 1000
    # Paging: list entries after this (namespace, key), i.e. the last one of the previous page.
    after: tuple[str, str] | None = None


class Evict(_Msg, tag="evict"):
    """Operator removal: the given keys, a whole namespace, or everything. Entries under a read
    lease or pin are refused unless `force`, which retires them (freed when readers let go)."""

    id: int
    ns: str
    keys: list[str]
    whole_namespace: bool = False
    everything: bool = False
    force: bool = False


class Held(_Msg, tag="held"):
    """Which of these generations still hold their extent (an evicted entry drains its readers)."""

    id: int
    generations: list[int]


class Report(_Msg, tag="report"):
    """A client's counters the daemon cannot see itself (fire-and-forget, id 0)."""

    id: int
    ring_overruns: Annotated[int, Meta(ge=0, le=2**31)] = 0
    integrity_failures: Annotated[int, Meta(ge=0, le=2**31)] = 0  # reads that failed verification
    local_reads: Annotated[list[U64], Meta(max_length=MAX_LOCAL_READS)] = msgspec.field(default_factory=list)


class Fetch(_Msg, tag="fetch"):
    """Make these keys local: pull the absent ones from a peer daemon ([cluster]). `peer`: a
    peer's endpoint (tcp://HOST:PORT) or node name; "" asks the configured peers, first holder
    wins. Answered with `flags`: per key, whether it is local now (already local counts). The
    daemon answers within timeout_s (0: cluster.fetch_timeout), with `reasons`: why each key that
    is not local is not."""

    id: int
    ns: str
    keys: list[str]
    peer: str = ""
    timeout_s: Seconds = 0.0


class Bye(_Msg, tag="bye"):
    id: int  # never answered; the daemon reclaims the session at once


Request = Union[Hello, Ping, Alloc, Commit, Publish, Abort, PutInline, Acquire, Release, Exists, Unpin,
                Delete, Stats, Keys, Evict, Held, Report, Bye, Fetch, LeaseSpace]


# ---- replies --------------------------------------------------------------------------------

class Welcome(_Msg, tag="welcome"):
    id: int
    version: int
    session: int
    epoch: int
    node: str
    pools: list[PoolInfo]
    ring: RingInfo
    limits: Limits
    # > 0: the daemon cannot watch this client's process: send a request (a `ping`, id 0) after this many
    # idle seconds, or the session is reclaimed after leases.session_ttl.
    heartbeat_s: float = 0.0
    # Namespaces configured `verify = true`: producers must send checksums, consumers verify.
    verify_namespaces: list[str] = []
    # `[pool.cuda]`: one arena per configured device (empty without it).
    arenas: list[ArenaInfo] = []
    # The peer plane ([cluster]): this node's peer endpoint as bound (tcp://HOST:PORT; "": none), for engines
    cluster_listen: str = ""
    disk: bool = False  # `[pool.disk]` is configured: puts may ask for persist (else refused)
    # `[pool.host] backing = "memfd"`: the pools and the ring are descriptors (names only label them) handed
    # out on this fd socket (ecd/fd_passing.py): its basename, in the control socket's directory as the
    # client knows it; an absolute path for a tcp control endpoint. "": named files in /dev/shm.
    fd_socket: str = ""
    tenant: str = ""  # this client's tenant ("": the default): its namespaces are the tenant's (docs/SECURITY.md)


class Pong(_Msg, tag="pong"):
    id: int
    epoch: int


class Allocated(_Msg, tag="allocated"):
    id: int
    results: list[Union[Extent, Failure]]


class Acquired(_Msg, tag="acquired"):
    id: int
    results: list[Union[Location, Failure]]


class Acked(_Msg, tag="acked"):
    """Per-item outcome of Commit/Abort/Release/PutInline: None is success."""

    id: int
    results: list[Union[Failure, None]]


class Committed(_Msg, tag="committed"):
    """Reply to Commit/Publish: per-item outcome, then the reservation asked for (if any)."""

    id: int
    results: list[Union[Failure, None]]
    reservation: Union[Extent, Failure, None] = None


class Flags(_Msg, tag="flags"):
    """Per-key booleans: Exists (present), Delete (was present), Unpin (was pinned), Fetch (local
    now)."""

    id: int
    values: list[bool]
    # Fetch only: per key "" where the value is true, else why not: "not_found" (no peer asked holds it), or
    # the ecd_transfer_failures_total label ("timeout", "refused", "checksum", ...). Empty from older daemons.
    reasons: list[str] = []


class StatsReply(_Msg, tag="stats_reply"):
    id: int
    stats: DaemonStats


class KeyInfo(Struct, array_like=True):
    ns: str
    key: str
    generation: int
    nbytes: int
    dtype: str
    shape: list[int]
    age_s: float  # since it was published
    idle_s: float  # since it was last read or looked up
    readers: int
    pins: int
    # "memory": in a pool only; "disk": a disk-tier record only (a read brings it back; generation 0, readers
    # and pins 0, ages since it was written); "memory+disk": both, the same bytes
    tier: str = "memory"


class KeyList(_Msg, tag="key_list"):
    id: int
    total: int  # entries that matched (after `after` or not)
    entries: list[KeyInfo]  # the first `limit` after `after`, fewer when the reply's size bound cut it
    more: bool = False  # entries follow the last one: ask again with `after` = its (ns, key)


class Evicted(_Msg, tag="evicted"):
    id: int
    evicted: int
    refused: list[str]  # under a lease or pin (without force); at most the first 1000
    missing: list[str]  # named keys that were not there; at most the first 1000
    draining: list[int]  # generations evicted under force whose readers still hold them


class Error(_Msg, tag="error"):
    id: int
    code: int
    message: str


Reply = Union[Welcome, Pong, Allocated, Acquired, Acked, Committed, Flags, StatsReply, KeyList, Evicted,
              Error]

encoder = msgspec.msgpack.Encoder()


def request_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(Request)


def reply_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(Reply)
