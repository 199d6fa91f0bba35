"""node.toml parsing: defaults, sizes, durations, one-line errors that name the key, round trip."""
from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from ecd.config import Config, dumps_toml, load_config, load_config_file
from ecd.config_types import ByteSize, Duration, parse_duration, parse_size
from ecd.errors import ConfigError, EcdError

REPO = Path(__file__).resolve().parents[2]


def config_error(data: dict) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(data)
    message = str(info.value)
    assert "\n" not in message, f"error must be one line: {message!r}"
    return message


# ---- defaults -----------------------------------------------------------------------------------

def test_defaults_load_from_empty_table():
    cfg = load_config({})
    assert cfg == Config()
    assert cfg.node.name == "dev"
    assert cfg.node.runtime_dir == "/tmp/ecd"
    assert cfg.node.log_level == "info"
    assert cfg.control.endpoint == "ipc:///tmp/ecd/ecd.sock"
    assert cfg.pool.host.size == 1 << 30
    assert cfg.pool.host.segment_size == 1 << 30
    assert cfg.pool.host.backing == "memfd"
    assert cfg.ring.slots == 65536
    assert cfg.ring.presence_buckets == 1 << 20
    assert cfg.leases.write_ttl == 60.0
    assert cfg.leases.max_pin == 600.0
    assert cfg.leases.max_wait == 300.0
    assert cfg.limits.max_key_bytes == 1024
    assert cfg.limits.max_batch == 16384
    assert cfg.limits.max_message_bytes == 64 << 20
    assert cfg.limits.inline_max_bytes == 64 << 10
    assert cfg.limits.max_ndim == 16
    assert cfg.metrics.listen == "127.0.0.1:9464"


def test_partial_section_keeps_other_defaults():
    cfg = load_config({"node": {"name": "gpu-node_7"}, "ring": {"slots": 128}})
    assert cfg.node.name == "gpu-node_7"
    assert cfg.node.runtime_dir == "/tmp/ecd"
    assert cfg.ring.slots == 128
    assert cfg.ring.presence_buckets == 1 << 20


# ---- sizes and durations ------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("1GiB", 1 << 30),
    ("512MiB", 512 << 20),
    ("64KiB", 64 << 10),
    ("1.5GB", 1_500_000_000),
    ("2mb", 2_000_000),
    ("4096", 4096),
    (" 12 kib ", 12 * 1024),
    ("3b", 3),
    (4096, 4096),
    (1 << 30, 1 << 30),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("30s", 30.0),
    ("250ms", 0.25),
    ("5m", 300.0),
    ("2min", 120.0),
    ("1h", 3600.0),
    ("500us", 0.0005),
    ("7", 7.0),
    (2.5, 2.5),
    (10, 10.0),
])
def test_parse_duration(text, expected):
    assert parse_duration(text) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("bad", ["lots", "12XB", "1..5GiB", "", "GiB", [1], None, 1.5, True, False])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


@pytest.mark.parametrize("bad", ["soon", "5 days", "1e3s", "", None, [1], True])
def test_parse_duration_rejects(bad):
    with pytest.raises(ValueError):
        parse_duration(bad)


def test_sizes_and_durations_in_config():
    cfg = load_config({
        "pool": {"host": {"size": "1.5GB", "segment_size": "512MiB"}},
        "leases": {"write_ttl": "250ms", "max_pin": "5m", "max_wait": 2},
        "limits": {"max_message_bytes": 1 << 20, "inline_max_bytes": "4KiB"},
    })
    assert cfg.pool.host.size == 1_500_000_256  # rounded up to whole 4 KiB pages
    assert isinstance(cfg.pool.host.size, ByteSize)
    assert cfg.pool.host.segment_size == 512 << 20
    assert cfg.leases.write_ttl == pytest.approx(0.25)
    assert isinstance(cfg.leases.write_ttl, Duration)
    assert cfg.leases.max_pin == 300.0
    assert cfg.leases.max_wait == 2.0
    assert cfg.limits.max_message_bytes == 1 << 20
    assert cfg.limits.inline_max_bytes == 4096


# ---- one-line errors naming the key -------------------------------------------------------------

@pytest.mark.parametrize("data, expected", [
    ({"foo": 1}, "foo: unknown key"),
    ({"node": {"foo": 1}}, "node.foo: unknown key"),
    ({"pool": {"host": {"foo": 1}}}, "pool.host.foo: unknown key"),
    ({"pool": {"gpu": {}}}, "pool.gpu: unknown key"),
])
def test_unknown_keys(data, expected):
    assert config_error(data) == expected


