"""admission.admit: which kernel credentials `[control] allowed_uids` / `allowed_gids` admit, and
the `ecd status` table that shows how each session is watched."""
from __future__ import annotations

import io
import os

import pytest
from rich.console import Console

from ecd.cli.output import render_sessions
from ecd.config import ControlSection, load_config
from ecd.daemon.control.admission import Refusals, admit
from ecd.errors import ConfigError

OWN = 999


def control(uids=(), gids=()) -> ControlSection:
    return ControlSection(allowed_uids=list(uids), allowed_gids=list(gids))


def test_empty_lists_admit_everyone():
    assert admit(1234, 1234, control(), own_uid=OWN) is None


def test_own_uid_is_always_admitted_and_others_only_when_listed():
    c = control(uids=[1000], gids=[2000])
    assert admit(OWN, OWN, c, own_uid=OWN) is None
    assert admit(1000, 1000, c, own_uid=OWN) is None
    assert admit(1001, 2000, c, own_uid=OWN) is None  # primary gid
    assert admit(1002, 1002, c, groups=(5, 2000), own_uid=OWN) is None  # supplementary (fsGroup)
    why = admit(1003, 1003, c, groups=(5,), own_uid=OWN)
    assert why is not None and "uid 1003 (gid 1003)" in why and "control.allowed_uids" in why


def test_admit_takes_the_whole_config_too():
    cfg = load_config({"control": {"allowed_uids": [7]}})
    assert admit(7, 7, cfg, own_uid=OWN) is None
    assert admit(8, 8, cfg, own_uid=OWN) is not None
    assert cfg.control.allowed_uids == [7]


def test_lists_are_deduplicated_and_sorted():
    assert control(uids=[3, 1, 3]).allowed_uids == [1, 3]


def test_refusals_are_counted_every_time_and_logged_once_per_uid(caplog):
    refusals = Refusals()
    for uid in (5, 5, 6, 5):
        refusals.refused(uid, uid, 0, f"uid {uid} may not")
    assert refusals.count == 4
    logged = [r.getMessage() for r in caplog.records if "refused a hello" in r.getMessage()]
    assert len(logged) == 2 and "outside the daemon's pid namespace" in logged[0]


def test_status_table_says_how_each_session_is_watched():
    out = io.StringIO()
    render_sessions([
        {"id": 1, "name": "vllm", "pid": 0, "pid_ns": 4026532178, "pid_ns_claimed": False, "uid": 1000,
         "gid": 1000, "watch": "pidfd"},
        {"id": 2, "name": "", "pid": 0, "pid_ns": 0, "pid_ns_claimed": False, "uid": -1, "gid": -1,
         "watch": "heartbeat"},
        {"id": 3, "name": "old", "pid": 0, "pid_ns": 42, "pid_ns_claimed": True, "uid": 1000, "gid": 1000,
         "watch": "heartbeat"},
    ], Console(file=out, width=200))
    rows = out.getvalue().splitlines()
    vllm = next(r for r in rows if "vllm" in r)
    assert "0 (another pid namespace)" in vllm and "4026532178" in vllm and "pidfd" in vllm
    remote = next(r for r in rows if r.strip().startswith("2 "))
    assert "heartbeat (leases.session_ttl)" in remote
    assert "42 (its claim)" in next(r for r in rows if "old" in r)


def test_allowed_lists_with_a_tcp_endpoint_are_a_config_error():
    with pytest.raises(ConfigError, match="control.allowed_gids: applies to an ipc:// endpoint only"):
        load_config({"control": {"endpoint": "tcp://127.0.0.1:5555", "allowed_gids": [5]}})


# ---- ACL entries for the allowed ids (ecd.listeners) ------------------------------------------------

def _named(path) -> dict:
    from ecd.listeners import GROUP, USER, read_acl
    return {(("user" if tag == USER else "group"), ident): perm for (tag, ident), perm in read_acl(str(path)).items()
            if tag in (USER, GROUP)}


def test_grant_exact_replaces_the_named_entries_and_keeps_the_mode(tmp_path):
    import stat
    from ecd.listeners import grant
    f = tmp_path / "sock"
    f.write_text("")
    os.chmod(f, 0o660)
    grant(str(f), [4242, 5], [7777], 0o6, exact=True)
    assert _named(f) == {("user", 5): 6, ("user", 4242): 6, ("group", 7777): 6}
    assert stat.S_IMODE(os.stat(f).st_mode) == 0o660  # the mask (group bits) is rw, others nothing
    grant(str(f), [9], [], 0o6, exact=True)
    assert _named(f) == {("user", 9): 6}
    grant(str(f), [], [], 0o6, exact=True)  # none left: the mode bits alone again
    assert _named(f) == {} and stat.S_IMODE(os.stat(f).st_mode) == 0o660
    with pytest.raises(OSError):
        os.getxattr(f, "system.posix_acl_access")


def test_grant_on_a_directory_adds_search_and_keeps_an_administrators_entries(tmp_path):
    import stat
    from ecd.listeners import grant
    d = tmp_path / "run"
    d.mkdir()
    os.chmod(d, 0o1750)
    grant(str(d), [1000], [], 0o7, exact=True)  # an administrator's entry
    grant(str(d), [4242], [], 0o1, exact=False)
    assert _named(d) == {("user", 1000): 7, ("user", 4242): 1}
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o1770  # sticky kept; group bits show the mask (rwx)
