"""Which workers routing should avoid now: outlier detection in the style of Envoy's, plus the
health probe's verdict.

Two independent reasons keep a worker out of routing:

- **ejected**: ``consecutive_failures`` calls to it failed in a row (a failure is what the
  orchestrator counts: connection failures, UNAVAILABLE, a per-hop timeout or a stalled
  stream). The ejection lasts ``base_ejection_s`` times two to the number of earlier
  ejections, at most ``max_ejection_s``; the count of earlier ejections is forgotten once the
  worker has gone ``max_ejection_s`` without being ejected. A success resets the run of
  failures. (Envoy: ``consecutive_5xx``, ``base_ejection_time``, ``max_ejection_time``.)
- **down**: its last health probe got no SERVING answer within the probe's deadline (dead,
  frozen, draining). It is back as soon as a probe answers SERVING, and that also ends an
  ejection: whatever failed before, the worker answers now (a restarted or thawed worker serves
  its next request at once). A call to it waiting for an answer before the client's first token
  fails over at the verdict (:meth:`OutlierDetector.down_signal`), not at its own timeout.

Routing prefers workers that are neither; it falls back to them only when no other worker of
the role exists (:meth:`gateway.router.ClusterView.choose`). The clock is injected so that the
rules can be tested without sleeping.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from gateway import metrics

logger = logging.getLogger(__name__)


@dataclass
class _Record:
    consecutive: int = 0
    ejections: int = 0  # earlier ejections still remembered (the next one lasts 2**ejections times longer)
    ejected_until: float = 0.0
    went_down: asyncio.Event = field(default_factory=asyncio.Event)  # set while the probe finds it down

    @property
    def down(self) -> bool:
        return self.went_down.is_set()


class OutlierDetector:
    """Per worker id: failures in a row, ejections, and the probe's verdict.

    Args:
        consecutive_failures: failures in a row that eject a worker (>= 1).
        base_ejection_s: seconds of a first ejection (> 0).
        max_ejection_s: seconds of an ejection at most (>= ``base_ejection_s``).
        clock: monotonic seconds.

    Raises:
        ValueError: a value out of range, naming it.
    """

    def __init__(self, consecutive_failures: int, base_ejection_s: float, max_ejection_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if consecutive_failures < 1:
            raise ValueError(f"consecutive_failures must be >= 1, got {consecutive_failures}")
        if base_ejection_s <= 0:
            raise ValueError(f"base_ejection_s must be > 0, got {base_ejection_s}")
        if max_ejection_s < base_ejection_s:
            raise ValueError(f"max_ejection_s must be >= base_ejection_s ({base_ejection_s}), got {max_ejection_s}")
        self.consecutive_failures = consecutive_failures
        self.base_ejection_s = base_ejection_s
        self.max_ejection_s = max_ejection_s
        self._clock = clock
        self._records: dict[str, _Record] = {}
        # Read when scraped, so that an ejection that lapsed is not reported still standing.
        metrics.AVOIDED_WORKERS.labels("down").set_function(lambda: len(self.avoided()[0]))
        metrics.AVOIDED_WORKERS.labels("ejected").set_function(lambda: len(self.avoided()[1]))

    def failure(self, worker_id: str) -> bool:
        """A call to ``worker_id`` failed; True when this failure ejected it."""
        record = self._records.setdefault(worker_id, _Record())
        now = self._clock()
        if now < record.ejected_until:
            return False  # calls sent before the ejection still fail: the ejection stands as it is
        record.consecutive += 1
        if record.consecutive < self.consecutive_failures:
            return False
        if record.ejections and now - record.ejected_until >= self.max_ejection_s:
            record.ejections = 0  # long enough without trouble: start again from the base time
        duration = min(self.base_ejection_s * 2 ** record.ejections, self.max_ejection_s)
        record.ejected_until, record.ejections, record.consecutive = now + duration, record.ejections + 1, 0
        logger.warning("ejecting worker %s from routing for %.1f s after %d failures in a row", worker_id, duration,
                       self.consecutive_failures)
        return True

    def success(self, worker_id: str) -> None:
        """A call to ``worker_id`` succeeded: its run of failures ends."""
        record = self._records.get(worker_id)
        if record is not None:
            record.consecutive = 0

    def probe_failed(self, worker_id: str) -> bool:
        """No SERVING answer from ``worker_id``'s health probe in time; True when it was up until now."""
        record = self._records.setdefault(worker_id, _Record())
        was_up = not record.down
        if was_up:
            record.went_down.set()
        return was_up

    def probe_ok(self, worker_id: str) -> bool:
        """``worker_id`` answered SERVING; True when it was down until now (its ejection ends too)."""
        record = self._records.get(worker_id)
        if record is None or not record.down:
            return False
        record.went_down.clear()
        record.consecutive, record.ejected_until = 0, 0.0
        return True

    def down_signal(self, worker_id: str) -> asyncio.Event:
        """An event set while the health probe finds ``worker_id`` down: a caller waiting on the
        worker can stop waiting as soon as the probe gives its verdict (:mod:`gateway.worker_calls`
        fails a call over this way before its own timeout)."""
        return self._records.setdefault(worker_id, _Record()).went_down

    def avoided(self) -> tuple[frozenset[str], frozenset[str]]:
        """The ids down now and the ids ejected now (a worker may be in both). Safe to call from
        another thread (the metrics server's): it reads a copy of the records."""
        now, records = self._clock(), dict(self._records)
        return (frozenset(w for w, r in records.items() if r.down),
                frozenset(w for w, r in records.items() if now < r.ejected_until))

    def retain(self, worker_ids: Iterable[str]) -> None:
        """Forget every worker not in ``worker_ids`` (it left the registry)."""
        keep = set(worker_ids)
        for worker_id in [w for w in self._records if w not in keep]:
            del self._records[worker_id]
