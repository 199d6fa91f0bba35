"""Preflight: what a node must give the daemon before it starts, checked up front.

`ecd doctor` prints every finding; `ecd serve` runs the same checks first thing and refuses to
start on an error, with the same line, instead of failing later in a worse way: a pool larger
than the cgroup's memory limit is OOM-killed mid-start with no log line (tmpfs and memfd pages
are charged to the cgroup, so no free-space check of /dev/shm sees it coming); an unwritable
/dev/shm used to be a traceback. Warnings (serve logs them and starts) are limits the daemon can
live with, or that bite in another process:

- error: the pool, the ring and the daemon's own headroom exceed the cgroup memory limit; the
  node lock's directory (/dev/shm) is not writable; with `backing = "named"`, /dev/shm has not
  room for the pool; the daemon cannot create its socket in the socket directory; CUDA is
  unusable or a configured device is missing where `[pool.cuda]` is set.
- warning: RLIMIT_MEMLOCK below the pool where it gets pinned (CUDA clients register it with
  cuMemHostRegister in *their* processes; NIXL registers it in the daemon, and UCX may fall back
  to unpinned transports); the hard RLIMIT_NOFILE cannot hold limits.max_connections (the daemon
  lowers the cap itself); node.group or an allowed uid/gid cannot reach the socket directory
  (allowed ids get ACL entries from the daemon where it owns the directory and ACLs are kept).
- `ecd doctor --uid N`: what a client of uid N needs (admission, and the socket by ACL or group).

One function per check, each taking what it reads as parameters so tests can give it a fake
cgroup tree or rlimit.
"""
from __future__ import annotations

import errno
import grp
import os
import pwd
import resource
import stat
from dataclasses import dataclass
from typing import Any, Iterable

from ..config import Config
from ..errors import ConfigError
from ..listeners import ACL_XATTR

# The daemon's own memory beside its pool and ring, charged to the same cgroup: its interpreter,
# libraries and bookkeeping (measured: 79 MiB RSS idle, 45 MiB of it anonymous and 24 MiB mapped
# code, which the kernel can drop under pressure), plus one request in flight of up to
# limits.max_message_bytes (an inline put is decoded from it).
DAEMON_BASE_BYTES = 80 << 20
UNLIMITED = 1 << 62  # cgroup v1 writes "unlimited" as LONG_MAX rounded down to a page
CAP_IPC_LOCK = 14


@dataclass(frozen=True)
class Finding:
    level: str  # "ok", "warning" or "error" (ecd serve refuses to start)
    key: str  # the config key or the resource it is about
    message: str  # what was found, and for a problem the fix

    def line(self) -> str:
        return f"{self.key}: {self.message}"


def format_bytes(n: int) -> str:
    """A byte count as the findings write it: 4 significant digits of the largest unit it
    reaches ("300MiB", "1.5GiB", "512 bytes")."""
    for unit, factor in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= factor:
            return f"{n / factor:.4g}{unit}"
    return f"{n} bytes"


# ---- memory: the cgroup's limit ---------------------------------------------------------------

@dataclass(frozen=True)
class MemoryLimit:
    limit: int
    where: str  # the file that sets it


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def cgroup_memory_limit(proc_cgroup: str = "/proc/self/cgroup",
                        mountinfo: str = "/proc/self/mountinfo") -> MemoryLimit | None:
    """The memory limit in force for this process: the smallest memory.max (cgroup v2) or
    memory.limit_in_bytes (v1, which owns the memory controller on hybrid hosts) of its cgroup
    and the ancestors this mount namespace can see. None where there is none, or no cgroupfs."""
    try:
        with open(proc_cgroup) as f:
            memberships = f.read().splitlines()
        with open(mountinfo) as f:
            mounts = f.read().splitlines()
    except OSError:
        return None
    v1: str | None = None
    v2: str | None = None
    for line in memberships:
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    for version, member in (("v1", v1), ("v2", v2)):
        if member is None:
            continue
        path = member
        for line in mounts:
            fields = line.split()
            if "-" not in fields or len(fields) < 5:
                continue
            sep = fields.index("-")
            fstype, options = fields[sep + 1], fields[sep + 3] if len(fields) > sep + 3 else ""
            if not (version == "v1" and fstype == "cgroup" and "memory" in options.split(",")
                    or version == "v2" and fstype == "cgroup2"):
                continue
            root, mount_point = _unescape(fields[3]), _unescape(fields[4])
            rel = path[len(root):] if root != "/" and path.startswith(root) else path
            # a cgroup path outside the mount's root ("/.."): the mount itself is this cgroup's view
            directory = mount_point if ".." in rel.split("/") else os.path.join(mount_point, rel.lstrip("/"))
            return _smallest_limit(directory, mount_point,
                                   "memory.limit_in_bytes" if version == "v1" else "memory.max")
    return None