@pytest.mark.parametrize("data, key, fragment", [
    # negative / zero sizes
    ({"pool": {"host": {"size": -1}}}, "pool.host.size", "must be > 0, got -1"),
    ({"pool": {"host": {"size": "-1GiB"}}}, "pool.host.size", "must be > 0"),
    ({"pool": {"host": {"size": "0"}}}, "pool.host.size", "must be > 0, got 0"),
    ({"pool": {"host": {"size": "32TiB"}}}, "pool.host.size", "16TiB"),
    ({"pool": {"host": {"segment_size": "1KiB"}}}, "pool.host.segment_size", ">= 1MiB"),
    ({"pool": {"host": {"backing": "shm"}}}, "pool.host.backing", 'must be "memfd" or "named", got \'shm\''),
    # the neighbour limits (issue 11)
    ({"limits": {"max_clients": 0}}, "limits.max_clients", "must be > 0, got 0"),
    ({"limits": {"max_clients_per_pid": -3}}, "limits.max_clients_per_pid", "must be > 0"),
    ({"limits": {"max_connections": 0}}, "limits.max_connections", "must be > 0"),
    ({"limits": {"client_queue_bytes": "0"}}, "limits.client_queue_bytes", "must be > 0"),
    ({"limits": {"max_pins_per_client": 0}}, "limits.max_pins_per_client", "must be > 0"),
    ({"metrics": {"max_connections": 0}}, "metrics.max_connections", "between 1 and 65536"),
    ({"namespaces": {"a": {"quota": "1000"}}}, "namespaces.a.quota", "multiple of 256 bytes"),
    ({"namespaces": {"a": {"quota": "1MiB", "guaranteed": 100}}}, "namespaces.a.guaranteed", "multiple of 256"),
    # unparsable size / duration
    ({"pool": {"host": {"size": "lots"}}}, "pool.host.size", "'lots'"),
    ({"pool": {"host": {"size": "12XB"}}}, "pool.host.size", "'12XB'"),
    ({"limits": {"max_message_bytes": "big"}}, "limits.max_message_bytes", "'big'"),
    ({"leases": {"write_ttl": "soon"}}, "leases.write_ttl", "'soon'"),
    ({"leases": {"max_wait": "2d"}}, "leases.max_wait", "'2d'"),
    ({"leases": {"write_ttl": -1}}, "leases.write_ttl", "between 0 and 1 day"),
    ({"leases": {"max_pin": "0s"}}, "leases.max_pin", "between 0 and 1 day"),
    ({"leases": {"max_pin": "25h"}}, "leases.max_pin", "between 0 and 1 day"),
    # bool where a size / duration / int belongs
    ({"pool": {"host": {"size": True}}}, "pool.host.size", "True"),
    ({"leases": {"write_ttl": False}}, "leases.write_ttl", "False"),
    ({"ring": {"slots": True}}, "ring.slots", "bool"),
    # wrong types
    ({"node": {"name": 5}}, "node.name", "expected str, got int"),
    ({"ring": {"slots": "64"}}, "ring.slots", "expected int, got str"),
    ({"limits": {"max_batch": 1.5}}, "limits.max_batch", "expected int, got float"),
    ({"pool": {"host": {"size": [1]}}}, "pool.host.size", "[1]"),
    ({"pool": {"host": {"size": 1.5}}}, "pool.host.size", "1.5"),
    ({"node": "x"}, "node", "expected object, got str"),
    # bad node name / paths / level
    ({"node": {"name": "bad name"}}, "node.name", "'bad name'"),
    ({"node": {"name": ""}}, "node.name", "1-64 characters"),
    ({"node": {"name": "x" * 65}}, "node.name", "1-64 characters"),
    ({"node": {"name": "a/b"}}, "node.name", "'a/b'"),
    ({"node": {"runtime_dir": "relative/dir"}}, "node.runtime_dir", "absolute path"),
    ({"node": {"log_level": "loud"}}, "node.log_level", "'loud'"),
    # bad endpoint
    ({"control": {"endpoint": "http://x"}}, "control.endpoint", "ipc://PATH or tcp://HOST:PORT"),
    ({"control": {"endpoint": "tcp://host"}}, "control.endpoint", "'tcp://host'"),
    ({"control": {"endpoint": "ipc://"}}, "control.endpoint", "'ipc://'"),
    ({"metrics": {"listen": "nope"}}, "metrics.listen", "HOST:PORT"),
    ({"metrics": {"listen": "127.0.0.1:70000"}}, "metrics.listen", "HOST:PORT"),
    # ring geometry
    ({"ring": {"slots": 1000}}, "ring.slots", "power of two"),
    ({"ring": {"slots": 32}}, "ring.slots", "got 32"),
    ({"ring": {"slots": 1 << 27}}, "ring.slots", "power of two"),
    ({"ring": {"presence_buckets": 100}}, "ring.presence_buckets", "got 100"),
    # limits
    ({"limits": {"max_batch": 0}}, "limits.max_batch", "must be > 0, got 0"),
    ({"limits": {"max_key_bytes": -3}}, "limits.max_key_bytes", "must be > 0, got -3"),
    ({"limits": {"inline_max_bytes": "64MiB"}}, "limits.inline_max_bytes", "half of max_message_bytes"),
])
def test_bad_values_name_key_and_problem(data, key, fragment):
    message = config_error(data)
    assert message.startswith(f"{key}: "), message
    assert fragment in message, message


