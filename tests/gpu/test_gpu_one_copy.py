"""On a GPU: the EC consumer's load into device memory is one copy out of the pool (issue 26, item 4).

EcdECConnectorWorker.start_load_caches calls `Client.get_many(keys, missing_ok=True,
device=cuda:N)`. A host-pool entry must go from the CUDA-registered pool mapping straight into
the new device tensor (one host-to-device copy, no staging through pageable memory), an arena
entry by one device-to-device copy. tests/copy_count.py counts what the allocators saw; the CPU
path is tests/integration/test_one_copy.py. Marked `gpu`: skipped without a CUDA device."""
from __future__ import annotations

import pytest
import torch

from actor import make_tensor
from copy_count import observe, pool_overlaps

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

NUMEL = 576 * 4096  # one image of a LLaVA-sized model: 4.5 MiB of bfloat16
NBYTES = NUMEL * 2
ARENA = '[pool.cuda]\ndevices = [0]\nsize = "256MiB"\n'


@pytest.mark.parametrize("where", ["host", "arena"])
def test_get_many_to_the_device_copies_each_entry_once(daemon_factory, actors, where):
    daemon = daemon_factory(size="256MiB", extra=ARENA if where == "arena" else "")
    expected = [make_tensor(i, NUMEL, "bfloat16") for i in range(2)]
    if where == "host":
        producer = actors(daemon.endpoint)  # the encoder engine: another process, CPU tensors
        for i in range(2):
            assert producer.ask(f"put img{i} {i} {NUMEL} bfloat16") == "ok"
    device = torch.device("cuda", 0)
    with daemon.client() as c:
        if where == "arena":
            for i, t in enumerate(expected):
                c.put(f"img{i}", t.to(device))
        c.get_many(["img0"], missing_ok=True, device=device)  # pools mapped and registered: not observed
        torch.cuda.synchronize()

        seen = observe(lambda: c.get_many(["img0", "img1", "absent"], missing_ok=True, device=device), NBYTES)
        first, second, absent = seen.result
        assert absent is None
        for out, want in zip((first, second), expected):
            assert out.device == device and not pool_overlaps(c, out)
            assert torch.equal(out.cpu().view(torch.int16), want.view(torch.int16))
        # one device tensor per entry, filled by one copy; nothing staged on the host
        assert seen.device_allocations == 2, seen
        assert seen.torch_copies == 2, seen
        assert seen.torch_buffers == [] and seen.python_peak < NBYTES, seen
