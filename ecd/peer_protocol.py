"""Messages of the peer plane: daemon to daemon, on `[cluster] listen` (docs/protocol.md, "Peers").

The puller's daemon holds one DEALER per peer; the owner's daemon one ROUTER. Like the client
protocol, every message is one msgpack frame holding a tagged, array-like msgspec Struct with an
`id` the reply repeats. Bulk bytes never travel here: a `leased` reply hands out one-time tokens
that admit a data connection to the owner's transport (ecd/transport/).

Fields added later go at the end with a default: an array-like Struct decodes a shorter array
(the default fills in) and ignores extra trailing elements, so daemons of either age still talk
(the nixl fields: PeerWelcome.agent, Offer.addr; PeerDone is new, sent only over nixl; Offer.meta).
"""
from __future__ import annotations

from typing import Annotated, Union

import msgspec
from msgspec import Meta, Struct

from .protocol import Checksum, EntryMeta, Seconds

PEER_PROTOCOL_VERSION = 1
TOKEN_BYTES = 32  # secrets.token_bytes: a data connection must present one


class _PeerMsg(Struct, array_like=True, tag=True, omit_defaults=False):
    pass


class PeerHello(_PeerMsg, tag="peer_hello"):
    id: int
    version: int
    node: str  # the puller's node.name (for the owner's logs and its per-peer metrics)
    epoch: int


class PeerPing(_PeerMsg, tag="peer_ping"):
    """Keeps the puller's peer session (and so its leases) alive; answered with peer_pong."""
    id: int


class Lookup(_PeerMsg, tag="lookup"):
    """Which of these keys does the owner hold? Those it holds are leased for a transfer: held
    (never evicted, a replacement retires them) until sent, released, or `ttl_s` passes."""
    id: int
    ns: str
    keys: list[str]
    ttl_s: Annotated[float, Meta(gt=0.0)] = 30.0


class PeerRelease(_PeerMsg, tag="peer_release"):
    """Give back leases (by token) the puller will not use; unknown tokens are ignored."""
    id: int
    tokens: list[bytes]


class PeerDone(_PeerMsg, tag="peer_done"):
    """transport "nixl": the puller READ these leased entries whole (the owner's CPU saw nothing
    of it); the owner gives their leases back and counts them served. Unknown tokens are
    ignored. Answered with peer_acked."""
    id: int
    tokens: list[bytes]


PeerRequest = Union[PeerHello, PeerPing, Lookup, PeerRelease, PeerDone]


class Offer(Struct, array_like=True):
    """One leased entry: what to allocate for it, and the token its bytes are fetched with."""
    key: str
    nbytes: int
    dtype: str
    shape: list[int]
    checksum: Checksum  # xxh3-64 the producer stored (0: none)
    token: bytes
    addr: int = 0  # transport "nixl": the entry's address in the owner's registered pool
    meta: EntryMeta | None = None  # what the entry's put said of it: the puller's copy keeps it


class PeerWelcome(_PeerMsg, tag="peer_welcome"):
    id: int
    version: int
    node: str
    epoch: int
    transport: str  # "tcp" or "nixl"
    # Where the owner's transport listens: host ("": the host of the control endpoint dialled)
    # and port. nixl has no listener of its own (UCX opens one): the port is then the owner's
    # control port, which names the owner on its host.
    data_host: str
    data_port: int
    agent: bytes = b""  # transport "nixl": the owner's NIXL agent metadata (add_remote_agent)


class PeerPong(_PeerMsg, tag="peer_pong"):
    id: int
    epoch: int


class Leased(_PeerMsg, tag="leased"):
    id: int
    offers: list[Union[Offer, None]]  # per key: None where the owner does not hold it
    ttl_s: Seconds = 0.0  # how long the leases stand (the owner may shorten what was asked)


class PeerAcked(_PeerMsg, tag="peer_acked"):
    id: int


class PeerError(_PeerMsg, tag="peer_error"):
    id: int
    code: int  # ecd.errors.Code
    message: str


PeerReply = Union[PeerWelcome, PeerPong, Leased, PeerAcked, PeerError]

encoder = msgspec.msgpack.Encoder()


def peer_request_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(PeerRequest)


def peer_reply_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(PeerReply)
