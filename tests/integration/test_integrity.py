"""End-to-end integrity against a real daemon: a producer process stores checksums, a consumer
verifies them, bytes corrupted in /dev/shm behind the daemon's back (by a third process) are
caught and counted, and a `verify = true` namespace forces checksums on everyone."""
from __future__ import annotations

import signal
import subprocess
import sys

import pytest
import torch

from conftest import OPEN_POOL, REPO, metric_by_label, pool_target, scrape_metrics, wait_for
from ecd import Client
from ecd.errors import IntegrityError, InvalidRequest
from ecd.integrity import checksum
from ecd.protocol import (Acquire, AllocItem, Alloc, Commit, Location, PutInline, Release)

VERIFY_NS = '[namespaces.safe]\nverify = true\n'

# The producer: its own process, puts through every path (inline, alloc + commit, the reserved
# extent + publish, a batch), with checksum=True unless told otherwise.
PRODUCER = """
import sys, torch
from ecd import Client
endpoint, ns, flag = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
def tensor(seed, n):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))
with Client(endpoint, namespace=ns) as c:
    c.put("small", tensor(1, 100), checksum=flag)                # inline
    c.put("big-1", tensor(2, 300_000), checksum=flag)            # alloc + commit (reserves)
    c.put("big-2", tensor(3, 300_000), checksum=flag)            # reserved extent + publish
    c.put_many({"m-1": tensor(4, 300_000), "m-2": tensor(5, 1000)}, checksum=flag)
    c.put("strided", tensor(6, 200_000).reshape(400, 500).t(), checksum=flag)
print("ok", flush=True)
"""
KEYS = {"small": (1, 100), "big-1": (2, 300_000), "big-2": (3, 300_000), "m-1": (4, 300_000),
        "m-2": (5, 1000)}

# The vandal: a third process that writes into the pool at an entry's offset (through its /dev/shm
# file or a descriptor from the fd socket).
VANDAL = OPEN_POOL + """
import os, sys
path, offset = sys.argv[1], int(sys.argv[2])
fd = open_pool(path)
old = os.pread(fd, 4, offset)
os.pwrite(fd, bytes(b ^ 0xFF for b in old), offset)
os.close(fd)
"""


