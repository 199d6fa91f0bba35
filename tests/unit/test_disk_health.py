"""The disk tier's degraded state (ecd/daemon/tiers/disk_health.py) driven through a Store + DiskTier on
a real event loop: a write refused for room degrades the tier, a write that fits meanwhile does not
clear it (a filesystem on the edge of full would flip it per request), the probe does, by itself.
The restart onto a full or read-only filesystem is tests/integration/test_disk_full_start.py."""
from __future__ import annotations

import asyncio
import errno

from ecd.errors import Code
from ecd.memory import disk as files
from ecd.protocol import Failure
from test_store_disk import KIB, DiskEnv, payload, run, tier_dir  # noqa: F401 (tier_dir: a fixture)


def test_a_write_refused_for_room_degrades_the_tier_until_a_probe_write_succeeds(tier_dir, monkeypatch):  # noqa: F811
    import ecd.daemon.tiers.disk_health as health_mod
    monkeypatch.setattr(health_mod, "PROBE_INTERVAL_S", 0.02)
    full = False  # the start-up probe succeeds
    real_write, real_probe = files.write_record, files.probe_direct_io
    probes = 0

    def write_record(directory, dirfd, header, *args, **kwargs):
        if full and header.nbytes > 16 * KIB:  # room for small records only
            raise files.DiskIOError("enospc", f"cannot write {header.key}: No space left on device")
        return real_write(directory, dirfd, header, *args, **kwargs)

    def probe(path):
        nonlocal probes
        probes += 1
        if full:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_probe(path)
    monkeypatch.setattr(files, "write_record", write_record)
    monkeypatch.setattr(files, "probe_direct_io", probe)

    async def main():
        nonlocal full
        env = DiskEnv(tier_dir, asyncio.get_running_loop())
        health = env.disk.health
        assert not health.degraded and env.disk.stats().degraded == ""
        full = True  # another program fills the filesystem
        big = env.store.by_generation[env.put_bytes("big")]
        (failure,) = await env.disk.persist([big])
        assert isinstance(failure, Failure) and failure.code == Code.NOT_DURABLE, failure
        assert health.reason.startswith("enospc") and env.disk.stats().degraded == health.reason
        small = env.store.by_generation[env.put_bytes("small", payload("small", 4 * KIB))]
        assert (await env.disk.persist([small])) == [None]  # fits: durable, but the tier stays degraded
        await asyncio.sleep(0.2)
        assert health.degraded and probes >= 2  # probed, still refused
        full = False
        for _ in range(500):
            if not health.degraded:
                break
            await asyncio.sleep(0.01)
        assert not health.degraded and health.episodes == 1 and env.disk.stats().degraded == ""
        assert (await env.disk.persist([big])) == [None]
        settled = probes
        await asyncio.sleep(0.1)
        assert probes == settled  # no probing while healthy
        env.check()
        env.disk.close()
    run(main())
