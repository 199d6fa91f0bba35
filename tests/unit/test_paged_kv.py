"""PagedKV's load (scatter) on a CPU engine: the compiled copy of every layer's row of every block
(issue 26) writes exactly what the numpy copy per block writes, and refuses what it cannot check."""
from __future__ import annotations

import pytest
import torch

from ecd.client import tensors
from ecd.integrations.vllm.paged_kv import PagedKV

LAYERS, BLOCKS, BLOCK = 3, 10, (2, 4, 8)


def paged_cache(kv_outermost: bool = False) -> tuple[PagedKV, torch.Tensor]:
    """Per-layer caches in one allocation at a constant distance, as vLLM allocates them."""
    if kv_outermost:  # [2, blocks, ...] per layer: a block's K and V lie apart
        whole = torch.zeros(LAYERS, 2, BLOCKS, *BLOCK[1:], dtype=torch.float16)
        return PagedKV({f"l{i}": whole[i] for i in range(LAYERS)}, BLOCKS), whole
    whole = torch.zeros(LAYERS, BLOCKS, *BLOCK, dtype=torch.bfloat16)
    return PagedKV({f"l{i}": whole[i] for i in range(LAYERS)}, BLOCKS), whole


def entries(paged: PagedKV, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return [torch.randn(paged.entry_shape, generator=g).to(paged.dtype) for _ in range(n)]


@pytest.mark.parametrize("kv_outermost", [False, True], ids=["rows", "kv-outermost"])
def test_scatter_writes_the_same_blocks_with_and_without_the_compiled_copy(monkeypatch, kv_outermost):
    ids = [7, 0, 3, 9]
    paged, whole = paged_cache(kv_outermost)
    got = entries(paged, len(ids))
    paged.scatter(ids, got)
    compiled = whole.clone()
    whole.zero_()
    monkeypatch.setattr(tensors, "compiled_copy", None)
    paged.scatter(ids, got)
    assert torch.equal(whole, compiled)
    for b, t in zip(ids, got):  # each block of each layer holds its entry's row
        assert torch.equal(paged.gather([b])[0], t)
    untouched = [b for b in range(BLOCKS) if b not in ids]
    assert not paged.gather(untouched)[0].any()


def test_scatter_refuses_a_block_outside_the_cache_and_an_entry_of_another_shape():
    paged, whole = paged_cache()
    good = entries(paged, 2)
    with pytest.raises(IndexError):
        paged.scatter([1, BLOCKS], good)
    with pytest.raises(IndexError):
        paged.scatter([-1 - BLOCKS, 2], good)
    short = torch.ones(LAYERS, 2, 4, 4, dtype=paged.dtype)  # half a block: never read past its end
    with pytest.raises((RuntimeError, ValueError)):
        paged.scatter([4], [short])
    assert not whole[:, 4].any()
