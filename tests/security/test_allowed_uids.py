"""`[control] allowed_uids` / `allowed_gids`: who may say hello on the local socket besides the
daemon's own uid, checked against the kernel's record of the connecting process (SO_PEERCRED,
SO_PEERGROUPS). Real client processes that drop to other uids (tests/security/ns_client.py);
each of them is in the socket's group (root here), so only the lists decide.

Before (issue 24) there were no such keys: a config naming them did not start, and every process
that could open the socket was served.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ecd import ControlClient
from secutil import metric, wait_for, write_node_toml

NS_CLIENT = Path(__file__).resolve().parent / "ns_client.py"
NOBODY = 65534
SOCKET_GID = 0  # node.group "" is the daemon's primary group: root's here

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="clients of other uids are made by dropping root's "
                                                           "privileges: these tests need to run as root")


def connect_as(endpoint: str, uid: int, gid: int, groups: tuple[int, ...] = (SOCKET_GID,), put: bool = False) -> dict:
    """One client process of that uid, gid and supplementary groups: its hello's outcome (`put`:
    and a put and get through the pool)."""
    out = subprocess.run([sys.executable, str(NS_CLIENT), "connect", endpoint, "--uid", str(uid), "--gid", str(gid),
                          "--groups", ",".join(map(str, groups))] + (["--put", "1"] if put else []),
                         capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert (report["uid"], report["gid"]) == (uid, gid), report  # it did drop
    return report


def start(d, control: str) -> None:
    write_node_toml(d, control=control)
    os.chmod(d.runtime_dir, 0o750)  # the test's temp dir (0700): the socket's group may reach the socket
    d.start()


def test_a_uid_that_is_not_allowed_is_refused_with_its_uid_and_what_to_set(daemon_factory):
    d = daemon_factory(start=False)
    start(d, "allowed_uids = [4242]\nallowed_gids = [7777]")
    for _ in range(3):
        refused = connect_as(d.endpoint, NOBODY, NOBODY)
        assert refused["outcome"] == "PermissionDenied", refused
        assert f"uid {NOBODY} (gid {NOBODY}) may not use this ecd daemon" in refused["message"], refused
        assert f"add {NOBODY} to control.allowed_uids" in refused["message"], refused
    assert d.log().count("refused a hello from") == 1  # logged once per uid, counted every time
    assert metric(d, "ecd_sessions_refused_total", limit="allowed_uids") == 3

    assert connect_as(d.endpoint, 4242, 4242)["outcome"] == "welcome"  # its uid is allowed
    assert connect_as(d.endpoint, 5555, 7777)["outcome"] == "welcome"  # its primary gid is
    assert connect_as(d.endpoint, 6666, 6666, (SOCKET_GID, 7777))["outcome"] == "welcome"  # a supplementary group
    with ControlClient(d.endpoint, timeout=10.0) as own:  # the daemon's own uid, in no list: always
        assert own.ping() > 0
        # the refused ones hold no session; the welcomed ones' goodbyes may still be on their way
        assert wait_for(lambda: own.stats()["clients"] == 1, timeout=10), own.stats()

    # SIGHUP: the lists apply to hellos from then on.
    write_node_toml(d, control=f"allowed_uids = [4242, {NOBODY}]")
    d.proc.send_signal(signal.SIGHUP)
    assert wait_for(lambda: "SIGHUP: applied" in d.log(), timeout=10), d.log()
    allowed_now = connect_as(d.endpoint, NOBODY, NOBODY)
    assert allowed_now["outcome"] == "welcome", allowed_now
    assert connect_as(d.endpoint, 5555, 7777)["outcome"] == "PermissionDenied"  # 7777 no longer listed


def acl_users(path) -> set[int]:
    from ecd.listeners import USER, read_acl
    return {ident for tag, ident in read_acl(str(path)) if tag == USER}


def test_an_allowed_uid_in_no_group_of_the_socket_connects_puts_and_gets_by_acl(daemon_factory):
    """Issue 44 (from the pods work): a uid in allowed_uids reaches the sockets by that alone, no
    supplementalGroups, no world-writable socket or directory: the daemon gives the control and
    fd sockets ACL entries for it and its directory a search entry. Before: EACCES at connect."""
    d = daemon_factory(start=False)
    start(d, "allowed_uids = [4242]\nallowed_gids = [7777]")
    fds = Path(d.endpoint.removeprefix("ipc://") + ".fds")
    for path in (Path(d.endpoint.removeprefix("ipc://")), fds):
        assert os.stat(path).st_mode & 0o007 == 0, oct(os.stat(path).st_mode)  # nothing for others
        assert acl_users(path) == {4242}, path
    assert os.stat(d.runtime_dir).st_mode & 0o007 == 0
    assert 4242 in acl_users(d.runtime_dir)

    allowed = connect_as(d.endpoint, 4242, 4242, groups=(), put=True)  # in no group of the daemon's
    assert allowed["outcome"] == "welcome" and allowed["groups"] == [], allowed
    assert allowed["put_get"] and allowed["sealed"] and allowed["local"], allowed
    by_gid = connect_as(d.endpoint, 5555, 7777, groups=())  # its primary gid is allowed: a group entry
    assert by_gid["outcome"] == "welcome", by_gid
    outsider = connect_as(d.endpoint, NOBODY, NOBODY, groups=())  # the socket's permissions stop it
    assert outsider["outcome"] != "welcome", outsider

    # SIGHUP: the sockets' entries follow the lists (4242 out, nobody in)
    write_node_toml(d, control=f"allowed_uids = [{NOBODY}]")
    d.proc.send_signal(signal.SIGHUP)
    assert wait_for(lambda: "SIGHUP: applied" in d.log(), timeout=10), d.log()
    assert acl_users(fds) == {NOBODY}
    assert connect_as(d.endpoint, NOBODY, NOBODY, groups=(), put=True)["put_get"]
    assert connect_as(d.endpoint, 4242, 4242, groups=())["outcome"] != "welcome"


def test_without_allowed_lists_whoever_can_open_the_socket_is_served(daemon):
    os.chmod(daemon.runtime_dir, 0o750)
    assert connect_as(daemon.endpoint, NOBODY, NOBODY)["outcome"] == "welcome"
    assert metric(daemon, "ecd_sessions_refused_total", limit="allowed_uids") == 0


@pytest.mark.parametrize("key, value, message", [
    ("allowed_uids", "[-1]", "control.allowed_uids: must be uids/gids between 0 and 4294967294, got -1"),
    ("allowed_gids", "[4294967295]", "control.allowed_gids: must be uids/gids between 0 and 4294967294"),
    ("allowed_uids", '["nobody"]', "control.allowed_uids"),
])
def test_bad_allowed_ids_are_one_line_config_errors(tmp_path, key, value, message):
    from ecd.config import load_config_file
    from ecd.errors import ConfigError
    path = tmp_path / "node.toml"
    path.write_text(f"[control]\n{key} = {value}\n")
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_config_file(path)


@pytest.mark.parametrize("key", ["allowed_uids", "allowed_gids"])
def test_allowed_lists_with_named_pool_files_are_refused_at_start(daemon_factory, key):
    """Issue 40, attack 3: with backing = "named" a group member the lists refuse opened
    /dev/shm/ecd.<node>.0 read-write and overwrote an entry. The daemon now refuses to start on
    that combination, saying why, and creates no pool file; with memfd (the default) it serves."""
    d = daemon_factory(start=False, backing="named")
    write_node_toml(d, control=f"{key} = [{NOBODY}]")
    proc = subprocess.run([sys.executable, "-m", "ecd", "serve", "--config", str(d.config)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert f'control.{key}: protects nothing with [pool.host] backing = "named"' in proc.stderr, proc.stderr[-2000:]
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"ecd.{d.node}.")]
    memfd = daemon_factory(start=False)
    start(memfd, f"{key} = [{NOBODY}]")
    assert memfd.alive()