def _smallest_limit(directory: str, top: str, name: str) -> MemoryLimit | None:
    best: MemoryLimit | None = None
    top = os.path.normpath(top)
    directory = os.path.normpath(directory)
    while True:
        try:
            with open(os.path.join(directory, name)) as f:
                text = f.read().strip()
        except OSError:
            text = "max"
        if text.isdigit() and int(text) < UNLIMITED and (best is None or int(text) < best.limit):
            best = MemoryLimit(int(text), os.path.join(directory, name))
        if directory == top or len(directory) <= len(top) or directory == "/":
            return best
        directory = os.path.dirname(directory)


def memory_needed(config: Config) -> dict[str, int]:
    """What the daemon's cgroup must hold, by part."""
    parts = {"host pool": int(config.pool.host.size),
             "event ring": config.ring.file_bytes(),
             "daemon": DAEMON_BASE_BYTES + int(config.limits.max_message_bytes)}
    if config.pool.disk is not None:
        parts["spill buffer"] = int(config.pool.disk.spill_buffer)
    return parts


def check_memory(config: Config, limit: MemoryLimit | None) -> Finding:
    parts = memory_needed(config)
    need = sum(parts.values())
    listed = " + ".join(f"{format_bytes(n)} {name}" for name, n in parts.items())
    if limit is None:
        return Finding("ok", "pool.host.size",
                       f"no cgroup memory limit; the daemon needs {format_bytes(need)} ({listed})")
    if need <= limit.limit:
        return Finding("ok", "pool.host.size", f"{format_bytes(need)} needed ({listed}) fits the cgroup memory limit "
                                               f"{format_bytes(limit.limit)} ({limit.where})")
    room = limit.limit - (need - parts["host pool"])
    fix = (f"shrink pool.host.size to at most {format_bytes(room - room % (1 << 20))} or " if room >= 1 << 20 else "")
    return Finding("error", "pool.host.size", (
        f"the cgroup memory limit is {format_bytes(limit.limit)} ({limit.where}), the daemon needs "
        f"{format_bytes(need)}: {listed} (shared memory pages are charged to the cgroup: past the limit the "
        f"kernel OOM-kills the daemon; the daemon's share is its interpreter and libraries, "
        f"~{format_bytes(DAEMON_BASE_BYTES)}, and one request of limits.max_message_bytes); {fix}raise the limit "
        f"(podman/docker --memory, Kubernetes resources.limits.memory, systemd MemoryMax=)"))


def check_pool_room(config: Config) -> list[Finding]:
    """backing = "memfd": the node's available memory must hold a new pool (what `ecd serve`
    refuses otherwise: MemfdPool.check_room); a pool a holder keeps for this node is adopted
    instead of made. (backing = "named": /dev/shm's room, check_shm.)"""
    from ..daemon.restart.holder_wire import socket_path
    from ..memory.host import ShmError
    from ..memory.memfd import check_memory_room
    if getattr(config.pool.host, "backing", "named") != "memfd":
        return []
    if config.restart.adopt and os.path.exists(socket_path(config.node.runtime_dir, config.node.name)):
        return [Finding("ok", "pool.host.size", "a holder keeps this node's pool: a start adopts it, nothing new "
                                                "is allocated")]
    try:
        check_memory_room(int(config.pool.host.size))
    except ShmError as exc:
        return [Finding("error", "pool.host.size", str(exc))]
    return [Finding("ok", "pool.host.size", "the node's available memory holds the pool")]


