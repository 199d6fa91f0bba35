"""`[events]` of node.toml: the KV events this node publishes in vLLM's wire format
(ecd/daemon/events/, docs/events.md); config.py re-exports it."""
from __future__ import annotations

import re

from msgspec import Struct

from .config_types import ByteSize, Duration, Section, check_field, split_tcp_endpoint

_IPC = re.compile(r"ipc://.+")


def _check_endpoint(key: str, endpoint: str) -> None:
    where = split_tcp_endpoint(endpoint)
    check_field(_IPC.fullmatch(endpoint) is not None or where is not None, key,
                f"must be tcp://HOST:PORT or ipc://PATH (an address this node binds), got {endpoint!r}")


class EventsSection(Section):
    """`[events]`: publish what this node holds as vLLM KV events (ZeroMQ PUB, msgpack
    KVEventBatch), so KV-cache-aware routers written for vLLM's ZmqEventPublisher follow it.
    Off while `publish` is ""."""

    publish: str = ""  # tcp://HOST:PORT or ipc://PATH the PUB socket binds ("": no events)
    replay: str = ""  # tcp://HOST:PORT or ipc://PATH of the ROUTER that replays missed batches ("": none)
    topic: str = "kv"  # the topic of KV entries' batches (those put with KVBlockMeta or no meta)
    encoder_topic: str = "ec"  # the topic of encoder-cache entries' batches (EncoderMeta)
    buffer_batches: int = 10000  # batches kept for replay, per topic
    buffer_bytes: ByteSize = ByteSize(64 << 20)  # and at most this many bytes of them, per topic
    batch_interval: Duration = Duration(0.02)  # a batch at least this often while events wait
    batch_events: int = 512  # at most this many events in one batch
    queue_events: int = 100000  # events waiting for the publisher; past it: drop, count, resync
    # ZMQ send high-water mark of the PUB socket, in batches: what a slow subscriber may have
    # queued in the daemon (past it, ZMQ drops for that subscriber, which sees a seq gap and asks
    # for a replay). Batches, not events: at most batch_events each; 1000 is 20 s of batches.
    hwm: int = 1000
    # CURVE, as in [control] and [cluster]: this node's secret key and the directory of the
    # subscribers' public keys it admits (*.key). A tcp bind needs them, on loopback too, or
    # insecure = true (then anyone who reaches the port reads what this node holds, token ids
    # included); an ipc:// socket is the control socket's group's (0660) and needs neither.
    curve_secret_key: str = ""
    curve_allowed_keys: str = ""
    insecure: bool = False

    def __post_init__(self) -> None:
        if self.publish:
            _check_endpoint("publish", self.publish)
        if self.replay:
            check_field(bool(self.publish), "replay", "needs publish (it replays what publish sent)")
            _check_endpoint("replay", self.replay)
            check_field(self.replay != self.publish, "replay", "must differ from publish")
        for key in ("topic", "encoder_topic"):
            value = getattr(self, key)
            check_field(len(value.encode()) <= 256, key, f"at most 256 bytes, got {len(value.encode())}")
            check_field(not value.startswith("@"), key, f"may not start with '@' (tenants' topics do), got {value!r}")
        # SUB subscriptions match prefixes: a subscriber of one topic must not receive the other
        check_field(not (self.topic.startswith(self.encoder_topic) or self.encoder_topic.startswith(self.topic)),
                    "encoder_topic", f"{self.encoder_topic!r} and topic {self.topic!r}: neither may be a prefix "
                    "of the other (ZMQ subscriptions match prefixes)")
        check_field(1 <= self.buffer_batches <= 1_000_000, "buffer_batches",
                    f"must be between 1 and 1000000, got {self.buffer_batches}")
        check_field(1 << 16 <= self.buffer_bytes <= 1 << 34, "buffer_bytes",
                    f"must be between 64KiB and 16GiB, got {int(self.buffer_bytes)}")
        check_field(0.0005 <= self.batch_interval <= 10, "batch_interval",
                    f"must be between 0.5ms and 10s, got {float(self.batch_interval)}")
        check_field(1 <= self.batch_events <= 65536, "batch_events",
                    f"must be between 1 and 65536, got {self.batch_events}")
        check_field(self.batch_events <= self.queue_events <= 10_000_000, "queue_events",
                    f"must be between batch_events ({self.batch_events}) and 10000000, got {self.queue_events}")
        check_field(1 <= self.hwm <= 10_000_000, "hwm", f"must be between 1 and 10000000, got {self.hwm}")
        check_field(bool(self.curve_secret_key) == bool(self.curve_allowed_keys),
                    "curve_allowed_keys" if self.curve_secret_key else "curve_secret_key",
                    "curve_secret_key and curve_allowed_keys must be set together")
        for key in ("publish", "replay"):
            endpoint = getattr(self, key)
            # Loopback is no boundary: every local user reaches 127.0.0.1 and would read the token ids
            # of every stored block and every namespace's key names (issue 40, attack 2).
            check_field(not endpoint.startswith("tcp://") or self.curve or self.insecure, key,
                        f"{endpoint}: a tcp endpoint (loopback included) is open to every local "
                        "user, who would read the token ids and key names of what this node holds; use "
                        "ipc://PATH (its socket is 0660, node.group's, like the control socket), or set "
                        "events.curve_secret_key and events.curve_allowed_keys (CURVE), or events.insecure = "
                        "true to publish to everyone who can reach the port")

    @property
    def enabled(self) -> bool:
        return bool(self.publish)

    @property
    def curve(self) -> bool:
        return bool(self.curve_secret_key)


class EventsStats(Struct):
    """What [events] did (ecd/daemon/events/), as `ecd status` shows it (DaemonStats.events)."""
    endpoints: list[str]  # the PUB endpoint, then the replay ROUTER's (as bound)
    batches: int  # published, both topics
    events: int  # in them
    dropped: int = 0  # events dropped because the publisher fell behind (each followed by a resync)
    resyncs: int = 0  # AllBlocksCleared + snapshot sequences (the start's included)
    replays: int = 0  # replay requests served
    bad_replay_requests: int = 0  # malformed replay requests ignored
    waiting: int = 0  # events not yet published
    rejected: int = 0  # CURVE handshakes refused