def tensor(seed: int, n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def run_producer(endpoint: str, ns: str = "default", checksum_flag: bool = True) -> None:
    out = subprocess.run([sys.executable, "-c", PRODUCER, endpoint, ns, "1" if checksum_flag else "0"],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def location(c: Client, key: str) -> Location:
    """Where the daemon keeps `key`, and the checksum it stored (lease taken and given back)."""
    (loc,) = c.request(Acquire(0, c.namespace, [key], 0.0)).results
    assert isinstance(loc, Location), loc
    c.request(Release(0, [loc.generation]))
    return loc


def corrupt(c: Client, key: str) -> Location:
    loc = location(c, key)
    subprocess.run([sys.executable, "-c", VANDAL, pool_target(c, loc.pool), str(loc.offset)], check=True,
                   timeout=60, cwd=REPO)
    return loc


def integrity_metric(daemon) -> dict[str, float]:
    return metric_by_label(scrape_metrics(daemon.metrics_port), "ecd_integrity_failures_total", "where")


def test_producer_checksums_and_consumer_verifies(daemon):
    run_producer(daemon.endpoint)
    with daemon.client() as c:
        for key, (seed, n) in KEYS.items():
            loc = location(c, key)
            assert loc.checksum == checksum(tensor(seed, n).numpy().tobytes()), key
            assert torch.equal(c.get(key, verify=True), tensor(seed, n))
            with c.view(key, verify=True) as v:
                assert torch.equal(v, tensor(seed, n))
        got = c.get_many(list(KEYS) + ["absent"], verify=True, missing_ok=True)
        assert got[-1] is None
        for t, (seed, n) in zip(got, KEYS.values()):
            assert torch.equal(t, tensor(seed, n))
        strided = c.get("strided", verify=True)
        assert torch.equal(strided, tensor(6, 200_000).reshape(400, 500).t())
        stats = c.stats()
        assert stats["integrity_failures"] == 0
    assert integrity_metric(daemon) == {"inline_put": 0.0, "read": 0.0}


def test_entries_without_checksum_are_read_unverified(daemon):
    run_producer(daemon.endpoint, checksum_flag=False)
    with daemon.client() as c:
        assert location(c, "big-1").checksum == 0
        assert torch.equal(c.get("big-1", verify=True), tensor(2, 300_000))


@pytest.mark.parametrize("key", ["big-1", "big-2", "small"])
def test_bytes_corrupted_in_shm_are_caught_and_counted(daemon, key):
    run_producer(daemon.endpoint)
    seed, n = KEYS[key]
    with daemon.client() as c:
        loc = corrupt(c, key)
        with pytest.raises(IntegrityError) as caught:
            c.get(key, verify=True)
        err = caught.value
        assert err.key == key and err.expected == loc.checksum and err.actual != loc.checksum
        assert repr(key) in str(err) and f"{loc.checksum:#018x}" in str(err)
        assert f"{err.actual:#018x}" in str(err)
        with pytest.raises(IntegrityError):
            with c.view(key, verify=True):
                raise AssertionError("a view of corrupt bytes must not be handed out")
        with pytest.raises(IntegrityError):
            c.get_many(["m-2", key], verify=True)
        # unverified reads do not look: they return the damaged bytes
        assert not torch.equal(c.get(key), tensor(seed, n))
        # the failures were reported, and no lease was left behind by the raising reads
        assert wait_for(lambda: c.stats()["integrity_failures"] == 3)
        assert wait_for(lambda: c.stats()["read_leases"] == 0)
        assert torch.equal(c.get("m-2", verify=True), tensor(5, 1000))  # others are fine
    assert integrity_metric(daemon)["read"] == 3.0


def test_inline_put_whose_data_does_not_match_its_checksum_is_refused(daemon):
    with daemon.client() as c:
        data = b"\x01" * 16
        reply = c.request(PutInline(0, "default", "k", "uint8", [16], data, checksum(data) ^ 1))
        assert reply.results[0].code == IntegrityError.code
        assert "'k'" in reply.results[0].message
        assert not c.exists("k")
    assert integrity_metric(daemon)["inline_put"] == 1.0


def test_verify_namespace_forces_checksums(daemon_factory):
    d = daemon_factory(extra=VERIFY_NS)
    run_producer(d.endpoint, "safe", checksum_flag=False)  # no checksum=True: stored anyway
    with d.client(namespace="safe") as c:
        assert c.verify_namespaces == {"safe"}
        for key, (seed, n) in KEYS.items():
            assert location(c, key).checksum == checksum(tensor(seed, n).numpy().tobytes()), key
        # reads verify without being asked
        corrupt(c, "big-1")
        with pytest.raises(IntegrityError):
            c.get("big-1")
        with pytest.raises(IntegrityError):
            with c.view("big-1"):
                pass
        assert torch.equal(c.get("big-2"), tensor(3, 300_000))

        # a producer that does not send a checksum is refused, with the reason
        (ext,) = c.request(Alloc(0, "safe", [AllocItem("raw", "uint8", [100_000], 100_000)])).results
        (failure,) = c.request(Commit(0, [ext.generation])).results
        assert failure.code == InvalidRequest.code
        assert "'safe'" in failure.message and "verify = true" in failure.message
        (failure,) = c.request(PutInline(0, "safe", "raw", "uint8", [4], b"abcd")).results
        assert failure.code == InvalidRequest.code and "checksum" in failure.message
        assert not c.exists("raw")
        stats = c.stats()
        assert stats["entries_writing"] == 0  # the refused write was freed, not left to its TTL
    # other namespaces of the same daemon need none
    with d.client(namespace="default") as c:
        assert c.verify_namespaces == {"safe"}
        c.put("plain", torch.ones(100_000))
        assert location(c, "plain").checksum == 0


def test_sighup_cannot_flip_a_namespace_verify_flag(daemon_factory):
    """Connected clients learned the verify namespaces in their Welcome: flipping the flag under
    them would refuse their puts (turned on) or leave entries unverified (turned off)."""
    d = daemon_factory(extra=VERIFY_NS + '[namespaces.plain]\nquota = "8MiB"\n')
    text = d.config.read_text()
    d.config.write_text(text.replace("verify = true", "verify = false")
                        .replace('quota = "8MiB"', 'quota = "8MiB"\nverify = true'))
    d.proc.send_signal(signal.SIGHUP)
    assert wait_for(lambda: "cannot change namespaces.safe.verify" in d.log())
    assert "cannot change namespaces.plain.verify" in d.log()
    with d.client(namespace="safe") as c:
        assert c.verify_namespaces == {"safe"}
        (ext,) = c.request(Alloc(0, "safe", [AllocItem("raw", "uint8", [100_000], 100_000)])).results
        (failure,) = c.request(Commit(0, [ext.generation])).results
        assert failure.code == InvalidRequest.code  # still a verify namespace
    with d.client(namespace="plain") as c:
        c.put("unchecked", torch.ones(100_000))  # still not one
        assert location(c, "unchecked").checksum == 0
    assert d.alive()
