"""Who holds the host pool while no daemon runs: the keeper's interface.

A daemon that adopts (`[restart] adopt = true`) hands the descriptors of its host pool's
segments and of its journal (ecd/memory/journal.py) to a keeper as soon as they exist,
and the next daemon of the node takes them back at its start. Descriptors travel by name:
"pool.<n>" for segment n, "journal" for the journal. Implementations: systemd's file descriptor
store (restart/fdstore.py) and a holder process (restart/holder.py); `NoKeeper` where nothing
outlives the process.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, MutableMapping, Protocol, Sequence

if TYPE_CHECKING:
    from ...config import RestartSection


class PoolKeeper(Protocol):
    kind: str  # "systemd", "holder" or "none": for the log and `ecd status`

    def take(self) -> dict[str, int]:
        """The descriptors a previous run of this node left with the keeper, by name; the caller
        owns (and closes) them. {} when there are none."""

    def keep(self, fds: dict[str, int], unlink: Sequence[str] = ()) -> None:
        """Hand `fds` to the keeper (it duplicates them: the caller keeps its own), replacing
        whatever it held. `unlink`: /dev/shm paths (named pool files) the keeper removes when
        it lets the pool go."""

    def release(self) -> None:
        """A final stop: the keeper lets the pool go now (closes its descriptors, unlinks the
        named files): the memory returns to the machine."""

    def close(self) -> None:
        """This daemon exits for any other reason: the keeper goes on holding the pool."""


class NoKeeper:
    """`[restart] adopt = false`: nothing outlives the process."""

    kind = "none"

    def take(self) -> dict[str, int]:
        return {}

    def keep(self, fds: dict[str, int], unlink: Sequence[str] = ()) -> None:
        pass

    def release(self) -> None:
        pass

    def close(self) -> None:
        pass


class KeeperUnavailable(Exception):
    """The keeper cannot hold the pool (no holder answers, systemd's store is not set up, the
    holder refused): the text says why. The daemon logs it and starts cold, without adopting."""


def choose_keeper(restart: "RestartSection", node: str, runtime_dir: str,
                  environ: MutableMapping[str, str] = os.environ) -> PoolKeeper:
    """The keeper `[restart]` asks for. "auto": systemd's file descriptor store when the unit
    gave it room ($NOTIFY_SOCKET and a positive $FDSTORE, systemd 254+), else a holder process
    the daemon spawns. KeeperUnavailable for keeper = "systemd" outside systemd."""
    if not restart.adopt:
        return NoKeeper()
    from .fdstore import SystemdKeeper, fdstore_room
    from .holder_client import HolderKeeper
    kind = restart.keeper
    if kind == "auto":
        kind = "systemd" if environ.get("NOTIFY_SOCKET") and fdstore_room(environ) > 0 else "spawn"
    if kind == "systemd":
        if not environ.get("NOTIFY_SOCKET"):
            raise KeeperUnavailable('[restart] keeper = "systemd" but $NOTIFY_SOCKET is not set: not started by '
                                    'systemd as a Type=notify service (use keeper = "auto" or "spawn")')
        return SystemdKeeper(environ)
    return HolderKeeper(node, runtime_dir, hold=float(restart.hold), spawn=kind == "spawn")
