"""Rank 0's per-step broadcast to the other tensor-parallel ranks through a shared-memory ring
(the idea of vLLM's ``MessageQueue``), not a collective per step.

One writer (rank 0) and ``num_readers`` readers share a file in ``/dev/shm``: a ring of
``num_slots`` slots of ``slot_bytes`` each, a count of slots written, and one count of slots read
per reader. A message (an int64 array) takes as many consecutive slots as it needs, its first
slot headed by its length; the writer waits while the slot it would write is still unread by a
reader. Counts only grow, so each side reads the other's count and never writes it. The writer
stores a slot's bytes before the count that publishes it and a reader loads the count before the
bytes (and the writer loads a reader's count before overwriting its slot): on x86-64, whose
stores are seen in order and whose loads are not moved after later stores (total store order),
that is all the ordering a single-writer ring needs.

A waiting reader yields the processor for ``SPIN_S``, then sleeps in steps that double up to
``MAX_SLEEP_S``: a step arrives within microseconds while steps are flowing, and an idle engine's
ranks cost next to no CPU. A reader whose writer has died notices: :meth:`ShmBroadcast.receive`
takes a ``alive`` check, called while it waits.
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Callable

import numpy as np

from engine.parallel.shared_memory import shm_path

SPIN_S = 200e-6
MAX_SLEEP_S = 2e-3
# int64 words before the ring: the slots written, then one count of slots read per reader.
_WRITTEN = 0
_SHUTDOWN = -1


class ShmBroadcast:
    """The writer's or a reader's end of a ring of ``num_slots`` slots of ``slot_bytes`` bytes.

    Args:
        path: the shared file: ``None`` for the writer, which creates it (:attr:`path` names it
            for the readers); the writer's path for a reader.
        num_readers: the readers (ranks ``1 .. num_readers``).
        reader: this reader's index (``0 .. num_readers - 1``); ``None`` for the writer.
        num_slots, slot_bytes: the ring's size (the writer's are the readers').
    """

    def __init__(self, num_readers: int, path: str | None = None, reader: int | None = None,
                 num_slots: int = 8, slot_bytes: int = 1 << 20) -> None:
        self.num_readers, self.reader = num_readers, reader
        self.num_slots, self.slot_words = num_slots, slot_bytes // 8
        header = 1 + num_readers
        size = (header + num_slots * self.slot_words) * 8
        if path is None:
            path = shm_path(size, prefix="tandem-tp-steps-")
            with open(path, "xb") as f:
                f.truncate(size)
        self.path = path
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), size)
        words = np.frombuffer(self._map, dtype=np.int64)
        self._counts = words[:header]
        self._ring = words[header:].reshape(num_slots, self.slot_words)
        self._position = 0  # slots this side has written (writer) or read (reader)

    def unlink(self) -> None:
        """Remove the file (every reader has mapped it; the memory lasts as long as a mapping)."""
        os.unlink(self.path)

    # ------------------------------------------------------------------ writer
    def send(self, payload: np.ndarray | None, alive: Callable[[], bool] = lambda: True) -> None:
        """Publish one message (``None``: the shutdown).

        Raises:
            RuntimeError: a reader stopped reading (``alive`` says no while the ring is full).
        """
        data = np.empty(0, dtype=np.int64) if payload is None else np.ascontiguousarray(payload, dtype=np.int64)
        head = np.array([_SHUTDOWN if payload is None else len(data)], dtype=np.int64)
        words = np.concatenate([head, data])
        for start in range(0, len(words), self.slot_words):
            chunk = words[start:start + self.slot_words]
            self._wait(lambda: int(self._counts[1:].min()) > self._position - self.num_slots, alive)
            self._ring[self._position % self.num_slots, :len(chunk)] = chunk
            self._position += 1
            self._counts[_WRITTEN] = self._position  # after the slot's bytes: publishes them

    # ------------------------------------------------------------------ reader
    def receive(self, alive: Callable[[], bool] = lambda: True) -> np.ndarray | None:
        """The next message (``None``: the writer shut down).

        Raises:
            RuntimeError: the writer is gone (``alive`` says no while nothing comes).
        """
        first = self._read_slot(alive)
        size = int(first[0])
        if size == _SHUTDOWN:
            return None
        out = np.empty(size, dtype=np.int64)
        got = min(size, self.slot_words - 1)
        out[:got] = first[1:1 + got]
        while got < size:
            chunk = self._read_slot(alive)
            n = min(size - got, self.slot_words)
            out[got:got + n] = chunk[:n]
            got += n
        return out

    def _read_slot(self, alive: Callable[[], bool]) -> np.ndarray:
        self._wait(lambda: int(self._counts[_WRITTEN]) > self._position, alive)
        slot = self._ring[self._position % self.num_slots].copy()  # before the count that frees it
        self._position += 1
        self._counts[1 + self.reader] = self._position
        return slot

    @staticmethod
    def _wait(ready: Callable[[], bool], alive: Callable[[], bool]) -> None:
        if ready():
            return
        started, sleep = time.monotonic(), 0.0
        while not ready():
            if time.monotonic() - started < SPIN_S:
                os.sched_yield()
                continue
            if not alive():
                raise RuntimeError("the other side of the tensor-parallel step ring is gone")
            sleep = min(MAX_SLEEP_S, max(sleep * 2, 50e-6))
            time.sleep(sleep)
