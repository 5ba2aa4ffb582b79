"""``AsyncEngine``: one ``LLMEngine`` driven by a dedicated thread, used from asyncio.

The engine is not thread-safe, so exactly one thread (the engine thread) touches it: it runs
the step loop and executes every command (add, abort, reserve, free, release, ...) that the
event loop submits through a queue, between two steps. Outputs go back to the event loop into
one queue per request, a whole step's in one ``loop.call_soon_threadsafe``. When there is
nothing to step the thread sleeps on a condition variable (no busy spin) until a command arrives.

On a GPU a step's outputs are handed over while the next step runs on the device
(``LLMEngine.step``'s ``on_launched``), not between the two steps: the event loop's work on
them (a gRPC message per stream) and the engine thread's copies then overlap the device's time
instead of delaying the next step's launch. Both threads share the GIL, and every PyTorch call
of the engine thread releases and retakes it: handed over between steps, one callback per
stream, the outputs of 128 streams made a decode step of a Llama-3-8B shape on an H200 about 1.7
times as long in a worker as offline. The cost is a token's delivery a step's launch later
(about a millisecond). Pending outputs are handed over before
any command runs and before the thread sleeps, so a stream never sees them after what a
command sends it (an abort's final output).

Everything the event loop reads without a round trip (load, block events for the Redis prefix
index) is published by the engine thread as immutable snapshots after each iteration.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

import torch

from engine.block_pool import BlockEvents
from engine.devices import use_device
from engine.distributed import RankFailedError
from engine.llm_engine import LLMEngine
from engine.outputs import CompletionOutput, EngineStats, RequestOutput, StepOutput
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")


class EngineError(RuntimeError):
    """The engine failed while running a request (a step raised); the request was aborted."""


class EngineDeadError(EngineError):
    """The engine cannot step any more (a tensor-parallel rank died): the request was aborted,
    and so is every other; the worker is going away."""


class EngineStoppedError(RuntimeError):
    """The engine thread has shut down; no new work is accepted."""


class BlockEventMirror:
    """Thread-safe copy of the block pool's prefix-cache events and cached set.

    The engine thread ``absorb``s the pool's events after each iteration; the event loop reads
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


class _Stream:
    """One request's outputs, delivered from the engine thread into the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:  # engine thread
        _hand_over([(self, item)])

    async def get(self) -> RequestOutput:
        """The newest output (outputs are cumulative, so older queued ones are skipped)."""
        item = await self.queue.get()
        while not self.queue.empty() and not isinstance(item, BaseException):
            if isinstance(item, RequestOutput) and item.finished:
                break
            item = self.queue.get_nowait()
        if isinstance(item, BaseException):
            raise item
        return item


def _hand_over(items: list[tuple[_Stream, RequestOutput | BaseException]]) -> None:  # engine thread
    """Queue each item on its stream, with one ``call_soon_threadsafe`` per event loop (each wakes
    the loop through its self-pipe: a system call, and a hand-over of the GIL)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput | BaseException]]] = {}
    for stream, item in items:
        by_loop.setdefault(stream.loop, []).append((stream.queue, item))
    for loop, puts in by_loop.items():
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is listening
            loop.call_soon_threadsafe(_put_all, puts)


def _put_all(puts: list[tuple[asyncio.Queue, RequestOutput | BaseException]]) -> None:  # event loop
    for queue, item in puts:
        queue.put_nowait(item)


def _snapshot(out: RequestOutput) -> RequestOutput:
    """A copy the event loop may read while the engine keeps appending to the original (the
    prompt's token ids are shared: the engine never changes them)."""
    samples = [CompletionOutput(c.index, c.text, list(c.token_ids), c.finish_reason, c.stop_reason,
                                list(c.logprobs)) for c in out.outputs]
    return RequestOutput(out.request_id, out.prompt, out.prompt_token_ids, out.num_cached_tokens, samples,
                         out.finished, list(out.pinned_block_ids))


