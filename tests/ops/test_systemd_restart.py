"""systemd/ecd.service keeps the pool across restarts and returns it at stop (issue 27), under a
real systemd: a throwaway one booted in a podman container whose root is an overlay of this host's
(so it is the host's systemd, with this repository and an interpreter at their own paths), the
repository's unit installed as is, and a drop-in that changes only what a test machine needs:
ExecStart= (the interpreter, PYTHONPATH= this tree) and PrivateUsers=no (a user namespace cannot
be made inside the container). Then, with entries put by a client:

- `systemctl restart ecd`: the new daemon adopts every entry from the unit's file descriptor store
  (FileDescriptorStoreMax=, [restart] keeper = "systemd" of configs/production.toml);
- SIGKILL (a crash, the OOM killer), restarted by Restart=on-failure: adopted again;
- `systemctl stop ecd`: systemd flushes the store, no memfd of the pool is held by any process,
  nothing of the node stays in /dev/shm, and the next start is cold.

Needs root, podman and systemd installed on the host, and an interpreter with ecd's dependencies
that user ecd may run (not under /root or /home: the unit's ProtectHome=yes hides them; the
image's /opt/ecd/venv from `make image` will do). Skips, saying why, without them.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CONF = os.environ.get("CONTAINERS_CONF", str(REPO / "deploy" / "podman" / "containers.conf"))
SYSTEMD = Path("/lib/systemd/systemd")
# Where the container sees this repository: not under /tmp (the unit's PrivateTmp=yes hides it,
# and a fresh clone in CI lives there) nor /home or /root (ProtectHome=yes)
SRC = "/opt/ecd-src"
ENTRIES = 20

BOOT = """#!/bin/sh
# Nothing that touches the host's devices or network: the rest of basic.target boots.
for u in systemd-udevd.service systemd-udevd-control.socket systemd-udevd-kernel.socket \\
         systemd-udev-trigger.service systemd-networkd.service networking.service ssh.service \\
         cron.service systemd-timesyncd.service systemd-resolved.service console-getty.service; do
    ln -sf /dev/null /etc/systemd/system/$u
done
exec /lib/systemd/systemd --unit=basic.target
"""

CLIENT = f"ENTRIES = {ENTRIES}" + """
import json, sys, torch, ecd
want = {f"sd-{i}": (torch.arange([4096, 65536, 1 << 20, 3 * 4096 + 5][i % 4], dtype=torch.int64) * 3 + i)
        .to(torch.uint8) for i in range(ENTRIES)}
with ecd.Client("ipc:///run/ecd/ecd.sock", timeout=20) as c:
    if sys.argv[1] == "put":
        for k, v in want.items():
            c.put(k, v)
    same = sum(1 for k, v in want.items() if c.exists(k) and torch.equal(c.get(k), v))
    print(json.dumps({"identical": same, "restart": c.stats()["restart"]}))
"""


def interpreter() -> str | None:
    """A python with ecd's dependencies that user ecd may execute under ProtectHome=yes."""
    for candidate in (sys.executable, "/opt/ecd/venv/bin/python"):
        real = os.path.realpath(candidate)
        if os.path.exists(candidate) and not real.startswith(("/root/", "/home/")):
            check = subprocess.run([candidate, "-c", "import zmq, msgspec, torch"], capture_output=True, timeout=120)
            if check.returncode == 0:
                return candidate
    return None


