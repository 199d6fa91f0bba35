"""systemd/ecd.service, systemd/ecd.sysusers and `make install` (see docs/operating.md).

The unit is checked three ways: its settings are parsed here (the service contract, and nothing
that would cut engines off from /dev/shm, the socket or their pids), `systemd-analyze verify` and
`systemd-analyze security --offline=true` judge it when systemd-analyze is installed, and the
syscalls the daemon was seen to make must pass its SystemCallFilter=.

verify checks that ExecStart's program exists. The repository's unit runs `/usr/bin/env ecd`,
and /usr/bin/env exists wherever systemd does (verify does not look up env's argument), so it is
verified as is, with or without `ecd` on PATH. The unit `make install` writes names the installed
entry point by its final path (/usr/bin/ecd for PREFIX=/usr), which does not exist on the build
host when DESTDIR stages it elsewhere: that one is verified as a copy whose ExecStart points at
the staged file, which is the same program.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "systemd" / "ecd.service"
SYSUSERS = REPO / "systemd" / "ecd.sysusers"
PRODUCTION = REPO / "configs" / "production.toml"
ANALYZE = shutil.which("systemd-analyze")
MAX_EXPOSURE = 2.0
SOURCE_EXEC_START = "/usr/bin/env ecd serve --config /etc/ecd/node.toml"

needs_analyze = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed (package systemd)")

# Every syscall `ecd serve` made under strace -f (start-up with a 64 MiB pool, puts, gets, views,
# exists, a client SIGKILLed holding a lease, metrics scrapes, sd_notify with a watchdog, SIGHUP,
# SIGTERM drain and exit), on x86-64 with Python 3.11, pyzmq 27, uvloop 0.23. libzmq calls
# sched_setscheduler (in @resources) from each of its threads and aborts if that fails.
# backing = "memfd" adds memfd_create (@ipc) and sendmsg (@network-io: the fd socket's SCM_RIGHTS).
# chown and fchown (@chown, which ~@privileged takes away: the unit adds it back) give the socket,
# the fd socket and the node lock to node.group. [restart] (issue 27, strace -f of a start with a
# spawned holder and a 64 MiB pool in 4 segments, then SIGTERM): recvmsg (the holder's replies),
# vfork, setsid, chdir, dup2, close_range, wait4 (spawning the holder), mkdir, getgroups,
# clock_nanosleep, process_vm_writev; the systemd keeper's FDSTORE=1 datagrams are sendmsg.
OBSERVED_SYSCALLS = """
accept4 access arch_prctl bind brk chmod clone3 close connect epoll_create1 epoll_ctl epoll_pwait
epoll_wait eventfd2 execve exit exit_group fallocate fchmod fcntl flock fstat ftruncate futex getcwd
getdents64 getegid geteuid getgid getpeername getpid getrandom getsockname getsockopt gettid getuid
io_uring_enter io_uring_setup ioctl listen lseek madvise mbind memfd_create mmap mprotect munmap newfstatat
openat pidfd_open pipe2 poll prctl pread64 prlimit64 pwrite64 read readlink recvfrom rseq
rt_sigaction rt_sigprocmask rt_sigreturn sched_getaffinity sched_getparam sched_getscheduler
sched_setscheduler sendmsg sendto set_robust_list set_tid_address setsockopt socket socketpair statfs
sysinfo umask uname unlink write
chown fchown recvmsg vfork setsid chdir dup2 close_range wait4 mkdir getgroups clock_nanosleep process_vm_writev
""".split()


def parse_unit(text: str) -> dict[str, list[str]]:
    """'Section.Key' -> the values assigned, in order (a unit may assign a key several times)."""
    settings: dict[str, list[str]] = {}
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, sep, value = line.partition("=")
        assert sep, f"not a key=value line: {raw!r}"
        settings.setdefault(f"{section}.{key.strip()}", []).append(value.strip())
    return settings


def one(settings: dict[str, list[str]], key: str) -> str:
    values = settings.get(key)
    assert values, f"{key} is not set"
    assert len(values) == 1, f"{key} is set {len(values)} times: {values}"
    return values[0]


def seconds(timespan: str) -> float:
    units = {"ms": 1e-3, "s": 1, "sec": 1, "min": 60, "m": 60, "h": 3600}
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", timespan):
        total += float(number) * units[unit or "s"]
    return total


def analyze_lines(*args: str) -> tuple[int, list[str]]:
    proc = subprocess.run([ANALYZE, *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "SYSTEMD_PAGER": "", "SYSTEMD_COLORS": "0"})
    return proc.returncode, (proc.stdout + proc.stderr).splitlines()


def assert_verify_clean(unit: Path) -> None:
    rc, lines = analyze_lines("verify", str(unit))
    # Lines about other units come from the host's own configuration, not from ours.
    ours = [line for line in lines if "ecd" in line or str(unit) in line]
    assert not ours, "systemd-analyze verify complains:\n" + "\n".join(ours)
    assert rc == 0 or lines, f"systemd-analyze verify exited {rc} without saying why"


@pytest.fixture(scope="module")
def unit() -> dict[str, list[str]]:
    return parse_unit(UNIT.read_text())


# ---- the unit's contract (no systemd needed) ------------------------------------------------------

def test_unit_is_a_notify_service_with_watchdog_and_restart(unit):
    assert one(unit, "Service.Type") == "notify"
    assert one(unit, "Service.ExecStart") == SOURCE_EXEC_START
    assert one(unit, "Service.ExecReload") == "/bin/kill -HUP $MAINPID"
    assert one(unit, "Service.Restart") == "on-failure"
    assert one(unit, "Service.RestartPreventExitStatus") == "2"  # config errors do not loop
    assert seconds(one(unit, "Service.WatchdogSec")) >= 10
    # the drain after SIGTERM lasts up to node.shutdown_grace (10 s by default) before exit 0
    assert seconds(one(unit, "Service.TimeoutStopSec")) > 10
    assert one(unit, "Service.LimitMEMLOCK") == "infinity"
    # room for limits.max_connections (4096 by default), each with a pidfd, and the reserve
    assert int(one(unit, "Service.LimitNOFILE")) >= 2 * 4096 + 512
    assert one(unit, "Install.WantedBy") == "multi-user.target"


def test_unit_keeps_the_pool_across_a_restart_and_returns_it_at_stop(unit):
    """[restart] under systemd: the daemon stores the pool's memfds and the journal in the unit's
    file descriptor store. Room for every one of production.toml's segments plus the journal, a
    store systemd flushes at `systemctl stop` (FileDescriptorStorePreserve=restart, the default:
    "yes" would keep the memory after a stop), notifications accepted from the daemon itself."""
    sys.path.insert(0, str(REPO))
    from ecd.config import load_config_file
    config = load_config_file(PRODUCTION)
    host = config.pool.host
    segments = -(-int(host.size) // int(host.segment_size))
    room = int(one(unit, "Service.FileDescriptorStoreMax"))
    assert room >= segments + 3, f"FileDescriptorStoreMax={room} < {segments} segments + the journal, its key, the ring"
    assert room >= 4096, "room for big pools in small segments too (the unit's comment says why 4096)"
    assert unit.get("Service.FileDescriptorStorePreserve", ["restart"]) == ["restart"], \
        "the pool must return to the machine at `systemctl stop`"
    assert one(unit, "Service.NotifyAccess") in ("main", "exec", "all")
    assert one(unit, "Service.Restart") != "no", "a crash must restart (and adopt) without an operator"
    assert config.restart.adopt, "production.toml turns adoption off"
    # "auto" finds the store only where systemd says its size ($FDSTORE, systemd 254+); named
    # here, it works under older systemd too (Debian 12's 252), where "auto" would spawn a holder
    # that the unit's stop or restart kills with the rest of its cgroup.
    assert config.restart.keeper == "systemd"


def test_unit_shares_socket_and_shm_with_group_ecd(unit):
    assert one(unit, "Service.User") == "ecd"
    assert one(unit, "Service.Group") == "ecd"
    assert "Service.DynamicUser" not in unit, "engines need a stable group to join"
    assert one(unit, "Service.UMask") == "0007"
    assert one(unit, "Service.RuntimeDirectory") == "ecd"
    assert one(unit, "Service.RuntimeDirectoryMode") == "0770"
    # production.toml must put the socket into that runtime directory
    prod = PRODUCTION.read_text()
    assert 'runtime_dir = "/run/ecd"' in prod and 'endpoint = "ipc:///run/ecd/ecd.sock"' in prod
    # Nothing may hide or freeze the host's /dev/shm: PrivateDevices= bind-mounts it into the
    # private /dev and ProtectSystem=strict leaves /dev writable, but these would not.
    for key in ("InaccessiblePaths", "ReadOnlyPaths", "TemporaryFileSystem", "BindReadOnlyPaths"):
        for value in unit.get(f"Service.{key}", []):
            assert "/dev" not in value and "/run/ecd" not in value, f"{key}={value}"
    assert unit.get("Service.PrivateNetwork", ["no"]) == ["no"], "metrics HTTP needs the host network"
    # RemoveIPC= would delete, at stop, every /dev/shm file owned by group ecd, engines' included
    assert unit.get("Service.RemoveIPC", ["no"]) == ["no"]


def test_unit_hardening_is_in_place(unit):
    expected = {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes",
                "PrivateTmp": "yes", "PrivateDevices": "yes", "ProtectKernelTunables": "yes",
                "ProtectKernelModules": "yes", "ProtectControlGroups": "yes", "RestrictNamespaces": "yes",
                "LockPersonality": "yes", "RestrictSUIDSGID": "yes", "SystemCallArchitectures": "native",
                "CapabilityBoundingSet": ""}
    for key, value in expected.items():
        assert one(unit, f"Service.{key}") == value, key
    families = set(one(unit, "Service.RestrictAddressFamilies").split())
    assert families == {"AF_UNIX", "AF_INET", "AF_INET6"}, families


@pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed (package systemd)")
def test_syscalls_the_daemon_makes_pass_the_filter(unit):
    """SystemCallFilter= lines, expanded with systemd's own group tables, allow what ecd uses."""
    rc, lines = analyze_lines("syscall-filter")
    assert rc == 0, lines
    groups: dict[str, list[str]] = {}
    current = None
    for line in lines:
        if line.startswith("@"):
            current = groups.setdefault(line.strip(), [])
        elif line.startswith(" ") and current is not None and not line.strip().startswith("#"):
            if line.strip():
                current.append(line.strip())
        elif not line.strip():
            current = None

    def expand(names: list[str]) -> set[str]:
        out: set[str] = set()
        for name in names:
            out |= expand(groups[name]) if name.startswith("@") else {name}
        return out

    filters = unit["Service.SystemCallFilter"]
    assert not filters[0].startswith("~"), "the first SystemCallFilter= line must be an allow list"
    allowed: set[str] = set()
    for entry in filters:  # an allow list, then lines that remove (~) from or add to it
        deny = entry.startswith("~")
        names = expand(entry.lstrip("~").split())
        allowed = allowed - names if deny else allowed | names
    blocked = sorted(set(OBSERVED_SYSCALLS) - allowed)
    assert not blocked, f"SystemCallFilter= blocks syscalls ecd makes: {blocked}"


