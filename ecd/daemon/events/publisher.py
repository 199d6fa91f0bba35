"""The publisher thread: it alone owns the PUB socket and the replay ROUTER (ZeroMQ sockets are
not thread-safe). The loop (feed.py) hands it batches of (stored, key, medium, meta) tuples on a
queue it never blocks on; this thread turns them into vLLM's structs (wire.py), encodes them,
numbers them per topic (an 8-byte big-endian seq, contiguous per topic: a subscriber that sees a
gap asks for a replay) and sends [topic, seq, payload]. Each topic keeps its last batches for
replay, bounded by count and bytes.

Replay (vLLM's protocol): a request [identity, b"", start] (start: 8 bytes, big-endian) gets every
buffered batch of `topic` with seq >= start as [identity, b"", topic, seq, payload], then
[identity, b"", b"", END_SEQ, b""]; ecd also takes [identity, b"", start, TOPIC] for another topic
(encoder_topic). Sends never block: a client that does not read loses the rest of its replay
(ZMQ's high-water mark), the thread goes on. Any other request is logged (at most once a
minute) and ignored.

Memory: the queue holds at most [events] queue_events events (the feed counts what this thread
has not taken yet and resyncs rather than queue more), the PUB socket at most `hwm` messages per
subscriber (ZMQ drops past it), the replay buffers their bounds, the ROUTER its high-water mark
per client; payloads are sent zero-copy (the subscribers' queues and replays share the buffer's bytes).
"""
from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Any, Iterable

import msgspec
import zmq

from ...listeners import group_socket_file
from .wire import END_SEQ, EventBatch, AllBlocksCleared, removed_event, seq_bytes, stored_event

if TYPE_CHECKING:  # pragma: no cover
    from ...events_config import EventsSection
    from ..ops.security import CurveAuth

log = logging.getLogger("ecd.events")

POLL_S = 0.02  # how long the thread waits for a batch before it looks at the replay socket again
REPLAY_REQUESTS_PER_WAKE = 16
BAD_REQUEST_LOG_S = 60.0
CLEARED = "cleared"  # a batch's events: [CLEARED] is one AllBlocksCleared

Item = tuple[bytes, float, list[Any]]  # (topic, ts, events)


