"""A KV events subscriber for tests: ZeroMQ SUB and replay DEALER against a daemon's [events],
decoding with plain msgspec (no ecd struct, no vLLM: the frames and field names as they are on
the wire). tests/vllm/test_events_vllm.py decodes the same stream with vLLM's own classes."""
from __future__ import annotations

import os
import tempfile
import time
from typing import Any, Callable

import msgspec
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def events_config(directory: str, extra: str = "") -> str:
    """[events] on ipc endpoints in `directory` (publish and replay)."""
    return f'[events]\npublish = "ipc://{directory}/pub"\nreplay = "ipc://{directory}/replay"\n{extra}'


def event_dir() -> str:
    return tempfile.mkdtemp(prefix="ecd-ev-", dir="/tmp")


class Subscriber:
    """SUB on `topics`; `received` keeps (topic, seq, raw decoded batch) in arrival order."""

    def __init__(self, directory: str, topics: tuple[bytes, ...] = (b"",), decode: Callable[[bytes], Any] | None = None):
        self.ctx = zmq.Context()
        self.directory = directory
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.linger = 0
        for topic in topics:
            self.sub.subscribe(topic)
        self.sub.connect(f"ipc://{directory}/pub")
        self.decode = decode or msgspec.msgpack.decode
        self.received: list[tuple[bytes, int, Any]] = []

    def poll(self, timeout: float = 0.2) -> None:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if not self.sub.poll(max(0, int(left * 1000))):
                return
            topic, seq, payload = self.sub.recv_multipart()
            assert len(seq) == 8
            self.received.append((topic, int.from_bytes(seq, "big"), self.decode(payload)))

    def events(self, topic: bytes | None = None) -> list[Any]:
        """Every event received (of `topic`), in order, as decoded."""
        return [e for t, _, batch in self.received if topic is None or t == topic for e in batch[1]]

    def wait_for(self, predicate: Callable[[list[Any]], bool], topic: bytes | None = None,
                 timeout: float = 10.0) -> list[Any]:
        deadline = time.monotonic() + timeout
        while True:
            self.poll(0.1)
            events = self.events(topic)
            if predicate(events):
                return events
            assert time.monotonic() < deadline, f"events never matched: {events[-20:]}"

    def connect_with(self, client, topic: bytes = b"kv", timeout: float = 10.0) -> None:
        """Wait until this SUB receives (PUB/SUB joins late): put probe keys until one is seen."""
        import torch
        deadline = time.monotonic() + timeout
        n = 0
        while True:
            key = f"probe-{os.getpid()}-{n}"
            client.put(key, torch.zeros(1))
            self.poll(0.2)
            if any(key.encode() in e.get("block_hashes", []) for e in self.events(topic)):
                client.delete([key])
                return
            n += 1
            assert time.monotonic() < deadline, "the subscriber never received an event"

    def seqs(self, topic: bytes) -> list[int]:
        return [s for t, s, _ in self.received if t == topic]

    def close(self) -> None:
        self.sub.close(0)
        self.ctx.term()


def replay(directory: str, start: int, extra: list[bytes] | None = None, timeout: float = 5.0,
           decode: Callable[[bytes], Any] | None = None) -> list[tuple[bytes, int, Any]]:
    """vLLM's replay request from a DEALER: [b"", start (8 bytes)] (+ `extra` frames): the
    batches it answers until the END_SEQ marker, as (topic, seq, decoded batch)."""
    decode = decode or msgspec.msgpack.decode
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    try:
        sock.connect(f"ipc://{directory}/replay")
        sock.send_multipart([b"", start.to_bytes(8, "big"), *(extra or [])])
        got = []
        while True:
            assert sock.poll(int(timeout * 1000)), "no END_SEQ marker came"
            frames = sock.recv_multipart()
            assert len(frames) == 4 and frames[0] == b"", frames
            _, topic, seq, payload = frames
            if seq == END_SEQ:
                assert topic == b"" and payload == b""
                return got
            got.append((topic, int.from_bytes(seq, "big"), decode(payload)))
    finally:
        sock.close(0)
        ctx.term()


def stored(events: list[Any], block_hash: Any, medium: str | None = None) -> list[Any]:
    return [e for e in events if e["type"] == "BlockStored" and block_hash in e["block_hashes"]
            and (medium is None or e["medium"] == medium)]


def removed(events: list[Any], block_hash: Any, medium: str | None = None) -> list[Any]:
    return [e for e in events if e["type"] == "BlockRemoved" and block_hash in e["block_hashes"]
            and (medium is None or e["medium"] == medium)]