def test_config_error_is_an_ecd_error():
    with pytest.raises(EcdError):
        load_config({"node": {"name": "?"}})


def test_valid_edge_values_accepted():
    cfg = load_config({"ring": {"slots": 64, "presence_buckets": 1 << 26},
                       "control": {"endpoint": "tcp://10.0.0.1:5555"},
                       "node": {"name": "A" * 64, "log_level": "DEBUG"},
                       "leases": {"max_wait": "24h"}})
    assert cfg.ring.slots == 64
    assert cfg.ring.presence_buckets == 1 << 26
    assert cfg.control.endpoint == "tcp://10.0.0.1:5555"
    assert cfg.leases.max_wait == 86400.0


@pytest.mark.parametrize("host", [{"size": 1000}, {"size": "1.5MB", "segment_size": "1MiB"},
                                  {"size": "2MiB", "segment_size": "1.5MB"}])
def test_accepted_pool_sizes_can_back_an_allocator(host):
    from ecd.memory.allocator import ExtentAllocator
    try:
        cfg = load_config({"pool": {"host": host}})
    except ConfigError as exc:  # refusing the size up front is fine
        assert str(exc).startswith("pool.host.")
        return
    remaining, segment = int(cfg.pool.host.size), int(cfg.pool.host.segment_size)
    while remaining > 0:  # the split HostPool makes
        ExtentAllocator(min(remaining, segment))
        remaining -= min(remaining, segment)


# ---- files ------------------------------------------------------------------------------------

def test_load_config_file_missing(tmp_path):
    path = tmp_path / "nope.toml"
    with pytest.raises(ConfigError) as info:
        load_config_file(path)
    assert str(info.value) == f"{path}: file not found"


