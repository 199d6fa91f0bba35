"""Namespace quotas and guaranteed shares against a real daemon, with clients in two processes:
QuotaExceeded reaches the client, other namespaces are left alone, the metrics show it, and
SIGHUP changes a quota."""
from __future__ import annotations

import contextlib
import signal

import pytest
import torch

import ecd
from conftest import metric, scrape_metrics as scrape, wait_for

MiB = 1 << 20
NUMEL = MiB // 4  # float32 tensors of exactly 1 MiB (the actor's `put KEY SEED NUMEL`)

NAMESPACES = """
[namespaces.tenant-a]
quota = "4MiB"
[namespaces.tenant-b]
guaranteed = "4MiB"
"""






def tensor(seed: int) -> torch.Tensor:
    return torch.full((NUMEL,), float(seed), dtype=torch.float32)


def test_quota_and_guarantee_across_processes(daemon_factory, actors):
    d = daemon_factory(size="16MiB", extra=NAMESPACES)
    a_other = actors(d.endpoint, "tenant-a")  # a second process writing into tenant-a
    b = actors(d.endpoint, "tenant-b")
    with d.client(namespace="tenant-a") as a, d.client(namespace="default") as u:
        for i in range(4):
            a.put(f"a{i}", tensor(i))
        a.put("a4", tensor(4))  # over the quota: a's own least recently used entry goes
        assert a.exists([f"a{i}" for i in range(5)]) == [False, True, True, True, True]
        for i in range(8):
            assert b.ask(f"put b{i} {i} {NUMEL}") == "ok"
        with contextlib.ExitStack() as views:
            for i in range(1, 5):
                views.enter_context(a.view(f"a{i}"))  # every entry of tenant-a is now leased
            with pytest.raises(ecd.QuotaExceeded, match=r"namespace 'tenant-a' is at its quota of 4194304"):
                a.put("a5", tensor(5))
            reply = a_other.ask(f"put a6 6 {NUMEL}")
            assert reply.startswith("error QuotaExceeded") and "held" in reply
            # an unconfigured namespace evicts tenant-b only down to its guaranteed share
            for i in range(10):
                u.put(f"u{i}", tensor(100 + i))
            assert b.ask("exists b4 b5 b6 b7") == "ok True True True True"
            body = scrape(d.metrics_port)
            assert metric(body, "ecd_namespace_used_bytes", namespace="tenant-a") == 4 * MiB
            assert metric(body, "ecd_namespace_quota_bytes", namespace="tenant-a") == 4 * MiB
            # its 4 MiB share; b's puts took put leases of one put's size each (larger than the
            # 16 MiB pool's slab), all carved: nothing held for a next put
            assert metric(body, "ecd_namespace_used_bytes", namespace="tenant-b") == 4 * MiB
            assert metric(body, "ecd_namespace_guaranteed_bytes", namespace="tenant-b") == 4 * MiB
            assert metric(body, "ecd_namespace_quota_bytes", namespace="tenant-b") == 0
            assert metric(body, "ecd_namespace_quota_exceeded_total", namespace="tenant-a") == 2
            assert metric(body, "ecd_evictions_total", reason="quota") == 1
            refused = sum(metric(body, "ecd_requests_total", op=op, outcome="quota_exceeded")
                          for op in ("alloc", "publish", "lease_space") if f'op="{op}",outcome="quota_exceeded"' in body)
            assert refused == 2
            assert 'namespace="default"' not in body  # unconfigured: no series of its own
            with pytest.raises(ecd.QuotaExceeded):
                a.put("tiny", torch.zeros(16))  # inline puts are held to the quota too
            with pytest.raises(ecd.QuotaExceeded):
                a.put_many({"m0": tensor(8), "m1": tensor(9)})
            assert a.exists(["tiny", "m0", "m1"]) == [False, False, False]
        a.ping()  # the views' releases reach the daemon before anything after them
        a.put("a5", tensor(5))  # leases returned: a evicts its own again
        assert torch.equal(a.get("a5"), tensor(5))

        # SIGHUP lowers the quota: nothing is evicted at once, a's next put evicts its own
        text = d.config.read_text()
        d.config.write_text(text.replace('quota = "4MiB"', 'quota = "2MiB"'))
        d.proc.send_signal(signal.SIGHUP)
        assert wait_for(lambda: "applied namespaces.tenant-a.quota=2MiB" in d.log())
        body = scrape(d.metrics_port)
        assert metric(body, "ecd_namespace_quota_bytes", namespace="tenant-a") == 2 * MiB
        assert metric(body, "ecd_namespace_used_bytes", namespace="tenant-a") == 4 * MiB
        a.put("a7", tensor(7))
        assert metric(scrape(d.metrics_port), "ecd_namespace_used_bytes", namespace="tenant-a") == 2 * MiB
        assert a.exists(["a5", "a7"]) == [True, True]

        # an invalid table refuses the whole reload
        d.config.write_text(text.replace('quota = "4MiB"', 'quota = "1MiB"\nguaranteed = "2MiB"'))
        d.proc.send_signal(signal.SIGHUP)
        assert wait_for(lambda: "not reloading" in d.log())
        assert "namespaces.tenant-a.guaranteed" in d.log()
        assert metric(scrape(d.metrics_port), "ecd_namespace_quota_bytes", namespace="tenant-a") == 2 * MiB
    assert d.alive()
