"""The disk tier ([pool.disk]) with real daemon processes: spill + promote, persist across SIGKILL
and SIGTERM restarts, corrupt and truncated records, unusable paths, ENOSPC and a read-only
remount (size-limited tmpfs mounts, where this runs as root), and clients served during a spill.
A restart onto a full or read-only filesystem: test_disk_full_start.py."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

import pytest
import torch

from conftest import DaemonProcess, metric, scrape_metrics, shm_files, wait_for, write_config
from ecd import InvalidRequest, KeyNotFound, PersistFailed

MIB = 1 << 20


def tensor(seed: int, nbytes: int = 4 * MIB) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def disk_config(path: str, size: str = "1GiB", extra: str = "") -> str:
    """The disk tier, and restarts that start the host pool cold ([restart] adopt = false): what
    a restart keeps here is the disk tier's doing alone (tests/integration/test_restart*.py test
    the pool's adoption, and test_restart_disk below the two together)."""
    return f'[restart]\nadopt = false\n[pool.disk]\npath = "{path}"\nsize = "{size}"\n{extra}'


@pytest.fixture
def disk_dir():
    path = tempfile.mkdtemp(prefix="ecd-disk-", dir="/tmp")  # /tmp: a real disk (O_DIRECT)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def disk_daemon(disk_dir):
    d = DaemonProcess("64MiB", extra=disk_config(disk_dir))
    d.start()
    yield d
    d.cleanup()


@contextlib.contextmanager
def tmpfs(size: str):
    """A size-limited tmpfs (root only: skipped elsewhere)."""
    path = tempfile.mkdtemp(prefix="ecd-tmpfs-", dir="/tmp")
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], capture_output=True)
    if result.returncode != 0:
        os.rmdir(path)
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], check=False)
        os.rmdir(path)


def records(path: str) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.endswith(".ecd"))


def test_forty_4mib_entries_through_a_64mib_pool_all_come_back(disk_daemon, disk_dir):
    with disk_daemon.client() as c:
        for i in range(40):
            c.put(f"k{i}", tensor(i))
        assert all(c.exists([f"k{i}" for i in range(40)]))  # spilled ones are present
        stats = c.stats()["disk"]
        assert stats["spills"] + stats["writes_in_flight"] >= 40 - 16 and stats["dropped"] == {}
        for i in range(40):
            assert torch.equal(c.get(f"k{i}"), tensor(i)), f"k{i}"
        got = c.get_many([f"k{i}" for i in range(8)])  # several spilled keys in one request
        assert all(torch.equal(t, tensor(i)) for i, t in enumerate(got))
        with c.view("k20") as v:
            assert torch.equal(v, tensor(20))
        assert c.stats()["disk"]["promotions"] >= 24
        assert c.stats()["disk"]["integrity_failures"] == 0
        body = scrape_metrics(disk_daemon.metrics_port)
        assert metric(body, "ecd_disk_spills_total") >= 24
        assert metric(body, "ecd_disk_promotions_total") >= 24


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_persisted_entries_survive_a_restart_bit_identical(disk_daemon, disk_dir, sig):
    with disk_daemon.client() as c:
        c.put("persisted", tensor(1), persist=True)
        c.put_many({f"many{i}": tensor(10 + i, 1 * MIB) for i in range(3)}, persist=True)
        c.put("small", tensor(2, 1000), persist=True)  # rides inline
        c.put("memory-only", tensor(3, 1 * MIB))
    assert disk_daemon.stop(sig) in (0, -signal.SIGKILL)
    disk_daemon.start()
    with disk_daemon.client() as c:
        assert torch.equal(c.get("persisted"), tensor(1))
        for i in range(3):
            assert torch.equal(c.get(f"many{i}"), tensor(10 + i, 1 * MIB))
        assert torch.equal(c.get("small"), tensor(2, 1000))
        with pytest.raises(KeyNotFound):
            c.get("memory-only")
        disk = c.stats()["disk"]
        assert disk["loaded"] == 5 and disk["persisted_entries"] == 5