class Publisher:
    def __init__(self, config: "EventsSection", curve: "CurveAuth | None", gid: int = -1,
                 tenants: Iterable[str] = ()) -> None:
        self.config = config
        self.curve = curve
        self.gid = gid  # node.group: an ipc endpoint's socket belongs to it (-1: the process's own)
        # (topic, encoder_topic) by tenant ("": the default's): a tenant's are "@TENANT/" and those,
        # so a router of one tenant subscribes to its own (no configured topic starts with "@")
        base = (config.topic.encode(), config.encoder_topic.encode())
        self.topics_of: dict[str, tuple[bytes, bytes]] = {"": base}
        for tenant in tenants:
            prefix = f"@{tenant}/".encode()
            self.topics_of[tenant] = (prefix + base[0], prefix + base[1])
        self.topics = tuple(topic for pair in self.topics_of.values() for topic in pair)  # the default's first
        self.queue: queue.SimpleQueue[Item | None] = queue.SimpleQueue()
        self.taken = 0  # events this thread took off the queue (the feed subtracts it from what it put)
        self.seq = {t: 0 for t in self.topics}  # the next seq, per topic
        self.buffers: dict[bytes, collections.deque[tuple[int, bytes]]] = {t: collections.deque() for t in self.topics}
        self.buffer_bytes = {t: 0 for t in self.topics}
        self.batches = self.events = self.replays = self.bad_requests = self.replay_cut = 0
        self.failures = 0
        self._bad_logged = 0.0
        self.ctx: zmq.Context | None = None
        self.pub: zmq.Socket | None = None
        self.router: zmq.Socket | None = None
        self.thread: threading.Thread | None = None
        self.endpoints: list[str] = []

    def open(self) -> None:
        """Bind (on the caller's thread, so a bad address fails the start); OSError/ZMQError out."""
        self.ctx = zmq.Context()  # its own: its own ZAP handler with [events] CURVE
        if self.curve is not None:
            self.curve.start(self.ctx)
        try:
            self.pub = self._bind(zmq.PUB, self.config.publish)
            self.pub.sndhwm = self.config.hwm
            if self.config.replay:
                self.router = self._bind(zmq.ROUTER, self.config.replay)
        except BaseException:
            self.close()
            raise

    def _bind(self, kind: int, endpoint: str) -> zmq.Socket:
        assert self.ctx is not None
        sock = self.ctx.socket(kind)
        sock.linger = 0
        if kind == zmq.ROUTER:
            # a full replay of one topic and its marker fit; a client that reads nothing holds at most this
            sock.sndhwm = 2 * (self.config.buffer_batches + 1)
            sock.rcvhwm = 64
            sock.setsockopt(zmq.MAXMSGSIZE, 4096)  # requests are tiny: anything else is cut off at the wire
        else:
            sock.sndhwm = self.config.hwm
        # zero-copy: a batch's payload is one buffer, shared by the replay buffer, every
        # subscriber's PUB queue and every replay (never a copy per subscriber)
        sock.copy_threshold = 0
        if ":" in endpoint.removeprefix("tcp://").rpartition(":")[0]:
            sock.ipv6 = True
        ipc_path = endpoint[len("ipc://"):] if endpoint.startswith("ipc://") else None
        try:
            if self.curve is not None:
                self.curve.apply(sock)
            with group_socket_file(ipc_path, self.gid):  # node.group's, like the control socket (issue 40)
                sock.bind(endpoint)
        except BaseException:
            sock.close(linger=0)  # else the context's term() waits for it forever
            raise
        self.endpoints.append(sock.getsockopt_string(zmq.LAST_ENDPOINT))
        return sock

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="ecd-events", daemon=True)
        self.thread.start()

    def put(self, topic: bytes, events: list[Any]) -> None:
        """From the loop: never blocks (the feed bounds what it puts)."""
        self.queue.put((topic, time.time(), events))

    # ---- the thread ---------------------------------------------------------------------

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while True:
            try:
                item = self.queue.get(timeout=POLL_S)
            except queue.Empty:
                item = ()  # type: ignore[assignment]
            if item is None:
                return
            try:
                while item:
                    self._publish(encoder, *item)
                    item = self.queue.get_nowait()
                    if item is None:
                        return
            except queue.Empty:
                pass
            except Exception:  # a bug must not stop the events for good
                self.failures += 1
                log.exception("events: publishing a batch failed")
            if self.router is not None:
                for _ in range(REPLAY_REQUESTS_PER_WAKE):
                    if not self.router.poll(0):
                        break
                    try:
                        self._replay()
                    except Exception:
                        self.failures += 1
                        log.exception("events: a replay failed")

    def _publish(self, encoder: msgspec.msgpack.Encoder, topic: bytes, ts: float, items: list[Any]) -> None:
        self.taken += len(items)
        events: list[Any] = []
        for item in items:
            if item is CLEARED:
                events.append(AllBlocksCleared())
            else:
                stored, key, medium, meta = item
                events.append(stored_event(key, medium, meta) if stored else removed_event(key, medium, meta))
        payload = encoder.encode(EventBatch(ts, events))
        seq = self.seq[topic]
        self.seq[topic] = seq + 1
        assert self.pub is not None
        try:
            self.pub.send_multipart((topic, seq_bytes(seq), payload), flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:  # not expected of PUB (it drops at the HWM), but never block
            pass
        buffer = self.buffers[topic]
        buffer.append((seq, payload))
        self.buffer_bytes[topic] += len(payload)
        while len(buffer) > self.config.buffer_batches or self.buffer_bytes[topic] > self.config.buffer_bytes:
            self.buffer_bytes[topic] -= len(buffer.popleft()[1])
        self.batches += 1
        self.events += len(events)

    def _replay(self) -> None:
        assert self.router is not None
        frames = self.router.recv_multipart(flags=zmq.NOBLOCK)
        topic = self.topics[0]
        ok = len(frames) in (3, 4) and frames[1] == b"" and len(frames[2]) == 8
        if ok and len(frames) == 4:
            ok = frames[3] in self.topics
            topic = frames[3]
        if not ok:
            self.bad_requests += 1
            now = time.monotonic()
            if now - self._bad_logged >= BAD_REQUEST_LOG_S:
                self._bad_logged = now
                log.warning("events: ignored a replay request that is not [identity, '', 8-byte seq(, topic)]: "
                            "%d frame(s) of %s byte(s) (logged once a minute; %d so far)", len(frames),
                            [len(f) for f in frames[:5]], self.bad_requests)
            return
        identity, start = frames[0], int.from_bytes(frames[2], "big", signed=True)
        self.replays += 1
        try:
            for seq, payload in list(self.buffers[topic]):
                if seq >= start:
                    self.router.send_multipart((identity, b"", topic, seq_bytes(seq), payload),
                                               flags=zmq.NOBLOCK, copy=False)
            self.router.send_multipart((identity, b"", b"", END_SEQ, b""), flags=zmq.NOBLOCK)
        except zmq.Again:  # the client does not read: the rest of its replay is dropped
            self.replay_cut += 1

    # ---- shutdown -----------------------------------------------------------------------

    def close(self) -> None:
        if self.thread is not None:
            self.queue.put(None)
            self.thread.join(timeout=2.0)
            self.thread = None
        for sock in (self.pub, self.router):
            if sock is not None:
                sock.close(linger=0)
        self.pub = self.router = None
        if self.curve is not None:
            self.curve.stop()
        if self.ctx is not None:
            self.ctx.term()
            self.ctx = None
