"""`SystemdKeeper`: systemd's file descriptor store keeps the pool between two runs of the unit.

Spoken directly, as sd_notify(3) and sd_listen_fds(3) document it (no libsystemd):
- keep: one datagram per descriptor to $NOTIFY_SOCKET, "FDSTORE=1\\nFDNAME=ecd-<name>\\nFDPOLL=0"
  with the descriptor attached (SCM_RIGHTS); a name no longer kept gets "FDSTOREREMOVE=1\\n
  FDNAME=ecd-<name>". A name already stored with the same file (device and inode) is not sent
  again: systemd would store it a second time under the same name.
- take: at the next start systemd passes the stored descriptors from fd 3 on, with $LISTEN_FDS
  (how many), $LISTEN_FDNAMES (their names, ':'-separated) and $LISTEN_PID (ours, else they are
  not for us). The "ecd-" ones are ours: marked close-on-exec and returned; the variables are unset.
- release: FDSTOREREMOVE=1 for every name, for a final stop. close: nothing. systemd keeps the
  store across `systemctl restart` and automatic restarts and flushes it at `systemctl stop`
  (FileDescriptorStorePreserve=restart, the default; "yes" keeps it even across a stop, and then
  only release() or `systemctl clean --what=fdstore` returns the memory).

The unit needs FileDescriptorStoreMax= of at least the pool's segment count plus three (the journal,
its key, the ring):
systemd closes what does not fit, saying so only in its own log. systemd 254 and later tell the
service that maximum in $FDSTORE, and keeper = "auto" picks this keeper only when it is set and
positive; here a keep that would not fit is refused before anything is sent.
"""
from __future__ import annotations

import array
import fcntl
import os
import socket
from typing import MutableMapping, Sequence

from .holder_wire import name_problem
from .keeper import KeeperUnavailable

FD_NAME_PREFIX = "ecd-"  # the store is the unit's: other descriptors (sockets) may be named there too
SD_LISTEN_FDS_START = 3


def fdstore_room(environ: MutableMapping[str, str]) -> int:
    """$FDSTORE: the unit's FileDescriptorStoreMax= (systemd 254+); 0 when unset or not a count."""
    value = environ.get("FDSTORE", "")
    return int(value) if value.isdigit() else 0


class SystemdKeeper:
    kind = "systemd"

    def __init__(self, environ: MutableMapping[str, str] | None = None) -> None:
        self._environ = os.environ if environ is None else environ
        address = self._environ.get("NOTIFY_SOCKET", "")
        if not address.startswith(("/", "@")):
            raise KeeperUnavailable(f"$NOTIFY_SOCKET is {address!r}: systemd's file descriptor store needs a "
                                    f"unix socket path (a Type=notify service under systemd)")
        self._address = "\0" + address[1:] if address.startswith("@") else address
        self.room = fdstore_room(self._environ)  # 0: not told (systemd before 254)
        self._stored: dict[str, tuple[int, int]] = {}  # name -> (st_dev, st_ino) systemd holds for us
        self._taken = False
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._sock.settimeout(5.0)

    def take(self) -> dict[str, int]:
        """What the previous run stored, as systemd passed it to this process (once)."""
        if self._taken:
            return {}
        self._taken = True
        pid = self._environ.pop("LISTEN_PID", "")
        count = self._environ.pop("LISTEN_FDS", "")
        names = self._environ.pop("LISTEN_FDNAMES", "")
        if pid != str(os.getpid()) or not count.isdigit():
            return {}  # not set, or set for another process (a parent that did not unset them)
        labels = names.split(":") if names else []
        taken: dict[str, int] = {}
        for i in range(int(count)):
            fd = SD_LISTEN_FDS_START + i
            label = labels[i] if i < len(labels) else "unknown"
            try:
                fcntl.fcntl(fd, fcntl.F_SETFD, fcntl.fcntl(fd, fcntl.F_GETFD) | fcntl.FD_CLOEXEC)
            except OSError:
                continue  # not open after all: nothing to take
            if label.startswith(FD_NAME_PREFIX):
                name = label[len(FD_NAME_PREFIX):]
                taken[name] = fd
                st = os.fstat(fd)
                self._stored[name] = (st.st_dev, st.st_ino)  # systemd still holds it: no need to store again
        return taken

    def keep(self, fds: dict[str, int], unlink: Sequence[str] = ()) -> None:
        """Store `fds` by name (systemd duplicates them), removing names no longer kept. `unlink` is
        ignored: systemd holds descriptors, it never removes a file by its name."""
        problem = next(filter(None, map(name_problem, fds)), "")
        if problem:
            raise KeeperUnavailable(problem)
        if self.room and len(fds) > self.room:
            raise KeeperUnavailable(f"the unit's FileDescriptorStoreMax={self.room} is smaller than the {len(fds)} "
                                    f"descriptors of the pool and journal: raise it to at least {len(fds)}")
        for name in [n for n in self._stored if n not in fds]:
            self._notify(f"FDSTOREREMOVE=1\nFDNAME={FD_NAME_PREFIX}{name}")
            del self._stored[name]
        for name, fd in fds.items():
            st = os.fstat(fd)
            inode = (st.st_dev, st.st_ino)
            if self._stored.get(name) == inode:
                continue
            if name in self._stored:  # another file under the name now: the old one goes first
                self._notify(f"FDSTOREREMOVE=1\nFDNAME={FD_NAME_PREFIX}{name}")
                del self._stored[name]
            self._notify(f"FDSTORE=1\nFDNAME={FD_NAME_PREFIX}{name}\nFDPOLL=0", fd)
            self._stored[name] = inode

    def release(self) -> None:
        """A final stop: systemd closes every descriptor of ours it holds."""
        for name in list(self._stored):
            self._notify(f"FDSTOREREMOVE=1\nFDNAME={FD_NAME_PREFIX}{name}")
            del self._stored[name]

    def close(self) -> None:
        self._sock.close()

    def _notify(self, state: str, fd: int = -1) -> None:
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]).tobytes())] if fd >= 0 else []
        try:
            self._sock.sendmsg([state.encode()], ancillary, 0, self._address)
        except (OSError, TimeoutError) as exc:
            raise KeeperUnavailable(f"cannot reach systemd's notify socket {self._address.lstrip(chr(0))}: "
                                    f"{getattr(exc, 'strerror', None) or exc or 'timed out'}") from None
