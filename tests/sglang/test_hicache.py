"""ecd as SGLang's HiCache L3 storage: the backend SGLang's own StorageBackendFactory makes from the
user's extra_config, on real SGLang host KV pools (CPU) and a real daemon."""
from __future__ import annotations

import pytest
import torch
from sglang_env import (MHA_LAYOUTS, MLA_LAYOUTS, PAGE_SIZE, mla_host_pool, USER_CONFIG, fill, make_backend, mamba_host_pool, mha_host_pool,
                        pages, slots, storage_config)

from ecd.errors import InvalidRequest
from ecd.integrations.sglang import EcdHiCacheStorage
from ecd.integrations.sglang.settings import parse_settings


@pytest.mark.parametrize("layout", MHA_LAYOUTS)
def test_v1_round_trip_is_bit_exact_in_every_layout(daemon, layout):
    host = mha_host_pool(layout)
    backend = make_backend(daemon.endpoint, host)
    assert isinstance(backend, EcdHiCacheStorage)
    fill(host, seed=1)
    keys = [f"{layout}-p{i}" for i in range(6)]
    want = pages(host, 8, 6)
    assert backend.batch_set_v1(keys, slots(8, 6)) == [True] * 6
    assert backend.batch_exists(keys + ["absent"]) == 6
    before = pages(host, 128, 6)
    assert all(not torch.equal(a, b) for a, b in zip(want, before))
    around = pages(host, 124, 1) + pages(host, 152, 1)
    assert backend.batch_get_v1(keys, slots(128, 6)) == [True] * 6
    got = pages(host, 128, 6)
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(want, got))
    # the pages around the loaded ones are untouched
    assert all(torch.equal(a, b) for a, b in zip(around, pages(host, 124, 1) + pages(host, 152, 1)))
    assert backend.counters["stored_pages"] == 6 and backend.counters["loaded_pages"] == 6
    # a second store of the same pages is skipped (already present), still True
    assert backend.batch_set_v1(keys, slots(8, 6)) == [True] * 6
    assert backend.counters["skipped_pages"] == 6
    stats = backend.get_stats()
    assert stats.backup_pgs == [6] and stats.prefetch_pgs == [6] and len(stats.prefetch_bandwidth) == 1
    assert backend.get_stats().backup_pgs == []  # taken: each call reports what happened since the last
    backend.close()


def test_v1_and_generic_paths_read_each_others_pages(daemon):
    host = mha_host_pool("layer_first")
    backend = make_backend(daemon.endpoint, host)
    fill(host, seed=2)
    want = pages(host, 0, 3)
    assert backend.batch_set_v1(["a", "b", "c"], slots(0, 3)) == [True] * 3
    targets = [host.get_dummy_flat_data_page() for _ in range(3)]
    got = backend.batch_get(["a", "b", "c"], targets)
    assert all(g is t for g, t in zip(got, targets))
    assert all(torch.equal(w, g) for w, g in zip(want, got))
    # the generic path stores as SGLang's _generic_page_set does: flat data pages
    assert backend.batch_set(["d"], [host.get_data_page(3 * PAGE_SIZE, flat=True)])
    assert backend.batch_get_v1(["d"], slots(200, 1)) == [True]
    assert torch.equal(pages(host, 200, 1)[0], pages(host, 3 * PAGE_SIZE, 1)[0])
    backend.close()


def test_batch_exists_counts_the_leading_hits_only(daemon):
    host = mha_host_pool()
    backend = make_backend(daemon.endpoint, host)
    fill(host, seed=3)
    assert backend.batch_set_v1(["k0", "k1", "k3"], torch.cat([slots(0, 2), slots(40, 1)])) == [True] * 3
    assert backend.batch_exists(["k0", "k1", "k2", "k3"]) == 2
    assert backend.batch_exists(["k2", "k0"]) == 0
    assert backend.batch_exists([]) == 0
    assert backend.exists("k3") and not backend.exists("k2")
    backend.close()


def test_servers_that_differ_in_what_makes_pages_interchangeable_do_not_share(daemon):
    host = mha_host_pool()
    base = make_backend(daemon.endpoint, host)
    fill(host, seed=4)
    assert base.batch_set_v1(["x"], slots(0, 1)) == [True]
    same = make_backend(daemon.endpoint, mha_host_pool())
    assert same.namespace == base.namespace and same.batch_exists(["x"]) == 1
    others = [make_backend(daemon.endpoint, mha_host_pool(), model="test/other"),
              make_backend(daemon.endpoint, mha_host_pool(), tp_rank=1, tp_size=2),
              make_backend(daemon.endpoint, mha_host_pool(), pp_rank=1, pp_size=2),
              make_backend(daemon.endpoint, mha_host_pool("layer_first")),
              make_backend(daemon.endpoint, mha_host_pool(dtype=torch.float16)),
              make_backend(daemon.endpoint, mha_host_pool(page_size=8))]
    assert len({b.namespace for b in others} | {base.namespace}) == len(others) + 1
    assert all(b.batch_exists(["x"]) == 0 for b in others)
    for b in (base, same, *others):
        b.close()


