"""Who holds the host pool while no daemon runs: the keeper's interface.

A daemon that adopts (`[restart] adopt = true`) hands the descriptors of its host pool's
segments and of its journal (ecd/memory/journal.py) to a keeper as soon as they exist,
and the next daemon of the node takes them back at its start. Descriptors travel by name:
"pool.<n>" for segment n, "journal" for the journal. Implementations: systemd's file descriptor
store (restart/fdstore.py) and a holder process (restart/holder.py); `NoKeeper` where nothing
outlives the process.
"""
from __future__ import annotations

from typing import Any, Protocol, Sequence


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


def choose_keeper(restart: Any, node: str, runtime_dir: str) -> PoolKeeper:
    """The keeper `[restart]` asks for (placeholder until the holder and systemd keepers land)."""
    return NoKeeper()