def unavailable() -> str | None:
    if os.geteuid() != 0:
        return "a throwaway systemd in a rootful podman container needs root"
    if shutil.which("podman") is None or not SYSTEMD.exists():
        return "needs podman and systemd installed on the host"
    if interpreter() is None:
        return ("no interpreter with ecd's dependencies outside /root and /home (the unit's ProtectHome=yes): "
                "`make image` builds /opt/ecd/venv")
    return None


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, CONTAINERS_CONF=CONF))
    if check and proc.returncode != 0:
        raise AssertionError(f"podman {' '.join(args[:4])} ... exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    return proc


class Machine:
    """A systemd booted in a container over an overlay of this host's root."""

    def __init__(self, scratch: Path, python: str) -> None:
        self.name = f"ecd-systemd-{os.getpid()}"
        self.python = python  # runs the daemon and the client
        (scratch / "boot.sh").write_text(BOOT)
        (scratch / "boot.sh").chmod(0o755)
        (scratch / "client.py").write_text(CLIENT)
        os.chmod(scratch, 0o755)
        podman("rm", "-f", self.name, check=False)
        tmpfs = [f"--tmpfs={path}:rw,notmpcopyup" for path in ("/tmp", "/run", "/run/lock", "/var/lib/containers")]
        podman("run", "-d", "--name", self.name, "--systemd=always", "--network=none", "--cap-add=SYS_ADMIN",
               "--security-opt", "seccomp=unconfined", *tmpfs, "-v", f"{scratch}:/t:ro", "-v", f"{REPO}:{SRC}:ro",
               "--rootfs", "/:O", "/t/boot.sh")
        deadline, state = time.monotonic() + 90, ""
        while state not in ("running", "degraded"):
            assert time.monotonic() < deadline, f"the container's systemd did not boot: {state}"
            time.sleep(0.5)
            state = self.sh("systemctl is-system-running", check=False).stdout.strip()

    def sh(self, command: str, check: bool = True, timeout: float = 180) -> subprocess.CompletedProcess:
        out = podman("exec", self.name, "/bin/sh", "-c", command, timeout=timeout, check=False)
        assert not check or out.returncode == 0, f"{command}: {out.stdout[-2000:]}{out.stderr[-2000:]}\n{self.log()}"
        return out

    def log(self) -> str:
        return podman("exec", self.name, "journalctl", "-u", "ecd", "--no-pager", "-n", "30",
                      check=False).stdout[-3000:]

    def client(self, what: str) -> dict:
        out = self.sh(f"PYTHONPATH={SRC} {self.python} /t/client.py {what}")
        return json.loads(out.stdout.strip().splitlines()[-1])

    def stored(self) -> int:
        return int(self.sh("systemctl show ecd -p NFileDescriptorStore --value").stdout)

    def close(self) -> None:
        podman("rm", "-f", "-t", "0", self.name, check=False)


@pytest.fixture(scope="module")
def machine():
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    python = interpreter()
    with tempfile.TemporaryDirectory(prefix="ecd-systemd-") as scratch:
        m = Machine(Path(scratch), python)
        try:
            m.sh(f"""set -e
                systemd-sysusers {SRC}/systemd/ecd.sysusers
                mkdir -p /etc/ecd /etc/systemd/system/ecd.service.d
                sed -e 's/^size = "64GiB"/size = "64MiB"/' -e 's/^segment_size = "4GiB"/segment_size = "16MiB"/' \\
                    {SRC}/configs/production.toml > /etc/ecd/node.toml
                cp {SRC}/systemd/ecd.service /etc/systemd/system/ecd.service
                printf '[Service]\\nExecStart=\\nExecStart={python} -m ecd serve --config /etc/ecd/node.toml\\n' \\
                    > /etc/systemd/system/ecd.service.d/test.conf
                printf 'Environment=PYTHONPATH={SRC}\\nPrivateUsers=no\\n' >> /etc/systemd/system/ecd.service.d/test.conf
                systemctl daemon-reload
                systemctl start ecd""")
            yield m
        finally:
            m.close()


def test_restart_and_crash_keep_the_pool_and_stop_returns_it(machine):
    put = machine.client("put")
    assert put["identical"] == ENTRIES and put["restart"]["keeper"] == "systemd", put
    assert machine.stored() == 4 + 3, "the store should hold the pool's 4 segments, the journal, its key and the ring"

    machine.sh("systemctl restart ecd")
    after = machine.client("check")
    assert after["identical"] == ENTRIES, (after, machine.log())
    assert after["restart"]["adopted"] and after["restart"]["entries"] == ENTRIES, after

    machine.sh("systemctl kill -s KILL ecd")  # Restart=on-failure brings it back, RestartSec=2s
    deadline = time.monotonic() + 60
    while machine.sh("systemctl is-active ecd", check=False).stdout.strip() != "active":
        assert time.monotonic() < deadline, machine.log()
        time.sleep(0.3)
    crashed = machine.client("check")
    assert crashed["identical"] == ENTRIES and crashed["restart"]["adopted"], (crashed, machine.log())

    machine.sh("systemctl stop ecd")
    assert machine.stored() == 0, "systemctl stop must flush the fd store"
    held = machine.sh("ls -l /proc/[0-9]*/fd 2>/dev/null | grep -c 'memfd:ecd\\.' || true").stdout.strip()
    assert held == "0", f"{held} descriptor(s) of the pool still held after the stop"
    assert machine.sh("ls /dev/shm").stdout.split() == [], "files left in /dev/shm"

    machine.sh("systemctl start ecd")
    cold = machine.client("check")
    assert cold["identical"] == 0 and not cold["restart"]["adopted"], cold
