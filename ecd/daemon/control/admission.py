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

from ...config import DEFAULT_TENANT
from ...errors import Code
from ..registry.entries import RequestError

log = logging.getLogger("ecd.daemon")

MAX_LOGGED_UIDS = 4096  # refusals are logged once per uid; past this many uids, no longer logged


def admit(uid: int, gid: int, config: Any, groups: Iterable[int] = (), own_uid: int | None = None) -> str | None:
    """None when the peer may connect, else why not: one line naming its uid and what to set.

    `config`: the daemon's Config or its [control] section; `groups`: the peer's supplementary
    groups (SO_PEERGROUPS), where known; `own_uid`: the daemon's uid (default: this process's).
    The ids a `[tenants.NAME]` table names are allowed too (once either list is set)."""
    control = getattr(config, "control", config)
    if not control.allowed_uids and not control.allowed_gids:
        return None
    # (a tenant's ids too: Config.client_ids; a bare [control] section, its lists alone)
    allowed_uids, allowed_gids = (config.client_ids() if hasattr(config, "client_ids")
                                  else (set(control.allowed_uids), set(control.allowed_gids)))
    if uid == (os.geteuid() if own_uid is None else own_uid) or uid in allowed_uids:
        return None
    if gid in allowed_gids or any(g in allowed_gids for g in groups):
        return None
    return (f"uid {uid} (gid {gid}) may not use this ecd daemon: it admits its own uid and "
            f"[control] allowed_uids / allowed_gids, which name neither this uid nor its groups; "
            f"add {uid} to control.allowed_uids (or one of its gids to control.allowed_gids) in the "
            f"daemon's node.toml and send the daemon SIGHUP")


def tenant_of(config: Any, uid: int | None, gid: int = -1, groups: Iterable[int] = (), curve_key: str = "",
              own_uid: int | None = None) -> str:
    """The tenant a client belongs to ("" for the default tenant): the one naming its uid, else
    the one naming its primary or a supplementary gid, else its CURVE key (`uid` None: a tcp
    client). RequestError(NOT_ALLOWED) for gids of two tenants (ambiguous), or for a client of
    no tenant when `[tenants] default = false` (the daemon's own uid is always the default's)."""
    tenants = getattr(config, "tenants", None)
    if not tenants:
        return ""
    if uid is not None:
        for name, tenant in tenants.items():
            if uid in tenant.uids:
                return name
        ids = {gid, *groups}
        named = sorted(name for name, tenant in tenants.items() if ids.intersection(tenant.gids))
        if len(named) > 1:
            raise RequestError(Code.NOT_ALLOWED, f"uid {uid} belongs to tenants {', '.join(named)} by its groups "
                                                 f"({sorted(ids)}): a client belongs to exactly one tenant; name its "
                                                 f"uid in one [tenants.NAME] uids")
        if named:
            return named[0]
    elif curve_key:
        for name, tenant in tenants.items():
            if curve_key in tenant.curve_keys:
                return name
    default = tenants.get(DEFAULT_TENANT)
    if default is not None and not default.admit and uid != (os.geteuid() if own_uid is None else own_uid):
        who = f"uid {uid} (gid {gid})" if uid is not None else f"CURVE key {curve_key or '(none)'}"
        raise RequestError(Code.NOT_ALLOWED, f"{who} belongs to no tenant and [tenants] default = false: name it "
                                             f"in a [tenants.NAME] table of the daemon's node.toml")
    return ""


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
