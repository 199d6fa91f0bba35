"""What this node holds, as it changes: the one feed the fleet's views of the node follow.

The store and its tiers call `Holdings` when a key becomes readable in a medium or stops being
(stored, evicted, deleted, spilled to disk, promoted back), and once at start (`cleared`: forget
what this node held before). Listeners turn it into the KV events routers read
(ecd/daemon/events/) and the fleet directory's key map (ecd/daemon/peer/directory.py).

Listeners run on the daemon's loop, inline with the put or eviction that caused the change: each
must only queue (bounded) and return; it must never block, raise, or call back into the store.
"""
from __future__ import annotations

import enum
import logging
from typing import Protocol

from ..protocol import EntryMeta

log = logging.getLogger("ecd.holdings")


class Medium(str, enum.Enum):
    """Where a key's bytes are, in the words of vLLM's KV events (`medium`)."""

    HOST = "CPU"  # the host shared-memory pool
    DISK = "STORAGE"  # the disk tier ([pool.disk])
    CUDA = "GPU"  # a CUDA arena ([pool.cuda])


class HoldingsListener(Protocol):
    def stored(self, ns: str, key: str, medium: Medium, meta: EntryMeta | None) -> None: ...

    def removed(self, ns: str, key: str, medium: Medium, meta: EntryMeta | None) -> None: ...

    def cleared(self) -> None: ...


class Holdings:
    """Fan-out to the listeners; with none (neither [events] nor a directory), each call is one
    attribute test."""

    def __init__(self) -> None:
        self.listeners: list[HoldingsListener] = []

    def listen(self, listener: HoldingsListener) -> None:
        self.listeners.append(listener)

    def stored(self, ns: str, key: str, medium: Medium, meta: EntryMeta | None = None) -> None:
        for listener in self.listeners:
            self._call(listener.stored, ns, key, medium, meta)

    def removed(self, ns: str, key: str, medium: Medium, meta: EntryMeta | None = None) -> None:
        for listener in self.listeners:
            self._call(listener.removed, ns, key, medium, meta)

    def cleared(self) -> None:
        for listener in self.listeners:
            self._call(listener.cleared)

    @staticmethod
    def _call(method, *args) -> None:  # type: ignore[no-untyped-def]
        try:
            method(*args)
        except Exception:  # a listener's bug must not fail the put or eviction that called it
            log.exception("holdings listener %r failed", method)
