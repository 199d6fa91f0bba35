"""File-descriptor planning and kernel credentials of a unix-socket peer (ecd.daemon.control.connections)."""
from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys

from ecd.daemon.control.connections import FD_RESERVE, connection_budget, peer_credentials, peer_pidfd


def test_connection_budget_leaves_the_reserve_and_http_and_a_pidfd_per_connection():
    assert connection_budget(65536, 4096, 64) == 4096  # the configured cap fits
    assert connection_budget(1024, 4096, 64) == (1024 - FD_RESERVE - 64) // 2  # lowered to fit
    assert connection_budget(100, 4096, 64) == 16  # never nothing at all


def test_raise_fd_limit_lifts_the_soft_limit_to_the_hard_one():
    code = ("import resource; from ecd.daemon.control.connections import raise_fd_limit; "
            "s, h = resource.getrlimit(resource.RLIMIT_NOFILE); assert s == 256, s; "
            "n = raise_fd_limit(); assert n == h == resource.getrlimit(resource.RLIMIT_NOFILE)[0], (n, h); print(n)")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard)))
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == hard


def test_credentials_name_the_process_that_connected_whatever_it_says():
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    path = f"/tmp/ecd-cred-{os.getpid()}.sock"
    listener.bind(path)
    listener.listen(1)
    child = subprocess.Popen([sys.executable, "-c", f"import socket, time; s = socket.socket(socket.AF_UNIX); "
                              f"s.connect({path!r}); print('connected', flush=True); time.sleep(30)"],
                             stdout=subprocess.PIPE, text=True)
    try:
        conn, _ = listener.accept()
        assert child.stdout.readline().strip() == "connected"
        creds = peer_credentials(conn.fileno())
        assert creds is not None and creds.pid == child.pid and creds.uid == os.getuid()
        pidfd = peer_pidfd(conn.fileno(), creds.pid)
        assert pidfd >= 0
        child.kill()
        child.wait()
        import select
        assert select.select([pidfd], [], [], 5)[0] == [pidfd]  # readable: that process exited
        os.close(pidfd)
        assert conn.fileno() >= 0  # borrowed, never closed by the lookups
        conn.close()
    finally:
        if child.poll() is None:
            child.kill()
        listener.close()
        os.unlink(path)
    tcp = socket.socket()
    try:
        assert peer_credentials(tcp.fileno()) is None  # not a unix socket: nothing the kernel vouches for
    finally:
        tcp.close()
