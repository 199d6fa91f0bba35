"""SGLang's own unit tests of its storage interface (its HiCacheFile tests for set/get/exists/
clear, batch_exists, the batch_get/batch_set wrappers and batch_exists_v2's hit policies), their
logic run against ecd's backend: the same calls and the same expected answers, on a real daemon
and real host pools. docs/sglang.md lists which of SGLang's tests apply and which do not."""
from __future__ import annotations

import pytest
import torch
from sglang_env import fill, make_backend, mamba_host_pool, mha_host_pool, slots

from ecd.integrations.sglang import EcdHiCacheStorage


@pytest.fixture
def storage(daemon, tmp_path):
    host = mha_host_pool()
    backend = make_backend(daemon.endpoint, host)
    fill(host, seed=21)
    dsa = mha_host_pool()  # an ALL_PAGES sidecar (SGLang's tests call it "dsa")
    fill(dsa, seed=22)
    backend.register_mem_host_pool_v2(dsa, "dsa")
    mamba = mamba_host_pool(checkpoints=16)  # a TRAILING_PAGES sidecar
    backend.register_mem_host_pool_v2(mamba, "mamba")
    # SGLang's own HiCacheFile beside it: every v2 lookup below is answered by both and compared
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile
    from sglang_env import storage_config
    backend.twin = HiCacheFile(storage_config(None), file_path=str(tmp_path / "hicache"))
    yield backend
    backend.close()


def write_kv(storage: EcdHiCacheStorage, *keys: str) -> None:
    assert storage.batch_set_v1(list(keys), slots(0, len(keys))) == [True] * len(keys)
    for k in keys:
        storage.twin.set(k, torch.zeros(4))


def exists_v2(storage: EcdHiCacheStorage, keys: list[str], transfers=None):
    """ecd's answer, checked equal to SGLang's HiCacheFile's for the same pages."""
    ours = storage.batch_exists_v2(keys, transfers)
    theirs = storage.twin.batch_exists_v2(keys, transfers)
    assert (ours.kv_hit_pages, ours.extra_pool_hit_pages, ours.restorable_prefix_pages) == \
        (theirs.kv_hit_pages, theirs.extra_pool_hit_pages, theirs.restorable_prefix_pages)
    return ours


def write_component(storage: EcdHiCacheStorage, pool: str, *keys: str) -> None:
    from sglang.srt.mem_cache.hicache_storage import PoolTransfer
    page_size = storage.registered_pools[pool].page_size
    indices = torch.arange(0, len(keys) * page_size, dtype=torch.int64)
    result = storage.batch_set_v2([PoolTransfer(pool, host_indices=indices, keys=list(keys))])
    assert result == {pool: [True] * len(keys)}
    for k in keys:
        storage.twin.set(f"{k}.{pool}", torch.zeros(4))