# ---- /dev/shm -------------------------------------------------------------------------------

def _writable(directory: str) -> str | None:
    """None, or why a file cannot be created in `directory` (the daemon's own test)."""
    probe = os.path.join(directory, f".ecd-write-test-{os.getpid()}")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def check_shm(config: Config, shm_dir: str | None = None, lock_dir: str | None = None) -> list[Finding]:
    """The node lock's directory must be writable; with backing = "named", /dev/shm must have room
    for the pool and ring (the node's own files of a previous run count as room: start removes them)."""
    from ..memory import host
    shm_dir = shm_dir or host.SHM_DIR
    lock_dir = lock_dir or os.path.dirname(host.NodeLock(config.node.name).path)
    named = getattr(config.pool.host, "backing", "named") == "named"
    why = _writable(lock_dir)
    if why is not None:
        keeps = "its node lock and, with backing = \"named\", its pool" if lock_dir == shm_dir else "its node lock"
        return [Finding("error", lock_dir, (
            f"not writable ({why}): the daemon keeps {keeps} there; mount a writable tmpfs on {lock_dir} "
            f"(podman/docker give each container one; Kubernetes: an emptyDir with medium: Memory)"))]
    if not named:
        return [Finding("ok", lock_dir, "writable (node lock)")]
    try:
        st = os.statvfs(shm_dir)
    except OSError as exc:
        return [Finding("error", shm_dir, f"cannot be read ({exc.strerror}): backing = \"named\" keeps the pool there")]
    free = st.f_bavail * st.f_frsize
    prefix, reclaim = f"ecd.{config.node.name}.", 0
    for name in os.listdir(shm_dir):
        if name.startswith(prefix) and not name.endswith(".lock"):
            try:
                reclaim += os.stat(os.path.join(shm_dir, name)).st_size
            except OSError:
                pass
    need = int(config.pool.host.size) + config.ring.file_bytes()
    if need > free + reclaim:
        return [Finding("error", shm_dir, (
            f"has {format_bytes(free + reclaim)} free, backing = \"named\" needs {format_bytes(need)} there for the "
            f"pool and ring: shrink pool.host.size, grow {shm_dir} (podman/docker --shm-size, Kubernetes: an emptyDir "
            f"with medium: Memory and a sizeLimit) or use backing = \"memfd\""))]
    return [Finding("ok", shm_dir,
                    f"writable, {format_bytes(free + reclaim)} free for the {format_bytes(need)} pool and ring")]


# ---- rlimits --------------------------------------------------------------------------------

def _limit_text(value: int) -> str:
    return "unlimited" if value == resource.RLIM_INFINITY else format_bytes(value)


def has_capability(bit: int, status: str = "/proc/self/status") -> bool:
    try:
        with open(status) as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> bit & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def check_memlock(config: Config, rlimit: tuple[int, int] | None = None,
                  ipc_lock: bool | None = None) -> list[Finding]:
    """Where the host pool gets pinned: [pool.cuda] (clients cuMemHostRegister their mappings of
    it) and a [cluster] transport that pins it (nixl: the daemon registers it with UCX)."""
    pinners = []
    if config.pool.cuda is not None:
        pinners.append("[pool.cuda] clients pin it with cuMemHostRegister (their own limit applies)")
    if config.cluster.enabled:
        from ..transport.registry import transport_class  # the class only: NIXL itself is not loaded
        how = transport_class(config.cluster.transport).pins_pool
        if how:
            pinners.append(f"[cluster] transport = \"{config.cluster.transport}\" {how}")
    if not pinners:
        return []
    soft, hard = rlimit if rlimit is not None else resource.getrlimit(resource.RLIMIT_MEMLOCK)
    ipc_lock = has_capability(CAP_IPC_LOCK) if ipc_lock is None else ipc_lock
    pool = int(config.pool.host.size)
    if soft == resource.RLIM_INFINITY or soft >= pool or ipc_lock:
        why = "CAP_IPC_LOCK" if ipc_lock and not (soft == resource.RLIM_INFINITY or soft >= pool) else \
            f"RLIMIT_MEMLOCK {_limit_text(soft)}"
        return [Finding("ok", "RLIMIT_MEMLOCK", f"{why} lets the {format_bytes(pool)} host pool be pinned")]
    return [Finding("warning", "RLIMIT_MEMLOCK", (
        f"{_limit_text(soft)} (hard {_limit_text(hard)}) cannot pin the {format_bytes(pool)} host pool: "
        f"{'; '.join(pinners)}; raise it to at least {format_bytes(pool)} or unlimited (systemd LimitMEMLOCK=infinity, "
        f"podman/docker --ulimit memlock=-1:-1, Kubernetes: the runtime's default ulimits) or grant CAP_IPC_LOCK"))]


