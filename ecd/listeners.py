"""Bound TCP listening sockets, for the servers the daemon runs beside its ZeroMQ sockets (the
metrics HTTP server, the peer plane's data port). Bound at start-up, so a port in use is a
start-up error reported before READY, not a failure later. And who may open the daemon's unix
sockets (control, fd socket, events): node.group, and for the control and fd sockets also the
uids and gids `[control] allowed_uids` / `allowed_gids` name, by POSIX ACL entries on the socket
files and a search entry on the runtime directory, so an engine pod of an allowed uid connects
without joining the group (a pod's `supplementalGroups`) and without a world-writable socket."""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import struct
from typing import Iterable, Iterator

log = logging.getLogger("ecd.daemon")

# The kernel's ACL xattr (include/uapi/linux/posix_acl_xattr.h): a version word, then entries of
# (tag, permissions, id), sorted by tag then id; a named entry needs a MASK entry beside it.
ACL_XATTR = "system.posix_acl_access"
ACL_VERSION = 2
USER_OBJ, USER, GROUP_OBJ, GROUP, MASK, OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
NO_ID = 0xFFFFFFFF
_HEADER, _ENTRY = struct.Struct("<I"), struct.Struct("<HHI")


def read_acl(path: str) -> dict[tuple[int, int], int]:
    """`path`'s access ACL as {(tag, id): permissions}; from its mode bits when it has none."""
    try:
        data = os.getxattr(path, ACL_XATTR)
    except OSError as exc:
        if exc.errno not in (errno.ENODATA, errno.EOPNOTSUPP):
            raise
        mode = os.stat(path).st_mode
        return {(USER_OBJ, NO_ID): (mode >> 6) & 7, (GROUP_OBJ, NO_ID): (mode >> 3) & 7, (OTHER, NO_ID): mode & 7}
    (version,) = _HEADER.unpack_from(data)
    if version != ACL_VERSION or (len(data) - _HEADER.size) % _ENTRY.size:
        raise OSError(errno.EINVAL, f"unreadable access ACL (version {version}, {len(data)} bytes)", path)
    return {(tag, ident): perm for tag, perm, ident in _ENTRY.iter_unpack(data[_HEADER.size:])}


def write_acl(path: str, acl: dict[tuple[int, int], int]) -> None:
    """Store `acl` on `path` (its MASK recomputed: the union of the group class, so the named
    entries get what they name). Without named entries the ACL is the mode bits again."""
    acl = {k: v for k, v in acl.items() if k[0] != MASK}
    named = [perm for (tag, _), perm in acl.items() if tag in (USER, GROUP)]
    if named:
        mask = acl[(GROUP_OBJ, NO_ID)]
        for perm in named:
            mask |= perm
        acl[(MASK, NO_ID)] = mask
    data = _HEADER.pack(ACL_VERSION) + b"".join(_ENTRY.pack(tag, perm, ident)
                                                 for (tag, ident), perm in sorted(acl.items()))
    os.setxattr(path, ACL_XATTR, data)


def grant(path: str, uids: Iterable[int], gids: Iterable[int], perm: int, exact: bool) -> None:
    """Named ACL entries with `perm` for `uids` and `gids` on `path`. `exact`: the named entries
    become just these (a file of the daemon's own); else they are added to what is there (a
    directory an administrator may have given entries of their own)."""
    acl = read_acl(path)
    if exact:
        acl = {k: v for k, v in acl.items() if k[0] not in (USER, GROUP)}
    for uid in uids:
        acl[(USER, uid)] = acl.get((USER, uid), 0) | perm
    for gid in gids:
        acl[(GROUP, gid)] = acl.get((GROUP, gid), 0) | perm
    write_acl(path, acl)


class SocketFiles:
    """Who may open the daemon's unix sockets: node.group (`gid`) by the file mode, and the
    allowed uids/gids (`allow`, again at each SIGHUP) by ACL entries on the sockets that serve
    clients and a search entry on their directory. An ACL the filesystem refuses is logged: those
    uids then need the group."""

    def __init__(self, gid: int, uids: Iterable[int] = (), gids: Iterable[int] = ()) -> None:
        self.gid = gid
        self.uids, self.gids = sorted(set(uids)), sorted(set(gids))
        self._paths: list[str] = []  # the client sockets, given the allowed ids
        self._directories: list[str] = []

    def allow(self, uids: Iterable[int], gids: Iterable[int]) -> None:
        """New allowed ids: the sockets' entries become these; the directories gain theirs."""
        self.uids, self.gids = sorted(set(uids)), sorted(set(gids))
        for path in self._paths:
            self._grant(path, 0o6, exact=True)
        for path in self._directories:
            self._grant(path, 0o1, exact=False)

    @contextlib.contextmanager
    def bind(self, path: str | None) -> Iterator[None]:
        """Bind a client socket at `path` inside: group_socket_file, then the allowed ids' ACL
        entries on it and a search entry on its directory (none to give: a new file has no named
        entries to clear; `allow` gives them if a SIGHUP brings some)."""
        with group_socket_file(path, self.gid):
            yield
        if path is None:
            return
        self._paths.append(path)
        directory = os.path.dirname(os.path.abspath(path))
        new_directory = directory not in self._directories
        if new_directory:
            self._directories.append(directory)
        if self.uids or self.gids:
            self._grant(path, 0o6, exact=True)
            if new_directory:
                self._grant(directory, 0o1, exact=False)

    def _grant(self, path: str, perm: int, exact: bool) -> None:
        if not (self.uids or self.gids or exact):
            return  # (exact with none: the named entries a SIGHUP took away are cleared)
        try:
            grant(path, self.uids, self.gids, perm, exact)
        except FileNotFoundError:
            pass  # a socket closed since
        except OSError as exc:
            if self.uids or self.gids:
                log.warning("%s: cannot give [control] allowed_uids/allowed_gids access by ACL (%s): those "
                            "clients must be in node.group to reach the socket", path, exc.strerror or exc)


@contextlib.contextmanager
def group_socket_file(path: str | None, gid: int) -> Iterator[None]:
    """Bind a unix socket at `path` inside: its file is the owner's and group's only from birth
    (umask 007, so there is no moment where others may connect), then mode 0660 and group `gid`
    (node.group: the engines join it). `path` None (a tcp endpoint): the umask alone."""
    old_umask = os.umask(0o007)
    try:
        yield
        if path is not None:
            os.chown(path, -1, gid)
            os.chmod(path, 0o660)
    finally:
        os.umask(old_umask)


def bind_tcp_listener(host: str, port: int, backlog: int) -> socket.socket:
    """A listening socket on (host, port), IPv6 when the host is an IPv6 address; closed again
    if binding fails (the OSError propagates)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock
