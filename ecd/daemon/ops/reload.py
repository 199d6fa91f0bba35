"""SIGHUP: re-read node.toml and apply what can change while serving.

Runtime-changeable: node.log_level, node.shutdown_grace, control.allowed_uids and allowed_gids
(they apply to hellos from then on: sessions already open stay), every [leases] and [limits] key (limits
apply to requests from now on; a new limits.max_message_bytes only to connections made after
it, and clients learn new limits when they next say hello), and [namespaces.*] quotas
and guaranteed shares (they apply to allocations from now on: a namespace already over a lowered quota
is not evicted at once, its next allocation evicts its own entries). Anything else (node name, runtime
dir, endpoint, pool, ring, metrics address, a namespace's verify flag, a tenant added or removed) needs a
restart: the change is logged and ignored. A tenant's uids, gids and curve_keys apply to hellos from then on.
An invalid file is logged and nothing changes. The directory of allowed CURVE client keys
(control.curve_allowed_keys) is re-read on every SIGHUP; a new leases.session_ttl reaches
clients' heartbeat interval when they next say hello. limits.max_connections and
client_queue_bytes apply at once (the request-side part of client_queue_bytes, ZMQ_RCVHWM, to
connections made after it). `[cluster]`: `peers` and `peer_keys` apply at once (links to peers no
longer listed close; the allowed peer keys, cluster.curve_allowed_keys, are re-read); the rest of
[cluster] needs a restart.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import msgspec

from ...config import NamespaceSection, load_config, load_config_file
from ...errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from .context import ReloadTarget

log = logging.getLogger("ecd.daemon")

RUNTIME_KEYS = {"node.log_level", "node.shutdown_grace", "control.allowed_uids", "control.allowed_gids"}
RUNTIME_SECTIONS = {"leases", "limits", "namespaces"}
# the slot and submission areas are sized at start
START_ONLY_KEYS = {"leases.read_slots", "leases.slot_sessions", "leases.submit_records", "leases.put_slab"}
RUNTIME_PREFIXES = ("cluster.peers", "cluster.peer_keys.")


def _flatten(table: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in table.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, dotted + "."))
        else:
            out[dotted] = value
    return out


def _keep_verify_flags(old: dict[str, NamespaceSection], new: dict[str, NamespaceSection]) -> None:
    """`[namespaces.X] verify` needs a restart: connected clients learned it in their Welcome, and
    flipping it under them would refuse their unchecksummed puts."""
    for name in old.keys() | new.keys():
        verify = old[name].verify if name in old else False
        if name in new:
            new[name].verify = verify
        elif verify:
            new[name] = NamespaceSection(verify=True)


def _tenant_ids(key: str, old, new) -> bool:
    """A tenant's uids, gids or curve_keys: admitting ids is a reload, adding or removing a tenant
    a restart (its namespaces, and later its part of the pool, are made at start)."""
    section, _, rest = key.partition(".")
    name, _, field = rest.rpartition(".")
    return section == "tenants" and field in ("uids", "gids", "curve_keys") and name in old.tenants \
        and name in new.tenants


def _keep_tenants(old, new) -> None:
    """The tenants of the running daemon, with the ids the new file gives them."""
    new.tenants = {name: msgspec.structs.replace(tenant, uids=new.tenants[name].uids, gids=new.tenants[name].gids,
                                                 curve_keys=new.tenants[name].curve_keys)
                   if name in new.tenants else tenant for name, tenant in old.tenants.items()}


def reload_config(target: "ReloadTarget") -> None:
    if target.curve is not None:
        target.curve.reload()  # the allowed client keys: new handshakes see the new set
    if target.config_path is None:
        if target.peers is not None and target.peers.curve is not None:
            target.peers.curve.reload()
        log.warning("SIGHUP: no config file to reload")
        return
    try:
        new = load_config_file(target.config_path)
    except ConfigError as exc:
        log.error("SIGHUP: not reloading, the config is invalid: %s", exc)
        return
    old = target.config()
    old_flat, new_flat = _flatten(old.to_dict()), _flatten(new.to_dict())
    # both ways: a [namespaces.NAME] table can be removed
    changed = sorted(k for k in new_flat.keys() | old_flat.keys() if new_flat.get(k) != old_flat.get(k))
    applied = [k for k in changed if (k in RUNTIME_KEYS or k.split(".", 1)[0] in RUNTIME_SECTIONS
                                      or k.startswith(RUNTIME_PREFIXES) or _tenant_ids(k, old, new))
               and not k.endswith(".verify")
               and k not in START_ONLY_KEYS]
    refused = [k for k in changed if k not in applied]
    if target.peers is not None and (old.cluster.enabled == new.cluster.enabled):
        target.peers.reload(new.cluster)  # peers and peer keys; the allowed peer keys re-read
    if not changed:
        log.info("SIGHUP: config unchanged")
        return
    # Keep the parts that cannot change; take the rest from the new file.
    new.node.name, new.node.runtime_dir = old.node.name, old.node.runtime_dir
    # the allowed uids/gids apply to hellos from now on; the rest of [control] needs a restart
    new.control = msgspec.structs.replace(old.control, allowed_uids=new.control.allowed_uids,
                                          allowed_gids=new.control.allowed_gids)
    new.pool, new.ring, new.metrics = old.pool, old.ring, old.metrics
    new.leases = msgspec.structs.replace(new.leases, read_slots=old.leases.read_slots,
                                         slot_sessions=old.leases.slot_sessions,
                                         submit_records=old.leases.submit_records, put_slab=old.leases.put_slab)
    new.cluster = old.cluster  # its peers were applied above (Cluster.reload)
    _keep_verify_flags(old.namespaces, new.namespaces)
    _keep_tenants(old, new)
    try:  # what is kept with what is new must still add up (tenants' sizes against guaranteed shares)
        load_config(new.to_dict())
    except ConfigError as exc:
        log.error("SIGHUP: not reloading, the config with what cannot change at runtime kept is invalid: %s", exc)
        return
    # Report under the old log level, so "applied log_level=warning" itself is still seen.
    if applied:
        log.info("SIGHUP: applied %s", ", ".join(
            f"{k}={new_flat[k]}" if k in new_flat else f"{k} removed" for k in applied))
    for key in refused:
        log.warning("SIGHUP: cannot change %s at runtime (%s -> %s): restart to apply",
                    key, old_flat.get(key), new_flat.get(key))
    logging.getLogger().setLevel(new.node.log_level.upper())
    target.install(new)  # the store's limits and namespaces, the control socket's limits