def test_a_kill_during_spills_leaves_only_whole_records(disk_daemon, disk_dir):
    with disk_daemon.client() as c:
        for i in range(30):
            c.put(f"k{i}", tensor(i))
    disk_daemon.stop(signal.SIGKILL)  # writes may be in flight: their .tmp files must not count
    disk_daemon.start()
    assert not [n for n in os.listdir(disk_dir) if n.endswith(".tmp")]
    with disk_daemon.client() as c:
        back = 0
        for i in range(30):
            try:
                assert torch.equal(c.get(f"k{i}"), tensor(i)), f"k{i}"
                back += 1
            except KeyNotFound:
                pass
        assert back == c.stats()["disk"]["loaded"] > 0
        assert c.stats()["disk"]["integrity_failures"] == 0


def test_a_flipped_byte_on_disk_is_never_served(disk_daemon, disk_dir):
    with disk_daemon.client() as c:
        c.put("victim", tensor(5), persist=True)
    disk_daemon.stop(signal.SIGTERM)
    (name,) = records(disk_dir)
    with open(os.path.join(disk_dir, name), "r+b") as f:
        f.seek(4096 + 12345)
        byte = f.read(1)
        f.seek(4096 + 12345)
        f.write(bytes([byte[0] ^ 0x40]))
    disk_daemon.start()
    with disk_daemon.client() as c:
        assert c.exists("victim")  # the header is fine: its bytes are checked when read
        with pytest.raises(KeyNotFound):
            c.get("victim", verify=False)  # whatever the client's verify: never served
        assert not c.exists("victim")
        assert c.stats()["disk"]["integrity_failures"] == 1
        body = scrape_metrics(disk_daemon.metrics_port)
        assert metric(body, "ecd_integrity_failures_total", where="disk") == 1
    # the file goes on a disk thread after the miss is answered
    assert wait_for(lambda: records(disk_dir) == [], timeout=10), records(disk_dir)
    assert disk_daemon.log().count("failed its check and is removed") == 1