@pytest.mark.parametrize("layout", MLA_LAYOUTS)
def test_mla_round_trip_is_bit_exact(daemon, layout):
    host = mla_host_pool(layout)
    backend = make_backend(daemon.endpoint, host, mla=True)
    fill(host, seed=12)
    want = pages(host, 0, 3)
    assert backend.batch_set_v1(["l0", "l1", "l2"], slots(0, 3)) == [True] * 3
    assert backend.batch_get_v1(["l0", "l1", "l2"], slots(96, 3)) == [True] * 3
    assert all(torch.equal(a, b) for a, b in zip(want, pages(host, 96, 3)))
    backend.close()


def test_mla_pages_are_shared_across_tp_ranks_and_only_the_writer_writes(daemon):
    rank0 = make_backend(daemon.endpoint, mla_host_pool(), mla=True, tp_rank=0, tp_size=2)
    rank1 = make_backend(daemon.endpoint, mla_host_pool(), mla=True, tp_rank=1, tp_size=2)
    tp1 = make_backend(daemon.endpoint, mla_host_pool(), mla=True, tp_rank=0, tp_size=1)
    mha1 = make_backend(daemon.endpoint, mha_host_pool(), mla=False, tp_rank=1, tp_size=2)
    assert rank0.namespace == rank1.namespace == tp1.namespace != mha1.namespace
    assert not rank1.storage_config.is_storage_writer
    fill(rank1.mem_pool_host, seed=5)
    assert rank1.batch_set_v1(["m"], slots(0, 1)) == [True]  # not the writer: nothing stored
    assert rank0.batch_exists(["m"]) == 0
    fill(rank0.mem_pool_host, seed=6)
    assert rank0.batch_set_v1(["m"], slots(0, 1)) == [True]
    assert rank1.batch_get_v1(["m"], slots(64, 1)) == [True]
    assert torch.equal(pages(rank1.mem_pool_host, 64, 1)[0], pages(rank0.mem_pool_host, 0, 1)[0])
    for b in (rank0, rank1, tp1, mha1):
        b.close()


def test_v2_kv_and_a_mamba_sidecar_pool(daemon):
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
    host = mha_host_pool()
    mamba = mamba_host_pool()
    backend = make_backend(daemon.endpoint, host)
    backend.register_mem_host_pool_v2(host, PoolName.KV)
    backend.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    fill(host, seed=7)
    g = torch.Generator().manual_seed(8)
    for i in range(mamba.size):
        mamba.set_from_flat_data_page(i, torch.randint(0, 256, (mamba.get_dummy_flat_data_page().numel(),),
                                                       generator=g, dtype=torch.uint8))
    keys = [f"v2-{i}" for i in range(4)]
    result = backend.batch_set_v2([PoolTransfer(PoolName.KV, host_indices=slots(0, 4), keys=keys),
                                   PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([2, 3]), keys=keys[2:])])
    assert result == {PoolName.KV: [True] * 4, PoolName.MAMBA: [True, True]}
    trailing = PoolTransfer(PoolName.MAMBA, keys=keys[2:], hit_policy=PoolHitPolicy.TRAILING_PAGES)
    hit = backend.batch_exists_v2(keys, [trailing])
    assert hit.kv_hit_pages == 4 and hit.extra_pool_hit_pages == {PoolName.KV: 4, PoolName.MAMBA: 4}
    assert hit.restorable_prefix_pages == [4]
    all_pages = PoolTransfer(PoolName.MAMBA, keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES)
    assert backend.batch_exists_v2(keys, [all_pages]).kv_hit_pages == 0
    # load both pools into other slots: bit-exact
    want_kv, want_m = pages(host, 0, 4), [mamba.get_data_page(i, flat=True).clone() for i in (2, 3)]
    got = backend.batch_get_v2([PoolTransfer(PoolName.KV, host_indices=slots(100, 4), keys=keys),
                                PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([6, 7]), keys=keys[2:])])
    assert got == {PoolName.KV: [True] * 4, PoolName.MAMBA: [True, True]}
    assert all(torch.equal(a, b) for a, b in zip(want_kv, pages(host, 100, 4)))
    assert all(torch.equal(a, mamba.get_data_page(i, flat=True)) for a, i in zip(want_m, (6, 7)))
    # a v1 load reads the KV pages v2 stored
    assert backend.batch_get_v1(keys[:1], slots(160, 1)) == [True]
    # a sidecar key never answers for the KV key of the same page, nor the other way round
    assert backend.batch_exists_v2(["v2-x"], [trailing]).kv_hit_pages == 0
    # a transfer whose indices do not match its keys is refused, nothing written
    assert backend.batch_set_v2([PoolTransfer(PoolName.KV, host_indices=slots(0, 1), keys=["z1", "z2"])]) == \
        {PoolName.KV: [False, False]}
    backend.close()


