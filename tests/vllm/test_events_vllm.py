"""ecd's [events] read with vLLM 0.33's own KV event classes (vllm.distributed.kv_events): its
`KVEventBatch` msgspec decoder on ecd's PUB stream and replay, the byte-identity of ecd's
encoding and vLLM's, and a put / evict / delete sequence as vLLM's BlockStored/BlockRemoved."""
from __future__ import annotations

import shutil

import pytest

from vllm_env import SKIP_REASON

vllm = pytest.importorskip("vllm", reason=SKIP_REASON)
if getattr(vllm, "__file__", None) is None:
    pytest.skip(SKIP_REASON, allow_module_level=True)

import msgspec  # noqa: E402
import torch  # noqa: E402
from vllm.distributed.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch,  # noqa: E402
                                        ZmqEventPublisher)

from conftest import wait_for  # noqa: E402
from ecd.daemon.events import wire  # noqa: E402
from ecd.protocol import EncoderMeta, KVBlockMeta  # noqa: E402
from kv_events import Subscriber, event_dir, events_config, replay  # noqa: E402

DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


@pytest.fixture
def evdir():
    path = event_dir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_ecd_encodes_byte_identically_to_vllm():
    ours = msgspec.msgpack.Encoder()
    cases = [
        (wire.stored_event("k", "CPU", KVBlockMeta(123, 45, [1, 2], 16, "lora", 2)),
         BlockStored([123], 45, [1, 2], 16, None, "CPU", "lora", group_idx=2)),
        (wire.stored_event("k", "STORAGE", None), BlockStored([b"k"], None, [], 0, None, "STORAGE", None)),
        (wire.stored_event("k", "GPU", EncoderMeta("mm", 9)),
         BlockStored([b"mm"], None, [], 9, None, "GPU", None, kv_cache_spec_kind="encoder")),
        (wire.removed_event("k", "CPU", KVBlockMeta(b"\x01" * 32, group_idx=0)),
         BlockRemoved([b"\x01" * 32], "CPU", group_idx=0)),
        (wire.AllBlocksCleared(), AllBlocksCleared()),
    ]
    # Byte-identical to the vLLM ecd's events follow (0.33: BlockStored has lookahead_token_ids);
    # an older vLLM (0.32, `make test-engine`) has fewer fields: it decodes ours to its own events.
    newest = "lookahead_token_ids" in BlockStored.__struct_fields__
    for mine, theirs in cases:
        encoded = ours.encode(wire.EventBatch(1.5, [mine]))
        if newest:
            assert encoded == msgspec.msgpack.encode(KVEventBatch(1.5, [theirs]))
        else:
            assert DECODER.decode(encoded).events == [theirs]


def test_a_put_evict_delete_sequence_decodes_with_vllms_classes(daemon_factory, evdir):
    daemon = daemon_factory(size="8MiB", extra=events_config(evdir))
    sub = Subscriber(evdir, (b"kv",), decode=DECODER.decode)
    try:
        with daemon.client() as c:
            deadline_probe = 0
            while not sub.received:  # PUB/SUB joins late: probe until this SUB receives
                c.put(f"probe{deadline_probe}", torch.zeros(1))
                sub.poll(0.2)
                deadline_probe += 1
                assert deadline_probe < 50
            for i in range(12):  # 1 MiB blocks through an 8 MiB pool: the first ones are evicted
                c.put(f"b{i}", torch.zeros(1 << 20, dtype=torch.uint8),
                      meta=KVBlockMeta(1000 + i, 999 + i if i else None, list(range(i, i + 4)), 4))
            c.delete(["b11"])

            def events():
                return [e for _, _, batch in sub.received for e in batch.events]
            wait_for(lambda: (sub.poll(0.05), any(isinstance(e, BlockRemoved) and e.block_hashes == [1011]
                                                  for e in events()))[1], timeout=10)
        evs = events()
        assert all(isinstance(b, KVEventBatch) for _, _, b in sub.received)
        first = next(e for e in evs if isinstance(e, BlockStored) and e.block_hashes == [1000])
        assert (first.parent_block_hash, first.token_ids, first.block_size, first.medium) == (None, [0, 1, 2, 3], 4, "CPU")
        second = next(e for e in evs if isinstance(e, BlockStored) and e.block_hashes == [1001])
        assert second.parent_block_hash == 1000
        evicted = [e.block_hashes[0] for e in evs if isinstance(e, BlockRemoved) and e.block_hashes[0] != 1011
                   and isinstance(e.block_hashes[0], int)]
        assert evicted and evicted[0] == 1000 and all(e.medium == "CPU" for e in evs if isinstance(e, BlockRemoved))
        # replay, decoded by vLLM's decoder: the cold start's AllBlocksCleared first
        got = replay(evdir, 0, decode=DECODER.decode)
        assert isinstance(got[0][2].events[0], AllBlocksCleared)
        assert [s for _, s, _ in got] == list(range(len(got)))
    finally:
        sub.close()


def test_the_replay_client_ecd_is_tested_with_reads_vllms_own_publisher(evdir):
    """kv_events.replay (which the tests above and tests/integration/test_events.py point at ecd)
    against vLLM's own ZmqEventPublisher: the same request, frames and END_SEQ marker."""
    import zmq
    pub = ZmqEventPublisher(0, endpoint=f"ipc://{evdir}/pub", replay_endpoint=f"ipc://{evdir}/replay", topic="kv")
    try:
        pub.publish(KVEventBatch(1.0, [AllBlocksCleared()]))
        pub.publish(KVEventBatch(2.0, [BlockStored([5], None, [1], 1, None, "CPU", None)]))
        got = wait_for(lambda: (lambda r: r if len(r) == 2 else None)(replay(evdir, 0, decode=DECODER.decode)))
        assert [(t, s) for t, s, _ in got] == [(b"kv", 0), (b"kv", 1)]
        assert got[1][2].events[0].block_hashes == [5]
        assert replay(evdir, 1, decode=DECODER.decode)[0][1] == 1
        assert zmq.__version__
    finally:
        pub.shutdown()