def check_open_files(config: Config, rlimit: tuple[int, int] | None = None) -> Finding:
    """What the hard RLIMIT_NOFILE allows: the daemon raises its soft limit to it at start."""
    from ..daemon.control.connections import FD_RESERVE, connection_budget
    soft, hard = rlimit if rlimit is not None else resource.getrlimit(resource.RLIMIT_NOFILE)
    usable = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    limits = config.limits
    http = config.metrics.max_connections if config.metrics.address is not None else 0
    cap = connection_budget(usable, limits.max_connections, http)
    wanted = 2 * limits.max_connections + FD_RESERVE + http
    if cap >= limits.max_connections:
        return Finding("ok", "RLIMIT_NOFILE", f"hard limit {usable} holds limits.max_connections={limits.max_connections}")
    short = f" and fewer than limits.max_clients={limits.max_clients} sessions" if cap < limits.max_clients else ""
    return Finding("warning", "RLIMIT_NOFILE", (
        f"the hard open-file limit {usable} holds {cap} of limits.max_connections={limits.max_connections}{short} "
        f"(each connection takes its socket and its session's pidfd, beside {FD_RESERVE} reserved"
        f"{f' and {http} metrics connections' if http else ''}): the daemon lowers the cap to {cap} at start; "
        f"raise the hard limit to {wanted} (systemd LimitNOFILE=, podman/docker --ulimit nofile={wanted}:{wanted}) "
        f"or lower limits.max_connections"))


# ---- the socket directory -------------------------------------------------------------------

def _permits(st: os.stat_result, uid: int, gids: Iterable[int], bits: int = 0o1) -> bool:
    """Whether a process of `uid` and `gids` gets `bits` (0o1: search, 0o3: create in) on a
    directory, by the unix permission rules: the owner's, else the group's, else the others'."""
    if uid == 0:
        return True
    if st.st_uid == uid:
        return (st.st_mode >> 6) & bits == bits
    if st.st_gid in set(gids):
        return (st.st_mode >> 3) & bits == bits
    return st.st_mode & bits == bits


