"""Who may say hello on a local connection: `[control] allowed_uids` / `allowed_gids`.

The socket's file permissions are the first gate (its directory and the socket belong to
node.group, mode 0770/0660). These lists are the second, for pods of other uids that share the
socket directory but must not all be trusted alike: a local peer is admitted when its uid is
the daemon's own, or is in allowed_uids, or its primary gid or one of its supplementary groups
is in allowed_gids. Both lists empty: everyone who can open the socket is admitted (as before
they existed).

Ids are the kernel's record of the connecting process (SO_PEERCRED, SO_PEERGROUPS), taken at
connect() and translated into the daemon's user namespace, so a client cannot claim another
uid. Every local listener calls admit() with them (the control socket's Hello here).
"""
from __future__ import annotations

import logging
import os
from typing import Any, Iterable

log = logging.getLogger("ecd.daemon")

MAX_LOGGED_UIDS = 4096  # refusals are logged once per uid; past this many uids, no longer logged


def admit(uid: int, gid: int, config: Any, groups: Iterable[int] = (), own_uid: int | None = None) -> str | None:
    """None when the peer may connect, else why not: one line naming its uid and what to set.

    `config`: the daemon's Config or its [control] section; `groups`: the peer's supplementary
    groups (SO_PEERGROUPS), where known; `own_uid`: the daemon's uid (default: this process's)."""
    control = getattr(config, "control", config)
    allowed_uids, allowed_gids = control.allowed_uids, control.allowed_gids
    if not allowed_uids and not allowed_gids:
        return None
    if uid == (os.geteuid() if own_uid is None else own_uid) or uid in allowed_uids:
        return None
    if gid in allowed_gids or any(g in allowed_gids for g in groups):
        return None
    return (f"uid {uid} (gid {gid}) may not use this ecd daemon: it admits its own uid and "
            f"[control] allowed_uids / allowed_gids, which name neither this uid nor its groups; "
            f"add {uid} to control.allowed_uids (or one of its gids to control.allowed_gids) in the "
            f"daemon's node.toml and send the daemon SIGHUP")


class Refusals:
    """Counts refused peers and logs each uid's first refusal (an attacker retrying in a loop
    must not flood the log)."""

    def __init__(self) -> None:
        self.count = 0
        self._logged: set[int] = set()

    def refused(self, uid: int, gid: int, pid: int, why: str) -> None:
        self.count += 1
        if uid in self._logged or len(self._logged) >= MAX_LOGGED_UIDS:
            return
        self._logged.add(uid)
        who = f"pid {pid}" if pid > 0 else "a process outside the daemon's pid namespace"
        log.warning("refused a hello from %s: %s (further refusals of uid %d are counted in "
                    "ecd_sessions_refused_total{limit=\"allowed_uids\"}, not logged)", who, why, uid)
