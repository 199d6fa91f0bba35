"""A consumer's load takes each entry out of the pool with exactly one copy (issue 26, item 4).

EcdECConnectorWorker.start_load_caches loads a step's encoder outputs with
`Client.get_many(keys, missing_ok=True, device=<the engine's device>)`; on a CPU engine that
device is "cpu". What it hands the encoder cache must be its own memory (the pool's lease ends
when get_many returns), made with one copy: one buffer of the entry's size allocated, no staging
copy on the way (a contiguous(), a bytes object, a numpy array). tests/copy_count.py counts the
buffers the allocators saw; the controls below show it sees the copies a load must not make.
The CUDA path (device="cuda": one host-to-device copy out of the registered pool, straight into
device memory) is tests/gpu/test_gpu_one_copy.py.
"""
from __future__ import annotations

import torch

from actor import make_tensor
from copy_count import observe, pool_overlaps

NUM_EMBEDS, HIDDEN = 576, 4096  # one image of a LLaVA-sized model: 4.5 MiB of bfloat16
NUMEL = NUM_EMBEDS * HIDDEN
NBYTES = NUMEL * 2


def test_get_many_as_the_ec_worker_calls_it_copies_each_entry_once(daemon, actors):
    producer = actors(daemon.endpoint)  # the encoder engine: another process
    for i in range(2):
        assert producer.ask(f"put img{i} {i} {NUMEL} bfloat16") == "ok"
    with daemon.client() as c:
        c.get_many(["img0"], missing_ok=True, device="cpu")  # connected, pools mapped: not observed

        seen = observe(lambda: c.get_many(["img0", "img1", "absent"], missing_ok=True, device="cpu"), NBYTES)
        first, second, absent = seen.result
        assert absent is None
        for i, out in enumerate((first, second)):
            assert torch.equal(out.view(torch.int16), make_tensor(i, NUMEL, "bfloat16").view(torch.int16))
            assert not pool_overlaps(c, out)  # its own memory, not a view of the pool
        # exactly one buffer per entry (the tensor handed back), no staging copy on the way
        assert len(seen.torch_buffers) == 2, seen.torch_buffers
        assert seen.python_peak < NBYTES, seen.python_peak
        assert seen.torch_copies == 0  # the copy is ecd._copy's, straight out of the mapping


def test_the_observer_sees_the_copies_a_load_must_not_make(daemon, actors):
    """Controls: a second copy, through torch or through Python memory, is counted."""
    producer = actors(daemon.endpoint)
    assert producer.ask(f"put img {7} {NUMEL} bfloat16") == "ok"
    with daemon.client() as c:
        c.get("img")
        cloned = observe(lambda: c.get("img").clone(), NBYTES)
        assert len(cloned.torch_buffers) == 2 and cloned.torch_copies == 1

        def through_bytes() -> torch.Tensor:
            with c.view("img") as v:
                return torch.frombuffer(bytearray(v.view(torch.uint8).numpy().tobytes()), dtype=torch.bfloat16)

        staged = observe(through_bytes, NBYTES)
        assert staged.python_peak >= NBYTES and staged.buffers_of_at_least(NBYTES) >= 1

        with c.view("img") as v:
            assert pool_overlaps(c, v)  # a view is the pool's memory