def test_a_truncated_or_deleted_file_is_a_clean_miss(disk_daemon, disk_dir):
    with disk_daemon.client() as c:
        c.put("cut", tensor(6), persist=True)
        c.put("gone", tensor(7), persist=True)
        for i in range(20):  # push both out of the pool (they stay on disk)
            c.put(f"fill{i}", tensor(100 + i))
        by_size = {}
        for name in records(disk_dir):
            by_size[name] = os.path.getsize(os.path.join(disk_dir, name))
        names = [n for n in records(disk_dir)]
        cut = os.path.join(disk_dir, names[0])
        with open(cut, "r+b") as f:
            f.truncate(by_size[names[0]] // 2)
        os.unlink(os.path.join(disk_dir, names[1]))
        # whichever files those were, a read of any record is its bytes or a clean miss
        for key, seed in [("cut", 6), ("gone", 7)] + [(f"fill{i}", 100 + i) for i in range(20)]:
            try:
                assert torch.equal(c.get(key), tensor(seed)), key
            except KeyNotFound:
                pass
        disk = c.stats()["disk"]
        assert disk["integrity_failures"] + disk["errors"].get("missing", 0) == 2
        c.put("after", tensor(8))
        assert torch.equal(c.get("after"), tensor(8))


def test_persist_without_a_disk_tier_is_a_clear_error(daemon):
    with daemon.client() as c:
        with pytest.raises(InvalidRequest, match="no disk tier"):
            c.put("x", tensor(1, 1 * MIB), persist=True)
        assert not c.exists("x")


@pytest.mark.parametrize("how", ["missing", "file", "immutable"])
def test_an_unusable_path_is_a_one_line_start_error(tmp_path, how):
    """Config errors a restart will not fix. (A full or read-only filesystem is not one: the tier
    starts degraded, test_disk_full_start.py.)"""
    node = f"dsk{os.getpid()}{how}"
    if how == "missing":
        path = str(tmp_path / "nope")
    elif how == "file":
        path = str(tmp_path / "afile")
        open(path, "w").close()
    with contextlib.ExitStack() as stack:
        if how == "immutable":  # EPERM on create even for root: what a directory the daemon's user may not write gives
            path = str(tmp_path / "immutable")
            os.mkdir(path)
            if subprocess.run(["chattr", "+i", path], capture_output=True).returncode != 0:
                pytest.skip("chattr +i is not permitted here")
            stack.callback(subprocess.run, ["chattr", "-i", path], check=False)
        config = write_config(str(tmp_path), node, extra=disk_config(path, "16MiB"))
        result = subprocess.run([sys.executable, "-m", "ecd", "serve", "--config", str(config)],
                                capture_output=True, text=True, timeout=30)
        assert result.returncode == 2
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "pool.disk" in lines[0] and path in lines[0], result.stderr
        assert shm_files(node) == []  # nothing left behind
        if os.path.isdir(path):
            assert os.listdir(path) == []


def test_a_budget_larger_than_the_filesystem_is_refused(tmp_path):
    with tmpfs("8m") as path:
        config = write_config(str(tmp_path), f"dsmall{os.getpid()}", extra=disk_config(path, "64MiB"))
        result = subprocess.run([sys.executable, "-m", "ecd", "serve", "--config", str(config)],
                                capture_output=True, text=True, timeout=30)
        assert result.returncode == 2 and "pool.disk.size" in result.stderr and path in result.stderr


def test_disk_full_and_read_only_remount_are_survived():
    with tmpfs("40m") as path:
        d = DaemonProcess("32MiB", extra=disk_config(path, "32MiB"))
        try:
            d.start()
            with d.client() as c:
                c.put("durable", tensor(1), persist=True)
                with open(os.path.join(path, "filler"), "wb") as f:  # the filesystem fills behind ecd's back
                    f.write(b"\0" * (34 * MIB))
                with pytest.raises(PersistFailed, match="not persisted"):
                    c.put("too-much", tensor(2), persist=True)
                assert torch.equal(c.get("too-much"), tensor(2))  # still stored in memory
                for i in range(16):  # evictions whose spills hit ENOSPC: dropped, counted
                    c.put(f"k{i}", tensor(10 + i))
                assert torch.equal(c.get("k15"), tensor(25))
                disk = wait_for(lambda: (s := c.stats()["disk"])["writes_in_flight"] == 0 and s)
                assert disk["errors"].get("enospc", 0) >= 1, disk
                os.unlink(os.path.join(path, "filler"))
                subprocess.run(["mount", "-o", "remount,ro", path], check=True)
                with pytest.raises(PersistFailed, match="not persisted"):
                    c.put("ro", tensor(3), persist=True)
                for i in range(16, 24):
                    c.put(f"k{i}", tensor(10 + i))
                assert torch.equal(c.get("durable"), tensor(1))  # reads of a read-only tier still work
                disk = wait_for(lambda: (s := c.stats()["disk"])["writes_in_flight"] == 0 and s)
                assert disk["errors"].get("readonly", 0) >= 1, disk
                # degraded, for as long as the filesystem refuses even the probe's 4 KiB (here: until
                # the end; the ENOSPC before left room for that, so it need not have said so then)
                assert wait_for(lambda: c.stats()["disk"]["degraded"].startswith("readonly")), c.stats()["disk"]
                assert torch.equal(c.get("k23"), tensor(33))
        finally:
            d.cleanup()


def test_other_clients_are_served_during_a_1gib_spill(disk_daemon, disk_dir):
    done = threading.Event()
    served: list[int] = []
    failures: list[BaseException] = []

    def neighbour() -> None:
        try:
            with disk_daemon.client() as c:
                i = 0
                while not done.is_set():
                    t = tensor(1000 + i % 7, 64 << 10)
                    c.put(f"small{i % 7}", t)
                    assert torch.equal(c.get(f"small{i % 7}"), t)
                    served.append(i)
                    i += 1
        except BaseException as exc:  # reported by the main thread
            failures.append(exc)

    thread = threading.Thread(target=neighbour)
    with disk_daemon.client() as c:
        c.put("warm", tensor(0, 1 * MIB))
        thread.start()
        wait_for(lambda: served, timeout=30)
        before = len(served)
        for i in range(64):  # 1 GiB through a 64 MiB pool: ~960 MiB spilled
            c.put(f"big{i}", tensor(i, 16 * MIB))
        during = len(served) - before
        done.set()
        thread.join(30)
        assert not failures, failures
        assert during > 0, "the neighbour was not served while the spill ran"
        for i in (0, 31, 63):
            assert torch.equal(c.get(f"big{i}"), tensor(i, 16 * MIB))


def test_status_shows_the_disk_tier(disk_daemon, disk_dir):
    with disk_daemon.client() as c:
        c.put("p", tensor(1, 1 * MIB), persist=True)
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    run = [sys.executable, "-m", "ecd", "status", "--config", str(disk_daemon.config), "--interval", "0"]
    result = subprocess.run(run, capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("disk tier")]
    assert len(lines) == 1 and disk_dir in lines[0] and "1 records (1 persisted)" in lines[0], result.stdout
    as_json = subprocess.run(run + ["--json"], capture_output=True, text=True, timeout=60, env=env)
    import json
    disk = json.loads(as_json.stdout)["disk"]
    assert disk["path"] == disk_dir and disk["entries"] == 1 and disk["persisted_entries"] == 1
    assert disk["capacity_bytes"] == 1 << 30 and disk["used_bytes"] == 4096 + 1 * MIB


def test_a_delete_or_replacement_is_not_undone_by_a_crash(disk_daemon, disk_dir):
    with disk_daemon.client() as c:
        c.put("deleted", tensor(1, 1 * MIB), persist=True)
        c.put("replaced", tensor(2, 1 * MIB), persist=True)
        c.delete("deleted")
        c.put("replaced", tensor(3, 1 * MIB))  # a new value, in memory only
    disk_daemon.stop(signal.SIGKILL)
    disk_daemon.start()
    with disk_daemon.client() as c:
        with pytest.raises(KeyNotFound):
            c.get("deleted")
        with pytest.raises(KeyNotFound):  # never the old bytes of a replaced key
            c.get("replaced")
    assert records(disk_dir) == []


def test_keys_lists_disk_records_marked_as_such(disk_daemon, disk_dir):
    with disk_daemon.client() as c:
        c.put("persisted", tensor(0, 1 * MIB), persist=True)  # in memory and on disk
        for i in range(20):
            c.put(f"k{i}", tensor(i))  # 80 MiB through a 64 MiB pool: the first ones spill
        wait_for(lambda: c.stats()["disk"]["writes_in_flight"] == 0 and c.stats()["disk"]["spills"] > 0)
        total, rows = c.keys(limit=1000)
        by_key = {r["key"]: r for r in rows}
        assert total == 21 and len(rows) == 21
        spilled = [k for k, r in by_key.items() if r["tier"] == "disk"]
        assert spilled and all(c.exists(k) for k in spilled)
        assert all(by_key[k]["generation"] == 0 and by_key[k]["nbytes"] == (4 if k != "persisted" else 1) * MIB
                   for k in spilled)
        assert by_key["k19"]["tier"] == "memory"
        assert by_key["persisted"]["tier"] in ("memory+disk", "disk")  # evicted or not, its record stays
    run = [sys.executable, "-m", "ecd", "keys", "--config", str(disk_daemon.config)]
    result = subprocess.run(run, capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert result.returncode == 0, result.stderr
    assert "showing 21 of 21" in result.stdout and "tier" in result.stdout
    rows = {line.split("│")[1].strip(): line for line in result.stdout.splitlines() if line.count("│") > 2}
    assert all(rows[k].rstrip().endswith("disk") for k in spilled), result.stdout