def tensor(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


# ---- set / get / exists / clear (SGLang: TestHiCacheFileIO) ------------------------------------

def test_exists_false_for_a_missing_key(storage):
    assert storage.exists("deadbeef_page_not_written") is False


def test_set_then_exists(storage):
    assert storage.set("cafebabe_page_0001", torch.randn(4, 8)) is True
    assert storage.exists("cafebabe_page_0001") is True


def test_set_is_idempotent_and_does_not_overwrite(storage):
    a, b = tensor(1, 2, 3, 4), tensor(9, 9, 9, 9)
    storage.set("idem", a)
    assert storage.set("idem", b) is True
    loaded = storage.get("idem", torch.zeros(4))
    assert loaded is not None and torch.equal(loaded, a)


def test_get_missing_is_none(storage):
    assert storage.get("deadbeef_page_not_written", torch.randn(4, 8)) is None


def test_set_get_round_trip(storage):
    original = tensor(1, 2, 3, 4)
    storage.set("roundtrip", original)
    buf = torch.zeros(4)
    loaded = storage.get("roundtrip", buf)
    assert loaded is buf and torch.equal(loaded, original)


def test_clear_removes_everything(storage):
    keys = [f"cafebabe_page_{i:03d}" for i in range(3)]
    for k in keys:
        storage.set(k, torch.randn(4, 8))
    storage.clear()
    assert not any(storage.exists(k) for k in keys)


def test_batch_exists_zero_prefix_and_full(storage):
    assert storage.batch_exists(["deadbeef_page_0", "deadbeef_page_1", "deadbeef_page_2"]) == 0
    for k in ("cafe_0", "cafe_1", "cafe_3"):
        storage.set(k, torch.randn(4, 8))
    assert storage.batch_exists(["cafe_0", "cafe_1", "cafe_2", "cafe_3"]) == 2
    storage.set("cafe_2", torch.randn(4, 8))
    assert storage.batch_exists(["cafe_0", "cafe_1", "cafe_2", "cafe_3"]) == 4


# ---- batch_get / batch_set wrappers (SGLang: TestHiCacheFileBatchV1) ----------------------------

def test_batch_set_writes_all(storage):
    keys = ["bs0", "bs1", "bs2"]
    assert storage.batch_set(keys, [tensor(1, 2, 3, 4) for _ in keys]) is True
    assert all(storage.exists(k) for k in keys)


def test_batch_get_round_trip_and_missing(storage):
    values = [tensor(*[float(i)] * 4) for i in range(2)]
    storage.batch_set(["bg0", "bg1"], values)
    results = storage.batch_get(["bg0", "bg1", "missing"], [torch.zeros(4) for _ in range(3)])
    assert torch.equal(results[0], values[0]) and torch.equal(results[1], values[1]) and results[2] is None


def test_batch_set_with_values_that_are_not_tensors_is_false(storage):
    assert storage.batch_set(["x0", "x1"], [tensor(1), None]) is False


# ---- batch_exists_v2 (SGLang: TestBatchExistsV2) --------------------------------------------------

def transfer(name, keys, policy):
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolTransfer
    return PoolTransfer(name=name, keys=keys, hit_policy=PoolHitPolicy(policy))


def test_kv_only(storage):
    from sglang.srt.mem_cache.hicache_storage import PoolName
    result = exists_v2(storage, ["k0", "k1", "k2"])
    assert result.kv_hit_pages == 0 and result.extra_pool_hit_pages == {}
    assert PoolName.KV not in result.extra_pool_hit_pages
    write_kv(storage, "p0", "p1", "p2", "p3")
    assert exists_v2(storage, [f"p{i}" for i in range(4)]).kv_hit_pages == 4
    write_kv(storage, "a0", "a1")
    assert exists_v2(storage, ["a0", "a1", "a2", "a3"]).kv_hit_pages == 2
    write_kv(storage, "a3")  # beyond the gap: still 2
    assert exists_v2(storage, ["a0", "a1", "a2", "a3"]).kv_hit_pages == 2


def test_all_pages_pool_shrinks_matches_and_never_expands(storage):
    keys = [f"b{i}" for i in range(4)]
    write_kv(storage, *keys)
    write_component(storage, "dsa", "b0", "b1")
    assert exists_v2(storage, keys, [transfer("dsa", keys, "all_pages")]).kv_hit_pages == 2
    write_component(storage, "dsa", "b2", "b3")
    assert exists_v2(storage, keys, [transfer("dsa", keys, "all_pages")]).kv_hit_pages == 4
    d = [f"d{i}" for i in range(4)]
    write_kv(storage, "d0", "d1")
    write_component(storage, "dsa", *d)
    assert exists_v2(storage, d, [transfer("dsa", d, "all_pages")]).kv_hit_pages == 2


def test_trailing_pages(storage):
    e = [f"e{i}" for i in range(4)]
    write_kv(storage, *e)
    write_component(storage, "mamba", "e2", "e3")
    assert exists_v2(storage, e, [transfer("mamba", ["e2", "e3"], "trailing_pages")]).kv_hit_pages == 4
    f = [f"f{i}" for i in range(4)]
    write_kv(storage, *f)
    write_component(storage, "mamba", "f0", "f1")
    assert exists_v2(storage, f, [transfer("mamba", ["f2", "f3"], "trailing_pages")]).kv_hit_pages == 2
    h = [f"h{i}" for i in range(3)]
    write_kv(storage, *h)
    assert exists_v2(storage, h, [transfer("mamba", ["h1", "h2"], "trailing_pages")]).kv_hit_pages == 0


def test_no_kv_hit_and_empty_keys(storage):
    write_component(storage, "mamba", "g0")
    assert exists_v2(storage, ["g0", "g1"], [transfer("mamba", ["g0", "g1"], "all_pages")]).kv_hit_pages == 0
    result = exists_v2(storage, [])
    assert result.kv_hit_pages == 0 and result.extra_pool_hit_pages == {}


def test_several_pools_the_final_prefix_is_the_minimum(storage):
    m = [f"m{i}" for i in range(4)]
    write_kv(storage, *m)
    write_component(storage, "dsa", "m0", "m1", "m2")
    write_component(storage, "mamba", "m2", "m3")
    result = exists_v2(storage, m, [transfer("dsa", m, "all_pages"),
                                         transfer("mamba", ["m2", "m3"], "trailing_pages")])
    # SGLang 0.5.23's HiCacheFile (and so ecd) intersects the prefixes each pool can restore: dsa
    # {1,2,3}, mamba's trailing window {4}, so nothing; a newer upstream test expects min(...) = 3.
    assert result.kv_hit_pages == 0 and result.extra_pool_hit_pages == {"kv": 4, "dsa": 3, "mamba": 4}
