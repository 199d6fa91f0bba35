"""node.group: the runtime dir, the ipc socket, the fd socket beside it (backing = "memfd") or every
/dev/shm file (backing = "named") belong to it, and nothing the daemon creates is open to other users."""
from __future__ import annotations

import grp
import os
import stat

import pytest

from conftest import shm_files, wait_for
from secutil import ecd, serve_error, write_node_toml


def _other_group() -> grp.struct_group | None:
    """An existing group that is not the daemon's (this test's) primary group."""
    for name in ("nogroup", "daemon", "users", "bin"):
        try:
            entry = grp.getgrnam(name)
        except KeyError:
            continue
        if entry.gr_gid != os.getegid():
            return entry
    return None


@pytest.mark.parametrize("backing", ["memfd", "named"])
@pytest.mark.parametrize("which", ["primary", "other"])
def test_every_file_the_daemon_creates_is_owner_and_group_only(daemon_factory, which, backing):
    if which == "primary":
        group_setting, gid = "", os.getegid()
    else:
        if os.geteuid() != 0:
            pytest.skip("giving files to a group the user is not in needs root (the daemon runs as root here "
                        "only in CI containers)")
        other = _other_group()
        if other is None:
            pytest.skip("no group other than the primary one exists on this host")
        group_setting, gid = other.gr_name, other.gr_gid
    d = daemon_factory(start=False, backing=backing)
    run_dir = os.path.join(d.runtime_dir, "run")  # created by the daemon
    write_node_toml(d, runtime_dir=run_dir, endpoint=f"ipc://{run_dir}/ecd.sock",
                    node=f'group = "{group_setting}"')
    d.start()

    st = os.stat(run_dir)
    # sticky (issue 40): a group member cannot rename or remove the daemon's names in it
    assert stat.S_IMODE(st.st_mode) == 0o1770 and st.st_gid == gid
    created = [os.path.join(run_dir, n) for n in os.listdir(run_dir)]
    created += [f"/dev/shm/{n}" for n in shm_files(d.node)]
    # The holder's directory (0700) with its socket, lock and log, and the restart journal
    # ([restart]): the daemon's user's alone (0600), not the group's: the pool's descriptors and the
    # journal are no client's business.
    keeper_dir = os.path.join(run_dir, f"ecd.{d.node}.keeper")
    st = os.lstat(keeper_dir)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid(), oct(st.st_mode)
    own = [os.path.join(keeper_dir, n) for n in os.listdir(keeper_dir)] + [p for p in created if p.endswith(".journal")]
    assert {os.path.basename(p) for p in own} >= {"holder", "holder.lock", "holder.log"}, own
    created = [p for p in created if p not in own and p != keeper_dir]
    for path in own:
        st = os.stat(path)
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid(), (path, oct(st.st_mode))
    kinds = {os.path.basename(p).rsplit(".", 1)[-1] for p in created}
    # memfd: the pool and ring have no names, the fd socket hands them out (the lock stays in /dev/shm)
    assert {"sock", "0", "ring", "lock"} <= kinds if backing == "named" else kinds == {"sock", "fds", "lock"}, created
    for path in created:
        st = os.stat(path)
        # the ring is read-only to the group: clients map it read-only, only the daemon writes
        expected = 0o640 if path.endswith(".ring") else 0o660
        assert stat.S_IMODE(st.st_mode) == expected, (path, oct(st.st_mode))
        assert st.st_gid == gid, (path, st.st_gid, gid)
        assert st.st_mode & 0o007 == 0
    with d.client() as c:  # and it still serves
        assert c.ping() > 0
    assert d.stop() == 0
    from ecd.daemon.restart.holder_client import HolderKeeper
    HolderKeeper(d.node, run_dir, spawn=False).release()  # a final stop: the holder lets the pool go
    assert wait_for(lambda: shm_files(d.node) == [], 5.0), shm_files(d.node)


def test_unknown_group_is_a_one_line_start_error(daemon_factory):
    d = daemon_factory(start=False)
    write_node_toml(d, node='group = "no-such-group-ecd"')
    rc, err = serve_error(d.config)
    assert rc == 2
    assert err.strip().splitlines() == [err.strip()]
    assert "node.group: unknown group 'no-such-group-ecd'" in err
    check = ecd("check-config", str(d.config))
    assert check.returncode == 2 and "node.group" in check.stderr
    assert shm_files(d.node) == []