def test_load_config_file_invalid_toml(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text("[node\nname = 'x'\n")
    with pytest.raises(ConfigError) as info:
        load_config_file(path)
    message = str(info.value)
    assert message.startswith(f"{path}: not valid TOML: ")
    assert "line 1" in message


def test_load_config_file_directory(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config_file(tmp_path)
    assert str(info.value).startswith(f"{tmp_path}: cannot read: ")


def test_load_config_file_real_file(tmp_path):
    path = tmp_path / "node.toml"
    path.write_text(
        '[node]\nname = "n1"\nruntime_dir = "/run/ecd"\n\n'
        '[control]\nendpoint = "tcp://127.0.0.1:7000"\n\n'
        '[pool.host]\nsize = "2GiB"\nsegment_size = "256MiB"\n\n'
        '[ring]\nslots = 1024\npresence_buckets = 4096\n\n'
        '[leases]\nwrite_ttl = "30s"\nmax_pin = "250ms"\nmax_wait = 5\n'
    )
    cfg = load_config_file(str(path))
    assert cfg.node.name == "n1"
    assert cfg.node.runtime_dir == "/run/ecd"
    assert cfg.control.endpoint == "tcp://127.0.0.1:7000"
    assert cfg.pool.host.size == 2 << 30
    assert cfg.pool.host.segment_size == 256 << 20
    assert (cfg.ring.slots, cfg.ring.presence_buckets) == (1024, 4096)
    assert cfg.leases.write_ttl == 30.0
    assert cfg.leases.max_pin == pytest.approx(0.25)
    assert cfg.leases.max_wait == 5.0
    assert cfg.limits == Config().limits


def test_load_config_file_bad_value_prefixes_path(tmp_path):
    path = tmp_path / "node.toml"
    path.write_text("[pool.host]\nsize = -5\n")
    with pytest.raises(ConfigError) as info:
        load_config_file(path)
    assert str(info.value) == f"{path}: pool.host.size: must be > 0, got -5"


def test_load_config_file_not_utf8(tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes(b'[node]\nname = "caf\xe9"\n')
    with pytest.raises(ConfigError) as info:
        load_config_file(path)
    assert str(info.value).startswith(f"{path}: ")


# ---- dumps_toml round trip ----------------------------------------------------------------------

def roundtrip(cfg: Config) -> Config:
    return load_config(tomllib.loads(dumps_toml(cfg)))


def test_dumps_toml_defaults_roundtrip():
    text = dumps_toml(Config())
    data = tomllib.loads(text)
    assert data["pool"]["host"]["size"] == "1GiB"
    assert data["leases"]["write_ttl"] == "60s"
    assert load_config(data) == Config()


def test_dumps_toml_custom_roundtrip():
    cfg = load_config({
        "node": {"name": "n-2", "runtime_dir": "/var/run/ecd dir", "log_level": "debug"},
        "control": {"endpoint": "tcp://host:1234"},
        "pool": {"host": {"size": "1.5GB", "segment_size": "3MiB"}},
        "ring": {"slots": 256, "presence_buckets": 512},
        "leases": {"write_ttl": "250ms", "max_pin": "5m", "max_wait": 0.5},
        "limits": {"max_key_bytes": 77, "max_batch": 3, "max_message_bytes": 1000,
                   "inline_max_bytes": 500, "max_ndim": 4, "max_waiters_per_client": 9,
                   "max_leases_per_client": 11},
        "metrics": {"listen": "0.0.0.0:9000"},
    })
    back = roundtrip(cfg)
    assert back == cfg
    assert back.pool.host.size == 1_500_000_256  # rounded up to whole 4 KiB pages
    assert back.limits.max_message_bytes == 1000


@pytest.mark.parametrize("runtime_dir", ["/tmp/it's", '/tmp/a"b'])
def test_dumps_toml_quotes_in_strings(runtime_dir):
    cfg = load_config({"node": {"runtime_dir": runtime_dir}})
    assert roundtrip(cfg).node.runtime_dir == runtime_dir


@pytest.mark.parametrize("seconds", [1.234567, 3661.123, 0.1234567])
def test_dumps_toml_durations_are_exact(seconds):
    cfg = load_config({"leases": {"write_ttl": seconds}})
    assert roundtrip(cfg).leases.write_ttl == seconds


# ---- CLI ----------------------------------------------------------------------------------------

def run_check_config(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ecd", "check-config", str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("content", [
    "[pool.host]\nsize = -5\n",
    "[node]\nfoo = 1\n",
    "[ring]\nslots = 1000\n",
    "[node\n",
])
def test_check_config_bad_file_exits_2_with_one_line(tmp_path, content):
    path = tmp_path / "bad.toml"
    path.write_text(content)
    proc = run_check_config(path)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"ecd: config error: {path}: ")
    assert proc.stdout == ""


def test_check_config_missing_file(tmp_path):
    proc = run_check_config(tmp_path / "missing.toml")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [f"ecd: config error: {tmp_path / 'missing.toml'}: file not found"]


def test_check_config_not_utf8_exits_2(tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes(b'[node]\nname = "caf\xe9"\n')
    proc = run_check_config(path)
    assert "Traceback" not in proc.stderr
    assert proc.returncode == 2
    assert len(proc.stderr.splitlines()) == 1


def test_check_config_good_file_prints_effective_config(tmp_path):
    path = tmp_path / "node.toml"
    path.write_text('[pool.host]\nsize = "2GiB"\n[leases]\nwrite_ttl = 90\n')
    proc = run_check_config(path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    cfg = load_config(tomllib.loads(proc.stdout))
    assert cfg.pool.host.size == 2 << 30
    assert cfg.leases.write_ttl == 90.0
    assert cfg.ring == Config().ring


@pytest.mark.parametrize("disk, key, fragment", [
    ({"size": "1GiB"}, "pool.disk", "path"),
    ({"path": "/x"}, "pool.disk", "size"),
    ({"path": "rel/dir", "size": "1GiB"}, "pool.disk.path", "absolute"),
    ({"path": "/x", "size": "1MiB"}, "pool.disk.size", ">= 16MiB"),
    ({"path": "/x", "size": "1GiB", "direct_io": "yes"}, "pool.disk.direct_io", "auto"),
    ({"path": "/x", "size": "1GiB", "spill_buffer": "4KiB"}, "pool.disk.spill_buffer", ">= 1MiB"),
    ({"path": "/x", "size": "1GiB", "io_threads": 0}, "pool.disk.io_threads", "between 1 and 64"),
    ({"path": "/x", "size": "1GiB", "bogus": 1}, "pool.disk.bogus", "unknown key"),
])
def test_disk_tier_config_errors_name_the_key(disk, key, fragment):
    message = config_error({"pool": {"disk": disk}})
    assert message.startswith(key) and fragment in message, message


def test_disk_tier_config_defaults():
    disk = load_config({"pool": {"disk": {"path": "/var/lib/ecd", "size": "2GiB"}}}).pool.disk
    assert (disk.spill, disk.direct_io, int(disk.min_spill_size), int(disk.spill_buffer), disk.io_threads) == (
        True, "auto", 64 << 10, 256 << 20, 2)
    assert load_config({}).pool.disk is None
    assert load_config({"pool": {"disk": {"path": "/d", "size": "2GiB", "direct_io": False}}}).pool.disk.direct_io is False
