"""`[restart]` -> the keeper (ecd/daemon/restart/keeper.py: choose_keeper)."""
from __future__ import annotations

import socket

import pytest

from ecd.config import RestartSection
from ecd.daemon.restart.fdstore import SystemdKeeper
from ecd.daemon.restart.holder_client import HolderKeeper
from ecd.daemon.restart.keeper import KeeperUnavailable, NoKeeper, choose_keeper


def choose(tmp_path, environ: dict, **fields):
    return choose_keeper(RestartSection(**fields), "n1", str(tmp_path), environ)


def test_adopt_false_keeps_nothing(tmp_path):
    keeper = choose(tmp_path, {"NOTIFY_SOCKET": "/run/systemd/notify", "FDSTORE": "64"}, adopt=False, keeper="systemd")
    assert isinstance(keeper, NoKeeper) and keeper.kind == "none" and keeper.take() == {}


def test_auto_picks_systemds_store_only_when_the_unit_gave_it_room(tmp_path):
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
        notify.bind(str(tmp_path / "notify"))
        address = str(tmp_path / "notify")
        keeper = choose(tmp_path, {"NOTIFY_SOCKET": address, "FDSTORE": "64"})
        assert isinstance(keeper, SystemdKeeper) and keeper.kind == "systemd" and keeper.room == 64
        keeper.close()
        for env in ({"NOTIFY_SOCKET": address}, {"NOTIFY_SOCKET": address, "FDSTORE": "0"}, {"FDSTORE": "64"}, {}):
            keeper = choose(tmp_path, env)  # systemd before 254, no FileDescriptorStoreMax=, or no systemd
            assert isinstance(keeper, HolderKeeper) and keeper.spawn, env
            assert keeper.path == str(tmp_path / "ecd.n1.keeper" / "holder")


def test_explicit_kinds(tmp_path):
    spawn = choose(tmp_path, {}, keeper="spawn", hold=42)
    assert isinstance(spawn, HolderKeeper) and spawn.spawn and spawn.hold == 42.0 and spawn.kind == "holder"
    external = choose(tmp_path, {"NOTIFY_SOCKET": "/x", "FDSTORE": "9"}, keeper="holder")
    assert isinstance(external, HolderKeeper) and not external.spawn
    systemd = choose(tmp_path, {"NOTIFY_SOCKET": "@/org/freedesktop/systemd1/notify"}, keeper="systemd")
    assert isinstance(systemd, SystemdKeeper) and systemd.room == 0  # systemd before 254: not told
    systemd.close()
    with pytest.raises(KeeperUnavailable, match=r'keeper = "systemd" but \$NOTIFY_SOCKET is not set'):
        choose(tmp_path, {}, keeper="systemd")
