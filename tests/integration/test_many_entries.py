"""Many small entries in one request each way (issue 26, per-entry cost): what put_many, get_many
and view_many batch (one allocator run in the daemon, one compiled copy per pool segment in the
client, views as strides of one tensor per pool) gives back exactly what was put, in every
layout and dtype, and a batch with a refused item leaves nothing of itself behind."""
from __future__ import annotations

import pytest
import torch

from ecd.errors import LimitExceeded


def sources() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(26)
    paged = torch.randn(4, 300, 2, 64, generator=g).to(torch.float16)  # [layers, blocks, ...]
    stacked = paged.permute(1, 0, 2, 3)  # PagedKV.gather's rows: a block's layers lie apart
    items = {f"kv/{b}": stacked[b] for b in range(0, 300, 3)}  # 100 KV blocks of 1 KiB
    items.update({
        "empty": torch.empty(0, 3),
        "bf16": torch.randn(5, 7, generator=g).to(torch.bfloat16),
        "transposed": torch.randn(9, 4, generator=g).t(),
        "int64": torch.arange(1000, dtype=torch.int64),
        "scalar": torch.tensor(2.5),
        "embedding": torch.randn(2048, generator=g),  # 8 KiB
    })
    return items


@pytest.mark.parametrize("backing", ["memfd", "named"])
def test_put_many_then_get_many_and_view_many_give_back_every_layout(daemon_factory, backing):
    daemon = daemon_factory(backing=backing)
    items = sources()
    keys = list(items)
    with daemon.client() as c:
        c.put_many(items)
        c.put_many(items)  # again: each commit replaces an entry of the first batch
        for key, got in zip(keys, c.get_many(keys)):
            want = items[key]
            assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), key
        with c.view_many(keys) as views:
            for key, view in zip(keys, views):
                want = items[key]
                assert view.dtype == want.dtype and view.shape == want.shape and torch.equal(view, want), key
        assert c.get_many(["kv/0", "absent", "bf16"], missing_ok=True)[1] is None
        c.delete(keys[::2])  # entries of one allocator run are freed one by one
        c.put_many({k: items[k] for k in keys[::2]})
        assert all(torch.equal(a, items[k]) for k, a in zip(keys, c.get_many(keys)))
        c.delete(keys)
        stats = c.stats()
    assert stats["entries_ready"] == 0 and stats["entries_writing"] == 0
    assert stats["used_bytes"] - stats["leased_bytes"] <= 4096  # at most the reservation for its next put


def test_a_refused_item_in_the_middle_of_a_batch_leaves_nothing_of_it_visible(daemon):
    items = {f"ok/{i}": torch.full((8192,), float(i)) for i in range(50)}
    items["x" * 2000] = torch.ones(8192)  # longer than limits.max_key_bytes: refused in its slot
    items.update({f"ok/{i}": torch.full((8192,), float(i)) for i in range(50, 100)})
    with daemon.client() as c:
        with pytest.raises(LimitExceeded):
            c.put_many(items)
        assert c.exists([f"ok/{i}" for i in range(100)], pin_s=1.0) == [False] * 100
        stats = c.stats()
        assert stats["entries_ready"] == 0 and stats["entries_writing"] == 0
        del items["x" * 2000]
        c.put_many(items)  # the same batch without it: stored whole
        assert all(bool((t == i).all()) for i, t in enumerate(c.get_many([f"ok/{i}" for i in range(100)])))
