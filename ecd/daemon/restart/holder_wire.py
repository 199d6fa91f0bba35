"""The holder's wire: what a daemon and `ecd hold` (restart/holder.py) say on the holder socket.

`<runtime_dir>/ecd.<node>.keeper/holder`, a SOCK_SEQPACKET unix socket (mode 0600) in a directory
of the holder's user, mode 0700 (only that user can create or replace names in it: issue 40). Each message is one
msgspec msgpack map (unknown fields are ignored, so a newer peer may add some) with at most
FDS_PER_MESSAGE descriptors attached (SCM_RIGHTS), as on the fd socket (ecd/fd_passing.py).

    take     -> batches of `names` with the descriptors attached, the last with `last` set
    keep     <- batches of `names` + descriptors (+ `unlink` paths), `last` on the last one;
             -> one reply once the last arrived: the new set replaced the old one, or an error
    release  -> one reply once every descriptor is closed and the paths unlinked; the holder exits
    status   -> one reply: the holder's pid, what it holds, the lease's pid

A connection that asked `take` or `keep` holds the lease: while it stays open the holder never
lets go, and no other connection may take or keep. A refusal is a reply with `error` set.
"""
from __future__ import annotations

import array
import os
import socket
import stat
import struct
from typing import Sequence

import msgspec

from ...fd_passing import FDS_PER_MESSAGE, MAX_HEADER_BYTES

HOLDER_WIRE_VERSION = 1
HOLDER_DIR_FORMAT = "ecd.{node}.keeper"
HOLDER_SOCKET = "holder"
OPS = ("take", "keep", "release", "status")
MAX_NAME_CHARS = 255  # systemd's limit for FDNAME, kept the same so the two keepers name alike
MAX_PATH_CHARS = 4095
SCM_MAX_FD = 253  # the kernel's most descriptors in one message


class HolderRequest(msgspec.Struct, kw_only=True):
    version: int
    op: str
    names: list[str] = msgspec.field(default_factory=list)  # keep: one per attached descriptor
    unlink: list[str] = msgspec.field(default_factory=list)  # keep: /dev/shm paths to remove at the end
    last: bool = True  # keep: False while more batches follow


class HolderReply(msgspec.Struct, kw_only=True):
    version: int
    op: str
    error: str = ""  # a refusal: why (and no descriptors)
    names: list[str] = msgspec.field(default_factory=list)  # take: one per attached descriptor
    last: bool = True  # take: False while more batches follow
    node: str = ""
    pid: int = 0  # the holder's
    held: int = 0  # descriptors it holds now
    bytes: int = 0  # their files' sizes, summed
    lease_pid: int = 0  # the daemon that holds the lease (0: none, or not in the holder's pid namespace)
    busy: bool = False  # refused because another connection holds the lease: ask again once it closed


class WireError(Exception):
    """A message that could not be sent or received whole; the text says why."""


def peer_ids(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the other end as the kernel recorded them (SO_PEERCRED): the client's at
    connect(), the listener's at listen(). Both ends of the holder's socket check the other's uid."""
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return pid, uid, gid


def socket_path(runtime_dir: str, node: str) -> str:
    return os.path.join(runtime_dir, HOLDER_DIR_FORMAT.format(node=node), HOLDER_SOCKET)


def private_dir_problem(path: str) -> str:
    """Why `path` is not a directory that only this process's user can create names in ("" when
    it is one; "missing" when there is none). The runtime directory is the engines' group's: a
    member could otherwise bind a socket of its own under the holder's name."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "missing"
    except OSError as exc:
        return f"cannot inspect {path}: {exc.strerror}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory (a link or a file in its place)"
    if st.st_uid != os.geteuid():
        return f"{path} belongs to uid {st.st_uid}, not to this process's uid {os.geteuid()}"
    if st.st_mode & 0o077:
        return f"{path} has mode {stat.S_IMODE(st.st_mode):04o}: others than its owner may create names in it"
    return ""


def make_private_dir(path: str) -> str:
    """Make `path` mode 0700 (it may exist already): "" when it is then private, else why not."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        return f"cannot create {path}: {exc.strerror}"
    return private_dir_problem(path)


def name_problem(name: object) -> str:
    """Why `name` cannot name a descriptor ("" when it can): printable ASCII without ':' and at
    most 255 characters, as systemd's FDNAME= (LISTEN_FDNAMES joins them with ':')."""
    if not isinstance(name, str) or not name:
        return f"a descriptor's name must be a non-empty string, got {name!r}"
    if len(name) > MAX_NAME_CHARS:
        return f"a descriptor's name has {len(name)} characters, at most {MAX_NAME_CHARS} are allowed"
    if not all(" " < ch < "\x7f" for ch in name) or ":" in name:
        return f"a descriptor's name must be printable ASCII without spaces or ':', got {name!r}"
    return ""


def path_problem(path: object) -> str:
    if not isinstance(path, str) or not path.startswith("/") or "\0" in path or len(path) > MAX_PATH_CHARS:
        return f"an unlink path must be an absolute path, got {path!r:.300}"
    return ""


encoder = msgspec.msgpack.Encoder()
request_decoder = msgspec.msgpack.Decoder(HolderRequest)
reply_decoder = msgspec.msgpack.Decoder(HolderReply)


def send(sock: socket.socket, message: HolderRequest | HolderReply, fds: Sequence[int] = ()) -> None:
    """One message with `fds` attached (the kernel duplicates them into the receiver)."""
    data = encoder.encode(message)
    if len(data) > MAX_HEADER_BYTES:
        raise WireError(f"a holder message of {len(data)} bytes exceeds {MAX_HEADER_BYTES}")
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
    try:
        sock.sendmsg([data], ancillary)
    except (OSError, TimeoutError) as exc:
        raise WireError(f"cannot send to the holder socket: {getattr(exc, 'strerror', None) or exc or 'timed out'}") \
            from None


def receive(sock: socket.socket, flags: int = 0) -> tuple[bytes, list[int]]:
    """One message and the descriptors attached to it (CLOEXEC; the caller closes them). b"" when
    the peer closed. A truncated message is WireError, its descriptors closed."""
    fds = array.array("i")
    data, ancillary, msg_flags, _ = sock.recvmsg(MAX_HEADER_BYTES, socket.CMSG_SPACE(SCM_MAX_FD * fds.itemsize),
                                                 socket.MSG_CMSG_CLOEXEC | flags)
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    received = list(fds)
    if msg_flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
        close_all(received)
        raise WireError(f"a message arrived truncated (at most {MAX_HEADER_BYTES} bytes and "
                        f"{FDS_PER_MESSAGE} descriptors per message)")
    return data, received


def close_all(fds: Sequence[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def batches(names: Sequence[str], per_message: int = FDS_PER_MESSAGE) -> list[range]:
    """Index ranges of at most `per_message` descriptors each; one empty range for none."""
    return [range(i, min(i + per_message, len(names))) for i in range(0, len(names), per_message)] or [range(0)]
