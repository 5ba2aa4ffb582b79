"""The result records under ``bench/results/<benchmark>/``, read back for the published tables.

A record is one JSON object with the keys ``benchmark``, ``model``, ``gpu`` or ``machine``,
``date``, ``versions``, ``workload`` and ``metrics`` (a flat name → number map;
``bench/common.py`` writes them). Older files may lack some; :func:`load` handles them so:

- a file that is not one JSON object with ``benchmark`` and ``metrics`` (the kernel tuning
  sweep, a list of rows) is skipped;
- ``date`` missing: read from the file name's UTC time (``YYYYMMDDTHHMMSSZ`` or ``YYYY-MM-DD``);
  a record with neither is skipped;
- ``model`` missing: ``"-"`` (the kernel benchmarks time shapes, not a model);
- ``gpu`` and ``machine`` missing: ``"unknown"``; ``workload`` missing: empty;
- non-numeric metrics (a stray string or ``null``) are dropped.

Records whose file name marks them as the code before a change (the losing side of an A/B run,
:data:`NOT_CURRENT`) measure code that is not in the tree, and are skipped.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

# Words of a result file's tag that name the side of an A/B run measuring code that was not kept:
# the code before the change ("before", "old", "base", "committed") and variants that were tried
# and dropped (a 16-counts-per-doubling ladder, 100 and 50 µs NIXL completion polls).
NOT_CURRENT = frozenset({"before", "old", "base", "committed", "ladder16", "poll100us", "poll50us"})

_STAMP = re.compile(r"(\d{4})(\d{2})(\d{2})T(\d{2})(\d{2})(\d{2})Z")
_DAY = re.compile(r"(\d{4})-(\d{2})-(\d{2})")


@dataclass(frozen=True)
class Record:
    """One run's record.

    Attributes:
        path: the file, relative to the repository's root.
        date: ISO 8601 UTC (``2026-11-28T17:40:17+00:00``), comparable as text.
        device: the record's ``gpu`` (e.g. ``"NVIDIA H200 x2"``) or ``machine`` (a CPU host).
    """

    path: Path
    benchmark: str
    model: str
    device: str
    date: str
    workload: dict = field(hash=False)
    metrics: dict[str, float] = field(hash=False)

    @property
    def day(self) -> str:
        """``YYYY-MM-DD``."""
        return self.date[:10]


def _date_from_name(name: str) -> str | None:
    if match := _STAMP.search(name):
        y, mo, d, h, mi, s = match.groups()
        return f"{y}-{mo}-{d}T{h}:{mi}:{s}+00:00"
    if match := _DAY.search(name):
        return f"{match[0]}T00:00:00+00:00"
    return None


def is_current(path: Path) -> bool:
    """False for a file whose tag marks the code before a change (:data:`NOT_CURRENT`)."""
    return not NOT_CURRENT & set(path.stem.split("-"))


def parse(path: Path, root: Path) -> Record | None:
    """The record in ``path`` (``None`` where the module docstring says it is skipped)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or "benchmark" not in data or not isinstance(data.get("metrics"), dict):
        return None
    date = data.get("date") or _date_from_name(path.name)
    if date is None:
        return None
    metrics = {k: float(v) for k, v in data["metrics"].items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return Record(path=path.relative_to(root), benchmark=data["benchmark"], model=data.get("model") or "-",
                  device=data.get("gpu") or data.get("machine") or "unknown", date=date,
                  workload=data.get("workload") or {}, metrics=metrics)


def load(results: Path, root: Path) -> list[Record]:
    """Every current record under ``results`` (``results/<benchmark>/*.json``), by path.

    Args:
        results: the results folder (``bench/results``).
        root: the repository's root, which record paths are relative to.
    """
    paths = sorted(p for p in results.glob("*/*.json") if is_current(p))
    return [record for record in (parse(p, root) for p in paths) if record is not None]


def newest(records: Iterable[Record], key: Callable[[Record], Hashable]) -> dict[Hashable, Record]:
    """The newest record (by ``date``, then path) of each ``key``."""
    best: dict[Hashable, Record] = {}
    for record in records:
        k = key(record)
        if k not in best or (record.date, str(record.path)) > (best[k].date, str(best[k].path)):
            best[k] = record
    return best