# ---- systemd-analyze --------------------------------------------------------------------------------

@needs_analyze
def test_systemd_analyze_verify_is_clean():
    assert_verify_clean(UNIT)


@needs_analyze
def test_systemd_analyze_security_exposure_is_low():
    rc, lines = analyze_lines("security", "--offline=true", "--no-pager", str(UNIT))
    text = "\n".join(lines)
    if rc != 0 and ("offline" in text and ("unrecognized" in text or "Unknown" in text)):
        pytest.skip("this systemd-analyze has no --offline (systemd < 250)")
    found = re.search(r"Overall exposure level for ecd\.service: (\d+(?:\.\d+)?)", text)
    assert found, f"no exposure line in:\n{text}"
    exposure = float(found.group(1))
    assert exposure <= MAX_EXPOSURE, f"exposure {exposure} > {MAX_EXPOSURE}:\n{text}"


@pytest.mark.skipif(shutil.which("systemd-sysusers") is None, reason="systemd-sysusers is not installed")
def test_sysusers_creates_the_ecd_user_and_group(tmp_path):
    (tmp_path / "etc").mkdir()
    proc = subprocess.run(["systemd-sysusers", f"--root={tmp_path}", str(SYSUSERS)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    users = {f[0]: f for f in (l.split(":") for l in (tmp_path / "etc/passwd").read_text().splitlines())}
    groups = {f[0]: f for f in (l.split(":") for l in (tmp_path / "etc/group").read_text().splitlines())}
    assert "ecd" in users and "ecd" in groups
    assert users["ecd"][3] == groups["ecd"][2], "user ecd's primary group must be group ecd"
    assert users["ecd"][6].endswith("nologin")


# ---- make install -------------------------------------------------------------------------------------

def make(*args: str) -> subprocess.CompletedProcess:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    # Under `make test`, the outer make's flags and variables must not leak into this one.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "DESTDIR")}
    return subprocess.run(["make", "--no-print-directory", "-C", str(REPO), *args], capture_output=True,
                          text=True, timeout=300, env=env)


def install(dest: Path) -> subprocess.CompletedProcess:
    try:
        new_enough = int(metadata.version("setuptools").split(".")[0]) >= 71
    except metadata.PackageNotFoundError:
        new_enough = False
    if not new_enough:
        pytest.skip("setuptools >= 71 is not installed here: make install would fetch it to build")
    proc = make("install", f"DESTDIR={dest}", "PREFIX=/usr", f"PYTHON={sys.executable}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def staged_site(dest: Path) -> Path:
    found = sorted(dest.glob("usr/**/*-packages/ecd/__init__.py"))
    assert len(found) == 1, f"the package is not installed once under {dest}/usr: {found}"
    return found[0].parent.parent


@pytest.fixture(scope="module")
def staged(tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("stage")
    install(dest)
    return dest


def test_install_puts_files_where_documented(staged):
    assert (staged / "usr/bin/ecd").is_file() and os.access(staged / "usr/bin/ecd", os.X_OK)
    assert (staged / "etc/ecd/node.toml").read_text() == PRODUCTION.read_text()
    assert (staged / "lib/systemd/system/ecd.service").is_file()
    assert (staged / "usr/lib/sysusers.d/ecd.conf").read_text() == SYSUSERS.read_text()
    staged_site(staged)


def test_installed_unit_runs_the_installed_entry_point(staged):
    text = (staged / "lib/systemd/system/ecd.service").read_text()
    installed = parse_unit(text)
    assert one(installed, "Service.ExecStart") == "/usr/bin/ecd serve --config /etc/ecd/node.toml"
    site = "/" + str(staged_site(staged).relative_to(staged))
    env = installed.get("Service.Environment", [])
    if site not in sys.path:  # the interpreter would not find the package by itself
        assert env == [f"PYTHONPATH={site}"], env
    # apart from those lines the installed unit is the repository's
    source = parse_unit(UNIT.read_text())
    for key in set(source) | set(installed):
        if key not in ("Service.ExecStart", "Service.Environment"):
            assert installed.get(key) == source.get(key), key


@needs_analyze
def test_installed_unit_verifies_clean(staged, tmp_path):
    copy = tmp_path / "ecd.service"
    text = (staged / "lib/systemd/system/ecd.service").read_text()
    copy.write_text(text.replace("ExecStart=/usr/bin/ecd ", f"ExecStart={staged}/usr/bin/ecd "))
    assert_verify_clean(copy)


def test_installed_entry_point_runs_from_the_installed_package(staged, tmp_path):
    site = staged_site(staged)
    env = {**os.environ, "PYTHONPATH": str(site)}
    proc = subprocess.run([str(staged / "usr/bin/ecd"), "--help"], capture_output=True, text=True,
                          timeout=60, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "serve" in proc.stdout and "check-config" in proc.stdout
    where = subprocess.run([sys.executable, "-c", "import ecd.cli.commands; print(ecd.cli.commands.__file__)"],
                           capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    assert where.stdout.strip().startswith(str(site)), where.stdout + where.stderr


def test_reinstall_keeps_node_toml_and_uninstall_removes_the_rest(tmp_path):
    dest = tmp_path / "stage"
    install(dest)
    config = dest / "etc/ecd/node.toml"
    config.write_text('[node]\nname = "mine"\n')
    proc = install(dest)
    assert config.read_text() == '[node]\nname = "mine"\n'
    assert "keeping the existing" in proc.stdout
    site = staged_site(dest)
    proc = make("uninstall", f"DESTDIR={dest}", "PREFIX=/usr", f"PYTHON={sys.executable}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for gone in ("usr/bin/ecd", "lib/systemd/system/ecd.service", "usr/lib/sysusers.d/ecd.conf"):
        assert not (dest / gone).exists(), gone
    assert not (site / "ecd").exists()
    assert config.read_text() == '[node]\nname = "mine"\n'


def test_existing_make_targets_are_unchanged():
    for target, wants in (("serve", "ecd serve --config configs/node.toml"), ("test", "-m pytest"),
                          ("bench", "benchmarks/bench_core.py")):
        proc = make("-n", target)
        assert proc.returncode == 0 and wants in proc.stdout, (target, proc.stdout + proc.stderr)
    venv = make("-n", "venv")
    assert venv.returncode == 0 and "--prefix" not in venv.stdout, venv.stdout
    assert "--no-deps" in make("-n", "install").stdout
