"""An fd-socket flood (issue 40, attack 4): a group member opens hundreds of connections to the fd
socket and reads none. Each unread reply keeps the pool's descriptors in flight, which the kernel
counts against the daemon's user up to its open-file limit (a daemon without CAP_SYS_RESOURCE, as
a non-root one runs): before the bound, every honest new client then failed to get the pool.
The daemon here runs as root without CAP_SYS_RESOURCE and CAP_SYS_ADMIN (dropped from its
bounding set) and with an open-file limit of 512, so the kernel's limit is the one a non-root
daemon meets; the attacker is a real process tree of uid 65534.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from ecd.fd_passing import receive
from secutil import metric
from test_allowed_uids import connect_as

NOBODY = 65534
SOCKET_GID = 0
FD_LIMIT = 512
# 16 processes x 25 connections: 400 unread handouts of 2 descriptors (the ring, one segment) were
# 800 in flight, past the 512 the kernel allows the daemon's user
PROCESSES, CONNECTIONS = 16, 25

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the attacker drops from root to another uid and the "
                                                           "daemon drops capabilities: needs root")

FLOODER = r"""
import json, os, resource, socket, sys, time
path, uid, processes, connections = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
os.setgroups([0]); os.setgid(uid); os.setuid(uid)
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
children = []
for _ in range(processes):
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        held, failed = [], 0
        for _ in range(connections):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                s.connect(path)
                held.append(s)  # never read
            except OSError:
                failed += 1
        os.write(write_end, json.dumps({"held": len(held), "failed": failed}).encode())
        os.close(write_end)
        sys.stdin = open("/dev/null")
        time.sleep(600)  # until killed with the group
        os._exit(0)
    os.close(write_end)
    children.append(read_end)
reports = [json.loads(os.read(fd, 4096)) for fd in children]
print(json.dumps({"held": sum(r["held"] for r in reports), "failed": sum(r["failed"] for r in reports)}), flush=True)
sys.stdin.readline()
"""


def honest_handouts(fd_socket: str, count: int) -> tuple[int, list[str]]:
    """`count` fresh fetches of the pool's descriptors, as a new client makes them."""
    ok, errors = 0, []
    for _ in range(count):
        try:
            _, got = receive(fd_socket, timeout=5.0)
            for _, fd in got:
                os.close(fd)
            ok += 1
        except Exception as exc:  # noqa: BLE001 - the reason goes to the assertion
            errors.append(str(exc))
    return ok, errors


def test_an_unread_flood_leaves_other_clients_served(daemon_factory):
    d = daemon_factory(start=False)
    os.chmod(d.runtime_dir, 0o750)  # the group reaches the sockets
    d.start(prefix=("prlimit", f"--nofile={FD_LIMIT}:{FD_LIMIT}", "setpriv", "--bounding-set=-sys_resource,-sys_admin",
                    "--"))
    fd_socket = d.socket_path + ".fds"
    assert honest_handouts(fd_socket, 3)[0] == 3
    flooder = subprocess.Popen([sys.executable, "-c", FLOODER, fd_socket, str(NOBODY), str(PROCESSES),
                                str(CONNECTIONS)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        report = json.loads(flooder.stdout.readline())
        assert report["held"] >= 300, report  # the flood is on: hundreds of connections it does not read
        ok, errors = honest_handouts(fd_socket, 20)
        assert ok == 20, errors[:3]
        for uid in (4242, 4243):  # clients of other uids in the group, as real processes
            assert connect_as(d.endpoint, uid, uid)["outcome"] == "welcome"
        with d.client() as c:
            assert c.ping() > 0
        limited = metric(d, "ecd_pool_fd_handouts_total", outcome="unread_limit")
        unread = metric(d, "ecd_pool_fd_handouts_unread")
        assert limited >= report["held"] - 64, (limited, report)  # all but its bounded share were refused
        assert unread <= 48, unread  # what it holds unread: at most its uid's quarter of the budget (192 / 4)
        assert "pool handouts unread" in d.log()
    finally:
        os.killpg(flooder.pid, 9)
        flooder.wait(30)
    # its connections gone, the daemon lets go of what it kept for them
    deadline = time.monotonic() + 10
    while metric(d, "ecd_pool_fd_handouts_unread") != 0:
        assert time.monotonic() < deadline, metric(d, "ecd_pool_fd_handouts_unread")
        time.sleep(0.1)
    assert honest_handouts(fd_socket, 3)[0] == 3
