"""PeriodicTask: steps on its interval, survives a failing step, and its stop always ends it."""

from __future__ import annotations

import asyncio
import logging

import pytest

from cluster.periodic import PeriodicTask


def test_steps_repeat_after_the_first_delay_and_survive_a_failing_step(caplog):
    async def main():
        calls = []

        async def step():
            calls.append(asyncio.get_running_loop().time())
            if len(calls) == 2:
                raise RuntimeError("one bad round")

        loop = PeriodicTask(step, 0.02, "ticker", first_after_s=0.2)
        start = asyncio.get_running_loop().time()
        loop.start()
        await asyncio.sleep(0.1)
        assert calls == []  # first_after_s not yet over
        while len(calls) < 4:
            await asyncio.sleep(0.01)
        await loop.stop()
        assert calls[0] - start >= 0.2
        assert all(later - earlier >= 0.02 for earlier, later in zip(calls, calls[1:]))
        assert not loop.running

    with caplog.at_level(logging.ERROR, logger="cluster.periodic"):
        asyncio.run(main())
    assert "ticker: step failed" in caplog.text


def test_stop_ends_a_loop_whose_step_swallows_the_cancellation():
    """What Python 3.11's asyncio.wait_for does inside a redis-py command now and then (CPython
    gh-86296): the cancellation meant for the loop is caught and dropped, the step returns."""

    async def main():
        steps_started = 0
        in_step = asyncio.Event()

        async def step():
            nonlocal steps_started
            steps_started += 1
            in_step.set()
            if steps_started > 1:
                return
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                asyncio.current_task().uncancel()  # dropped, as wait_for does

        loop = PeriodicTask(step, 0.001, "swallower")
        loop.start()
        await in_step.wait()
        async with asyncio.timeout(5):
            await loop.stop()
        assert not loop.running
        assert steps_started == 1  # no step after the stop
        await loop.stop()  # idempotent

    asyncio.run(main())


def test_stop_before_start_and_bad_intervals():
    async def main():
        async def step():
            pass

        await PeriodicTask(step, 1.0, "never started").stop()
        loop = PeriodicTask(step, 1.0, "twice")
        loop.start()
        with pytest.raises(RuntimeError, match="already started"):
            loop.start()
        await loop.stop()

    asyncio.run(main())
    with pytest.raises(ValueError, match="interval_s"):
        PeriodicTask(lambda: None, 0, "zero")
    with pytest.raises(ValueError, match="first_after_s"):
        PeriodicTask(lambda: None, 1.0, "negative", first_after_s=-1)