def _groups_of(uid: int) -> set[int]:
    """The gids a user gets from the passwd and group files (none for a uid without an entry,
    as in most containers: then only explicit allowed_gids would give it group permissions)."""
    try:
        user = pwd.getpwuid(uid)
    except KeyError:
        return set()
    return {user.pw_gid} | {g.gr_gid for g in grp.getgrall() if user.pw_name in g.gr_mem}


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def check_socket_dir(config: Config, gid: int, euid: int | None = None) -> list[Finding]:
    """The ipc socket's directory: the daemon must create its socket there; node.group's members
    and [control] allowed_uids / allowed_gids must be able to pass through it to connect."""
    endpoint = config.control.endpoint
    if not endpoint.startswith("ipc://") or endpoint[len("ipc://"):].startswith("@"):
        return []  # tcp, or an abstract socket: no directory
    euid = os.geteuid() if euid is None else euid
    directory = os.path.dirname(endpoint[len("ipc://"):]) or "."
    try:
        st = os.stat(directory)
    except FileNotFoundError:
        if os.path.normpath(directory) == os.path.normpath(config.node.runtime_dir):
            return [Finding("ok", "control.endpoint", f"{directory} is created at start (0770, group {_group_name(gid)})")]
        return [Finding("error", "control.endpoint", f"directory of {endpoint[6:]} does not exist: create it, "
                                                     "or put the socket in node.runtime_dir")]
    except OSError as exc:
        return [Finding("error", "control.endpoint", f"cannot look at {directory} ({exc.strerror})")]
    mode = stat.S_IMODE(st.st_mode)
    shown = f"{directory} is {mode:04o} {_user_name(st.st_uid)}:{_group_name(st.st_gid)}"
    own_groups = {os.getegid(), *os.getgroups()} if euid == os.geteuid() else _groups_of(euid)
    if not _permits(st, euid, own_groups, 0o3):
        return [Finding("error", "control.endpoint", f"{shown}: the daemon (uid {euid}) cannot create its socket there; "
                                                     f"chown {euid} {directory}, or run the daemon as its owner")]
    findings = []
    if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
        findings.append(Finding("warning", "control.endpoint", f"{shown}: any user can replace the socket in it; "
                                                               f"chmod o-w {directory}"))
    if config.node.group and not _permits(st, -1, [gid]):  # "": a single-user node, the owner's uid
        findings.append(Finding("warning", "node.group", (
            f"{shown}: members of group {_group_name(gid)} (node.group) cannot reach the socket; "
            f"chgrp {_group_name(gid)} {directory} && chmod g+x {directory}")))
    # the daemon gives the allowed ids a search entry on it (ecd.listeners.SocketFiles) where it can
    by_acl = acl_grantable(directory, st, euid)
    cannot = (f"the daemon cannot give it an ACL entry (not the directory's owner, or no ACLs on its "
              f"filesystem); setfacl -m {{}}:x {directory}, or chmod o+x {directory} (who connects is then the "
              f"daemon's SO_PEERCRED check)")
    for uid in getattr(config.control, "allowed_uids", []):
        if uid != euid and not _permits(st, uid, _groups_of(uid)) and not by_acl:
            findings.append(Finding("warning", "control.allowed_uids", f"{shown}: uid {uid} cannot reach the socket; "
                                                                       + cannot.format(f"u:{uid}")))
    for other in getattr(config.control, "allowed_gids", []):
        if not _permits(st, -1, [other]) and not by_acl:
            findings.append(Finding("warning", "control.allowed_gids", (
                f"{shown}: group {_group_name(other)} cannot reach the socket; " + cannot.format(f"g:{other}"))))
    if not findings:
        allowed = getattr(config.control, "allowed_uids", []) or getattr(config.control, "allowed_gids", [])
        findings.append(Finding("ok", "control.endpoint", f"{shown}: the daemon creates its socket there and its "
                                f"clients can reach it" + (" (the allowed uids/gids by ACL entries the daemon gives "
                                                           "them)" if allowed and by_acl else "")))
    return findings


def acl_grantable(directory: str, st: os.stat_result, euid: int) -> bool:
    """Whether a daemon of `euid` can give ids ACL entries on `directory`: it owns it (or is root)
    and the filesystem keeps POSIX ACLs."""
    if euid not in (0, st.st_uid):
        return False
    try:
        os.getxattr(directory, ACL_XATTR)
    except OSError as exc:
        return exc.errno == errno.ENODATA
    return True


def check_uid(config: Config, gid: int, uid: int) -> list[Finding]:
    """What a client of `uid` needs to use this daemon (`ecd doctor --uid`): to be admitted by
    [control] allowed_uids / allowed_gids, and to reach the socket, by an ACL entry (allowed ids)
    or as a member of node.group."""
    from ..daemon.control.admission import admit, tenant_of
    from ..daemon.registry.entries import RequestError
    groups = _groups_of(uid)
    try:
        primary = pwd.getpwuid(uid).pw_gid
    except KeyError:
        primary = uid  # no passwd entry (most containers): its own gid, as a pod's runAsUser alone gives
    why = admit(uid, primary, config, groups)
    if why is not None:
        return [Finding("error", "control.allowed_uids", why)]
    try:
        tenant = tenant_of(config, uid, primary, groups)
    except RequestError as exc:
        return [Finding("error", "tenants", str(exc))]
    whose = f" (tenant {tenant})" if tenant else " (the default tenant)" if config.tenants else ""
    uids, gids = config.client_ids()
    if uid in uids or groups & gids:
        return [Finding("ok", "control.allowed_uids", f"uid {uid}{whose} is admitted and reaches the sockets by the "
                                                      f"ACL entries the daemon gives it: no group membership needed")]
    if not config.node.group or gid in groups:
        return [Finding("ok", "node.group", f"uid {uid}{whose} reaches the socket as a member of group "
                                            f"{_group_name(gid)}")]
    return [Finding("warning", "node.group", (
        f"uid {uid} reaches the socket only as a member of group {_group_name(gid)} (node.group): add that gid to "
        f"its supplementary groups (a pod's securityContext.supplementalGroups: [{gid}]), or list uid {uid} in "
        f"[control] allowed_uids (no group needed then)"))]