class AsyncEngine:
    """Runs ``engine`` on its own thread; every method is called from one asyncio event loop.

    Args:
        engine: the engine; from now on only the engine thread may touch it.
        name: the thread's name (logs).
        num_threads: PyTorch's intra-op threads for the engine thread (``torch.set_num_threads``,
            set by that thread before :meth:`start` returns); ``None``: the process's setting.
            A process whose other threads run PyTorch ops too should give them one thread
            after :meth:`start` (see ``cluster.worker.run_worker``: why).
        overlap_outputs: hand a step's outputs over while the next step runs (module docstring);
            ``None``: on a GPU (on a CPU a step has run by the time it is launched, so it would
            only delay each token by a step).

    Call :meth:`start` before use and ``await`` :meth:`shutdown` at the end.
    """

    def __init__(self, engine: LLMEngine, name: str = "engine", num_threads: int | None = None,
                 overlap_outputs: bool | None = None) -> None:
        self.engine = engine
        self.num_threads = num_threads
        self.overlap_outputs = engine.device.type == "cuda" if overlap_outputs is None else overlap_outputs
        self.block_size = engine.config.block_size
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.vocab_size
        self.block_events = BlockEventMirror()
        self._cv = threading.Condition()
        self._commands: deque[Callable[[], None]] = deque()
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._pending: list[RequestOutput] = []  # engine thread only: the last step's outputs, not handed over yet
        self._stopping = False
        self._stats = EngineStats()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._threads_set = threading.Event()
        self._publish()

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the engine thread; returns once it has set its thread count."""
        self._thread.start()
        self._threads_set.wait()

    async def shutdown(self) -> None:
        """Abort every request (their streams end with ``finish_reason="abort"``), release pinned
        blocks, stop the thread, and shut the engine down (``LLMEngine.shutdown``)."""
        if not self._thread.is_alive():
            return
        await self.abort_all()
        with self._cv:
            self._stopping = True
            self._cv.notify()
        await asyncio.to_thread(self._thread.join)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    # ------------------------------------------------------------- requests
    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       pin_prompt_blocks: bool = False, release_blocks: list[int] = (),
                       cache_salt: str = "") -> AsyncIterator[RequestOutput]:
        """Run a request; yields its cumulative output each time it gains tokens (or, with
        ``pin_prompt_blocks``, pins more prompt blocks), the last one finished. Closing or
        cancelling the iterator early aborts the request (blocks freed at the engine's next
        iteration), pinned blocks included; after a normal finish, pinned blocks stay until
        :meth:`release`. ``release_blocks`` (a reservation the request replaces) are freed as
        the request is queued, whatever happens (see ``LLMEngine.add_request``, also for
        ``cache_salt``).

        Raises:
            ValueError: bad prompt or duplicate ``request_id`` (nothing was queued).
            EngineError: the engine failed while running the request.
        """
        stream = _Stream(asyncio.get_running_loop())
        hashes = self._block_hashes(prompt_ids, cache_salt)

        def add() -> None:
            self.engine.add_request(request_id, prompt_ids, params, pin_prompt_blocks=pin_prompt_blocks,
                                    release_blocks=release_blocks, cache_salt=cache_salt, block_hashes=hashes)
            self._streams[request_id] = stream

        await self._call_owned(request_id, add)
        async for out in self._follow(request_id, stream):
            yield out

    async def add_prefilled(self, request_id: str, prompt_ids: list[int], first_token_ids: list[int],
                            params: SamplingParams, block_ids: list[int],
                            cache_salt: str = "") -> AsyncIterator[RequestOutput]:
        """Join a request whose prompt KV fills ``block_ids`` to the running batch (see
        ``LLMEngine.add_prefilled_request``); yields its output so far first, then as for
        :meth:`generate`.

        Takes ownership of ``block_ids`` whatever happens: if the engine refuses the request
        they are freed.

        Raises:
            ValueError: wrong number of first tokens or blocks, bad prompt, duplicate id.
        """
        stream = _Stream(asyncio.get_running_loop())
        hashes = self._block_hashes(prompt_ids, cache_salt)

        def add() -> RequestOutput:
            try:
                out = _snapshot(self.engine.add_prefilled_request(request_id, prompt_ids, first_token_ids,
                                                                  params, block_ids, cache_salt, hashes))
            except BaseException:
                self.engine.free_blocks(block_ids)
                raise
            if not out.finished:
                # Queued here, on the engine thread, ahead of every later step's output: put from
                # the event loop, it could land after them and take the stream back a token.
                stream.put(out)
                self._streams[request_id] = stream
            return out

        first = await self._call_owned(request_id, add)
        if first.finished:
            yield first
            return
        async for out in self._follow(request_id, stream):
            yield out

    async def _call_owned(self, request_id: str, fn: Callable[[], T]) -> T:
        # Shielded: a command that takes ownership (of blocks) must run even if we are cancelled
        # while it is queued; the abort queued behind it then undoes it.
        try:
            return await asyncio.shield(asyncio.wrap_future(self._submit(fn)))
        except asyncio.CancelledError:
            self.abort(request_id)  # the command may have run: undo it (FIFO: abort runs after)
            raise

    async def _follow(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                out = await stream.get()
                finished = out.finished
                yield out
                if finished:
                    return
        except EngineError:
            finished = True  # the engine already aborted it
            raise
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> concurrent.futures.Future[bool]:
        """Abort a request wherever it is (queued, running, pinned) and free its blocks; its stream
        ends with ``finish_reason="abort"``. Returns at once (safe in a cancelled task); the
        future says whether the engine knew the request."""
        def abort() -> bool:
            pinned = self.engine.release(request_id)
            out = self.engine.abort_request(request_id)
            self._deliver_final(request_id, out)
            return pinned or out is not None
        return self._submit(abort)

    def fail_all(self, reason: str) -> concurrent.futures.Future[None]:
        """End every request with :class:`EngineDeadError` (``reason``), between two steps, before
        any command submitted after this one (a worker whose engine died: its streams must end
        in failure, which the gateway retries elsewhere, not in a normal abort). Returns at once."""
        return self._submit(lambda: self._fail_all(EngineDeadError(f"the engine is down: {reason}")))

    async def abort_all(self, failure: str | None = None) -> int:
        """Abort every request and release every pin; returns how many requests there were.

        Args:
            failure: the streams end with :class:`EngineDeadError` (``failure``) rather than
                their final output (finish reason ``abort``): a worker whose drain ran out of
                time fails them, and the gateway retries or resumes them elsewhere.
        """
        error = EngineDeadError(failure) if failure is not None else None

        def abort_all() -> int:
            ids = list(self.engine.requests) + list(self.engine.pinned)
            for request_id in ids:
                self.engine.release(request_id)
                out = self.engine.abort_request(request_id)
                if error is None:
                    self._deliver_final(request_id, out)
                elif (stream := self._streams.pop(request_id, None)) is not None:
                    stream.put(error)
            return len(ids)
        return await self.call(abort_all)

    def _deliver_final(self, request_id: str, out: RequestOutput | None) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None and out is not None:
            stream.put(_snapshot(out))

    def _block_hashes(self, prompt_ids: list[int], cache_salt: str) -> list[bytes] | None:
        """The prompt's block hashes (``LLMEngine.block_hashes``), computed on the caller's thread,
        the event loop, while the engine thread runs a step, rather than on the engine thread
        between two steps, where a long prompt's would delay every running stream's next token;
        ``None`` for a prompt the engine refuses (it raises the error naming the field)."""
        try:
            self.engine.validate_prompt(prompt_ids)
        except ValueError:
            return None
        return self.engine.block_hashes(prompt_ids, cache_salt)

    # ------------------------------------------------------- disaggregation
    def release(self, request_id: str) -> concurrent.futures.Future[bool]:
        """Unpin a request's pinned prompt blocks (returns at once, like :meth:`abort`)."""
        return self._submit(lambda: self.engine.release(request_id))

    async def reserve_blocks(self, prompt_ids: list[int], cache_salt: str = "") -> tuple[list[int], int]:
        """Reserve a prompt's blocks for incoming KV (``LLMEngine.reserve_blocks``: cached leading
        blocks reused, headroom for the running batch kept free); ``(block_ids, num_cached)``.

        Raises:
            NoFreeBlocksError: the pool cannot hold them now.
        """
        hashes = self._block_hashes(prompt_ids, cache_salt)
        future = self._submit(lambda: self.engine.reserve_blocks(prompt_ids, cache_salt, hashes))
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            # The caller is gone; if the blocks were (or are being) allocated, give them back.
            def undo(f: concurrent.futures.Future[tuple[list[int], int]]) -> None:
                if not f.cancelled() and f.exception() is None:
                    self.free_blocks(f.result()[0])
            future.add_done_callback(undo)
            raise

    def free_blocks(self, block_ids: list[int]) -> concurrent.futures.Future[None]:
        """Return reserved blocks to the pool (returns at once; usable as a sync callback, e.g.
        ``ReservationTable``'s ``free_blocks``)."""
        ids = list(block_ids)
        return self._submit(lambda: self.engine.free_blocks(ids))

    @property
    def kv_pools(self) -> list:
        """Every rank's KV cache tensor (``LLMEngine.kv_pools``). Only read or write blocks that
        no request of the engine uses (pinned or reserved ones)."""
        return self.engine.kv_pools

    # ---------------------------------------------------------------- stats
    def stats(self) -> EngineStats:
        """The latest snapshot (no round trip to the engine thread)."""
        return self._stats

    async def num_free_blocks(self) -> int:
        """Free blocks after every command queued before this one has run (exact, for tests)."""
        return await self.call(lambda: self.engine.num_free_blocks)

    def _publish(self) -> None:  # engine thread (or before it starts)
        self._stats = self.engine.stats()
        self.block_events.absorb(self.engine.block_pool.drain_events())

    # ------------------------------------------------------- engine thread
    def _submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def command() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 (handed to the caller)
                future.set_exception(exc)

        with self._cv:
            if self._stopping or not self._thread.is_alive() and self._thread.ident is not None:
                future.set_exception(EngineStoppedError("the engine has shut down"))
                return future
            self._commands.append(command)
            self._cv.notify()
        return future

    async def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn()`` on the engine thread between two steps and return its result."""
        return await asyncio.wrap_future(self._submit(fn))

    def _run(self) -> None:
        if self.num_threads is not None:
            torch.set_num_threads(self.num_threads)
            # PyTorch fixes a thread's count at its first query, from the process-wide default:
            # query now, before another thread changes that default.
            torch.get_num_threads()
        self._threads_set.set()
        use_device(self.engine.device)
        overlap = self.overlap_outputs
        stalled = False

        def idle() -> bool:  # (called holding self._cv)
            return not self._commands and not self._stopping and (stalled or not self.engine.has_unfinished_requests)

        while True:
            with self._cv:
                sleeping = idle()
            if sleeping:
                self._hand_over_pending()
            with self._cv:
                while idle():
                    self._cv.wait()
                commands, self._commands = self._commands, deque()
                stopping = self._stopping
            if commands or stopping:
                self._hand_over_pending()
            for command in commands:
                command()
            if stopping and not commands:
                self._publish()
                self.engine.shutdown()
                return
            if commands:
                stalled = False
            if self.engine.has_unfinished_requests and not stalled:
                try:
                    step = self.engine.step(self._hand_over_pending if overlap else None)
                except RankFailedError as exc:
                    logger.error("engine step failed (%s); aborting %d requests", exc, len(self.engine.requests))
                    self._hand_over_pending()
                    self._fail_all(EngineDeadError(f"the engine is down: {exc}"))
                    step = StepOutput([], True)
                except Exception as exc:  # noqa: BLE001 (fails the requests, not the thread)
                    logger.exception("engine step failed; aborting %d requests", len(self.engine.requests))
                    self._hand_over_pending()
                    self._fail_all(EngineError(f"engine step failed: {type(exc).__name__}: {exc}"))
                    step = StepOutput([], True)
                self._hand_over_pending()  # (still pending where the step launched nothing: nothing scheduled)
                self._pending = step.outputs
                if not overlap:
                    self._hand_over_pending()
                # Nothing could be scheduled (e.g. waiting sequences need blocks that reservations
                # or pins own): sleep until a command changes something.
                stalled = not step.model_executed
            self._publish()

    def _hand_over_pending(self) -> None:  # engine thread
        """Hand the last step's outputs (``self._pending``) to their streams."""
        items = []
        for out in self._pending:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                items.append((stream, _snapshot(out)))
                if out.finished:
                    del self._streams[out.request_id]
        self._pending = []
        if items:
            _hand_over(items)

    def _fail_all(self, error: EngineError) -> None:
        for request_id in list(self.engine.requests):
            try:
                self.engine.abort_request(request_id)
            except Exception:  # noqa: BLE001
                logger.exception("aborting %s after a failed step failed too", request_id)
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.put(error)
