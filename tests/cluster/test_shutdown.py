"""The bounds on a server's shutdown: a close step that never finishes is cancelled, logged by
name, and the shutdown goes on; a process whose shutdown hangs anyway is ended by the watchdog
with its threads' tracebacks on stderr."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from cluster.shutdown import shutdown_step

ROOT = Path(__file__).resolve().parents[2]


def test_a_stuck_step_is_cancelled_and_named_and_the_next_one_runs(caplog) -> None:
    done, cancelled = [], asyncio.Event()

    async def stuck() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def finishes() -> None:
        done.append("closed")

    async def main() -> float:
        started = time.monotonic()
        await shutdown_step("closing a stuck thing", stuck(), timeout_s=0.2)
        await shutdown_step("closing the next thing", finishes(), timeout_s=0.2)
        return time.monotonic() - started

    with caplog.at_level(logging.ERROR, logger="cluster.shutdown"):
        elapsed = asyncio.run(asyncio.wait_for(main(), 10))
    assert elapsed < 2.0 and cancelled.is_set() and done == ["closed"]
    assert [r.getMessage() for r in caplog.records] == [
        "shutdown: closing a stuck thing did not finish within 0.2 s; going on without it"]


def test_the_watchdog_ends_a_hung_process_with_its_tracebacks() -> None:
    program = textwrap.dedent("""
        import threading, time
        from cluster.shutdown import SHUTDOWN_OVERRUN_S, exit_if_shutdown_hangs
        exit_if_shutdown_hangs(0.5 - SHUTDOWN_OVERRUN_S)
        threading.Thread(target=time.sleep, args=(60,), name="stuck-engine").start()  # not a daemon
        time.sleep(60)
    """)
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1, proc
    assert time.monotonic() - started < 20
    assert proc.stderr.count("most recent call first") == 2, proc.stderr  # the main thread and the stuck one