# ---- CUDA -----------------------------------------------------------------------------------

def open_cuda(devices: list[int | str], driver: Any = None) -> tuple[Any, list[int]]:
    """Load the CUDA driver (unless a test passes one) and map `[pool.cuda] devices` to this
    process's ordinals; ConfigError with the line serve and doctor print."""
    from ..memory.cuda import CudaError, CudaUnavailable, DeviceNotFound, load_driver, resolve_devices
    try:
        if driver is None:
            driver = load_driver()
        return driver, resolve_devices(driver, devices)
    except CudaUnavailable as exc:
        raise ConfigError(f"pool.cuda: CUDA is not available on this node: {exc}") from None
    except DeviceNotFound as exc:
        raise ConfigError(f"pool.cuda.devices: {exc}") from None
    except CudaError as exc:
        raise ConfigError(f"pool.cuda: {exc}") from None


def check_cuda(config: Config, driver: Any = None) -> list[Finding]:
    if config.pool.cuda is None:
        return []
    try:
        driver, ordinals = open_cuda(config.pool.cuda.devices, driver)
    except ConfigError as exc:
        key, _, message = str(exc).partition(": ")
        return [Finding("error", key, message)]
    listed = ", ".join(f"{o} {driver.device_uuid(o)}" for o in ordinals)
    return [Finding("ok", "pool.cuda", f"driver loaded; devices {listed}"), check_cuda_export(config, driver, ordinals)]


def check_cuda_export(config: Config, driver: Any, ordinals: list[int]) -> Finding:
    """How the arenas will reach clients: a warning where `export = "auto"` falls back to legacy
    IPC handles, which clients in other pods (pid and IPC namespaces) cannot open."""
    from ..memory.cuda import CudaError, choose_export
    cuda = config.pool.cuda
    assert cuda is not None
    try:
        export = choose_export(driver, ordinals, cuda.export, fd_socket=config.pool.host.backing == "memfd")
    except CudaError as exc:
        key, _, message = str(exc).partition(" = ")
        return Finding("error", key, message)
    if export == "fd":
        return Finding("ok", "pool.cuda.export", "fd: arenas are handed out as file descriptors on the fd socket "
                       "(clients in other pods map them)")
    if cuda.export == "ipc":
        return Finding("ok", "pool.cuda.export", "ipc: clients must share the daemon's pid and IPC namespaces")
    return Finding("warning", "pool.cuda.export", "auto chose ipc (the devices cannot export file descriptors, or "
                   "[pool.host] backing is \"named\"): clients in other pods cannot open the arenas")


# ---- all of them ----------------------------------------------------------------------------

def preflight(config: Config, gid: int, *, cuda: bool = True, cuda_driver: Any = None) -> list[Finding]:
    """Every check, on this process's own cgroup, limits and view of the files. `cuda=False`: the
    caller opens CUDA itself (ecd serve keeps the driver it loads)."""
    findings = [check_memory(config, cgroup_memory_limit())]
    findings += check_pool_room(config)
    findings += check_shm(config)
    findings += check_memlock(config)
    findings.append(check_open_files(config))
    findings += check_socket_dir(config, gid)
    if cuda:
        findings += check_cuda(config, cuda_driver)
    return findings
