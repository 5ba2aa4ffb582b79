"""A thread-safe mirror of the block pool's prefix-cache events, for the worker's heartbeat."""

from __future__ import annotations

import threading
from collections import Counter

from engine.core.block_pool import BlockEvents


class BlockEventMirror:
    """Thread-safe copy of the block pool's prefix-cache events and cached set.

    The engine core's client ``absorb``s the pool's events as they arrive; the event loop reads
    ``drain_events``/``cached_hashes`` (what ``cluster.heartbeat.Heartbeat`` reads)
    without touching the pool. Both reads happen under one lock, so a resync's snapshot and
    the events drained with it are consistent.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events = BlockEvents()
        self._cached: set[bytes] = set()

    def absorb(self, events: BlockEvents) -> None:
        if not events.stored and not events.removed:
            return
        net = Counter(events.stored)
        net.subtract(events.removed)
        with self._lock:
            self._events.stored.extend(events.stored)
            self._events.removed.extend(events.removed)
            for block_hash, count in net.items():
                if count > 0:
                    self._cached.add(block_hash)
                elif count < 0:
                    self._cached.discard(block_hash)

    def drain_events(self) -> BlockEvents:
        with self._lock:
            events, self._events = self._events, BlockEvents()
        return events

    def cached_hashes(self) -> list[bytes]:
        with self._lock:
            return list(self._cached)