def test_clear_removes_this_namespace_only(daemon):
    a = make_backend(daemon.endpoint, mha_host_pool())
    b = make_backend(daemon.endpoint, mha_host_pool(), model="test/other")
    fill(a.mem_pool_host, seed=9)
    fill(b.mem_pool_host, seed=9)
    assert a.batch_set_v1(["c0", "c1"], slots(0, 2)) == [True, True]
    assert b.batch_set_v1(["c0"], slots(0, 1)) == [True]
    assert a.clear() is True
    assert a.batch_exists(["c0", "c1"]) == 0 and b.batch_exists(["c0"]) == 1
    a.close()
    b.close()


@pytest.mark.parametrize("extra, named", [
    ({"endpoint": "ipc:///tmp/x.sock", "colour": "red"}, "colour: unknown key (known: endpoint, namespace"),
    ({"pin_seconds": "long"}, "pin_seconds"),
    ({"pin_seconds": -1}, "pin_seconds"),
    ({"timeout_s": 0}, "load_timeout_s"),
    ({"load_timeout_s": 0}, "load_timeout_s"),
    ({"load_timeout_s": 1, "timeout_s": 1}, "name the same setting"),
    ({"endpoint": "run/ecd.sock"}, "endpoint 'run/ecd.sock': expected ipc://"),
    ({"verify": "yes"}, "verify"),
])
def test_bad_extra_config_is_refused_naming_the_key(extra, named):
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    with pytest.raises(InvalidRequest, match="hicache-storage-backend-extra-config") as caught:
        StorageBackendFactory.create_backend("dynamic", storage_config({**USER_CONFIG, **extra}), None)
    assert named in str(caught.value)


def test_sglang_keys_and_defaults_are_accepted():
    settings = parse_settings({**USER_CONFIG, "prefetch_threshold": 256, "tp_lcm_size": 4,
                               "hicache_storage_pass_prefix_keys": True})
    assert settings.endpoint == "ipc:///run/ecd/ecd.sock" and settings.namespace == "" and not settings.verify
    assert parse_settings(None).pin_seconds > 0


def test_no_daemon_is_a_miss_not_an_error(tmp_path):
    host = mha_host_pool()
    backend = make_backend(f"ipc://{tmp_path}/none.sock", host)
    fill(host, seed=10)
    before = pages(host, 32, 2)
    assert backend.batch_set_v1(["n0", "n1"], slots(0, 2)) == [False, False]
    assert backend.batch_exists(["n0"]) == 0
    assert backend.batch_get_v1(["n0", "n1"], slots(32, 2)) == [False, False]
    assert backend.batch_get(["n0"], [host.get_dummy_flat_data_page()]) == [None]
    assert backend.batch_set(["n0"], [pages(host, 0, 1)[0]]) is False
    assert backend.clear() is False
    assert all(torch.equal(a, b) for a, b in zip(before, pages(host, 32, 2)))
    backend.close()


def test_a_host_pool_without_data_pages_is_refused_at_attach_saying_why(tmp_path):
    host = mha_host_pool("page_unified")  # SGLang's own get_data_page refuses this layout
    with pytest.raises(ValueError, match="cannot page MHATokenToKVPoolHost .layout 'page_unified'.*page_first"):
        make_backend(f"ipc://{tmp_path}/none.sock", host)


def test_backup_and_prefetch_threads_at_once(daemon):
    """SGLang's backup thread and prefetch I/O thread call one backend concurrently."""
    import threading
    host = mha_host_pool(tokens=512)
    backend = make_backend(daemon.endpoint, host, extra={"verify": True})
    fill(host, seed=13)
    first = [f"t-a{i}" for i in range(8)]
    want = pages(host, 0, 8)
    assert backend.batch_set_v1(first, slots(0, 8)) == [True] * 8
    errors: list[BaseException] = []

    def backup() -> None:
        try:
            for r in range(20):
                keys = [f"t-b{r}-{i}" for i in range(8)]
                assert backend.batch_set_v1(keys, slots(32, 8)) == [True] * 8
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def prefetch() -> None:
        try:
            for _ in range(20):
                assert backend.batch_exists(first) == 8
                assert backend.batch_get_v1(first, slots(256, 8)) == [True] * 8
                assert all(torch.equal(a, b) for a, b in zip(want, pages(host, 256, 8)))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=backup), threading.Thread(target=prefetch)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert backend.counters["stored_pages"] == 8 + 160 and backend.counters["loaded_pages"] == 160
    backend.close()
