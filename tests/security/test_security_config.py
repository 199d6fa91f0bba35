"""The new config keys and the start-time access rules, without a daemon."""
from __future__ import annotations

import pytest

from ecd.config import check_control_policy, endpoint_is_loopback, load_config
from ecd.curve import load_allowed_keys, load_keyfile, load_public_key, write_keypair
from ecd.errors import ConfigError


def test_defaults():
    cfg = load_config({})
    assert cfg.node.group == ""
    assert (cfg.control.curve_secret_key, cfg.control.curve_allowed_keys, cfg.control.insecure) == ("", "", False)
    assert not cfg.control.curve
    assert cfg.leases.session_ttl == 30.0
    assert load_config({"leases": {"session_ttl": "250ms"}}).leases.session_ttl == 0.25


@pytest.mark.parametrize("data, key", [
    ({"control": {"curve_secret_key": "/k"}}, "control.curve_allowed_keys"),
    ({"control": {"curve_allowed_keys": "/d"}}, "control.curve_secret_key"),
    ({"leases": {"session_ttl": 0}}, "leases.session_ttl"),
    ({"control": {"insecure": "yes"}}, "control.insecure"),
])
def test_bad_values_name_the_key(data, key):
    with pytest.raises(ConfigError) as info:
        load_config(data)
    assert str(info.value).startswith(key), str(info.value)


@pytest.mark.parametrize("endpoint, loopback", [
    ("ipc:///tmp/x.sock", True), ("tcp://127.0.0.1:1", True), ("tcp://127.9.9.9:1", True),
    ("tcp://localhost:1", True), ("tcp://0.0.0.0:1", False), ("tcp://*:1", False),
    ("tcp://10.0.0.1:1", False), ("tcp://eth0:1", False), ("tcp://node7.example:1", False),
])
def test_loopback(endpoint, loopback):
    assert endpoint_is_loopback(endpoint) is loopback


def test_policy():
    check_control_policy(load_config({"control": {"endpoint": "tcp://127.0.0.1:5555"}}))
    check_control_policy(load_config({"control": {"endpoint": "tcp://0.0.0.0:5555", "insecure": True}}))
    check_control_policy(load_config({"control": {"endpoint": "tcp://0.0.0.0:5555", "curve_secret_key": "/k",
                                                  "curve_allowed_keys": "/d"}}))
    with pytest.raises(ConfigError, match=r"^control\.endpoint: tcp://0\.0\.0\.0:5555 is not a loopback"):
        check_control_policy(load_config({"control": {"endpoint": "tcp://0.0.0.0:5555"}}))


def test_key_files(tmp_path):
    public, secret = write_keypair(str(tmp_path), "a")
    pub, sec = load_keyfile(secret, need_secret=True)
    assert load_public_key(public) == pub == load_public_key(pub.decode())
    with pytest.raises(ValueError, match="holds no secret key"):
        load_keyfile(public, need_secret=True)
    with pytest.raises(ValueError, match="does not exist"):
        load_keyfile(str(tmp_path / "nope"), need_secret=False)
    with pytest.raises(ValueError, match="neither a key file nor a 40-character"):
        load_public_key("short-and-not-a-file")
    (tmp_path / "keys").mkdir()
    assert load_allowed_keys(str(tmp_path / "keys")) == frozenset()
    write_keypair(str(tmp_path / "keys"), "b")
    assert len(load_allowed_keys(str(tmp_path / "keys"))) == 1  # the .key only, not .key_secret
    with pytest.raises(FileExistsError):
        write_keypair(str(tmp_path), "a")
