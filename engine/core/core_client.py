"""``EngineCoreClient``: a worker's front end's handle on its engine core (vLLM v1's
``AsyncMPClient``), used from one asyncio event loop.

The engine core runs in a process of its own (:meth:`EngineCoreClient.spawn`, the worker's
case) or, embedded, on a thread of this process (:meth:`EngineCoreClient.embed`: tests,
benchmarks); either way the two sides talk through the same ZeroMQ sockets and msgspec
messages (:mod:`engine.core.messages`), and the same busy loop (:class:`engine.core.core_proc.EngineCoreProc`)
steps the same :class:`~engine.core.engine_core.EngineCore`.

The KV pools belong to the process that moves their blocks to and from other workers: this one.
A spawned engine core asks for them at start-up; the client allocates every rank's pool on its
device (:func:`engine.parallel.shared_memory.allocate_shared`: CUDA IPC, or a shared file on the
CPU) and keeps it, the engine core and its tensor-parallel ranks map them and compute into
them. So a KV transfer that arrives over gRPC reaches the pool here, with no hop to another
process (docs/architecture.md, "Processes").

Outputs arrive as deltas; each request's :class:`~engine.outputs.RequestOutput` is accumulated
here, on the event loop, and handed to its consumer as it grows. Everything the worker reads
without a round trip (load, prefix-cache events for the Redis index) comes with them.

An engine core that exits, or whose busy loop is stuck inside one iteration for
``hang_timeout_s``, or that sends nothing at all for that long (a frozen process), is dead:
every request fails with :class:`EngineDeadError`, the process is killed, and the callbacks of
:meth:`on_death` run (a worker stops itself; the gateway's failover takes its requests elsewhere).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import msgspec
import torch
import zmq
import zmq.asyncio

from engine.block_hash import hash_blocks, salted_seed
from engine.config import NVLINK_MULTICAST_OFF, EngineConfig
from engine.core.block_events import BlockEventMirror
from engine.core.block_pool import BlockEvents, NoFreeBlocksError
from engine.core.core_proc import HEARTBEAT_S, EngineCoreProc
from engine.core.engine_core import EngineCore
from engine.core.messages import (
    AddPrefilledRequest, AddRequest, AllocatePools, Call, EngineInfo, Heartbeat, Output, Outputs, PoolHandles,
    Ready, Reply, RequestDelta, RequestFailed, Shutdown, StartupFailed,
)
from engine.outputs import CompletionOutput, EngineStats, RequestOutput
from engine.parallel.shared_memory import allocate_shared, release_handle
from engine.runner.devices import KV_POOL_DTYPES
from engine.sampling_params import SamplingParams
from engine.validation import check_prompt

logger = logging.getLogger(__name__)

# How long a spawned engine core may take to start (loading a model on a busy host included).
STARTUP_TIMEOUT_S = 900.0
# How long the engine core gets to exit after a shutdown before it is killed.
EXIT_TIMEOUT_S = 30.0
_PROJECT_ROOT = str(Path(__file__).resolve().parents[2])


class EngineError(RuntimeError):
    """The engine failed while running a request (a step raised); the request was aborted."""


class EngineDeadError(EngineError):
    """The engine cannot step any more (its process died or hung, or a tensor-parallel rank
    died): the request was aborted, and so is every other; the worker is going away."""


class EngineStoppedError(RuntimeError):
    """The engine core has shut down; no new work is accepted."""


_ERRORS = {"ValueError": ValueError, "NoFreeBlocksError": NoFreeBlocksError, "KeyError": KeyError}


class _Stream:
    """One request's output, accumulated from its deltas on the event loop."""

    def __init__(self, output: RequestOutput) -> None:
        self.output = output
        self.changed = asyncio.Event()
        self.error: BaseException | None = None

    def apply(self, delta: RequestDelta) -> None:
        out = self.output
        for sample in delta.samples:
            c = out.outputs[sample.index]
            c.token_ids.extend(sample.token_ids)
            c.logprobs.extend(sample.logprobs)
            c.finish_reason, c.stop_reason = sample.finish_reason, sample.stop_reason
        out.num_cached_tokens = delta.num_cached_tokens
        out.pinned_block_ids.extend(delta.pinned_block_ids)
        out.finished = delta.finished
        self.changed.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.changed.set()


class EngineCoreClient:
    """Requests to an engine core and its outputs, from one asyncio event loop.

    Do not construct it: :meth:`spawn` or :meth:`embed` does, then call :meth:`shutdown` at
    the end.

    Attributes:
        info: the engine's settings (:class:`~engine.core.messages.EngineInfo`).
        kv_pools: every rank's KV cache tensor, in rank order, in this process: only read or
            write blocks that no request of the engine uses (pinned or reserved ones).
        block_events: the prefix cache's events and cached set (what the worker's heartbeat
            publishes to the Redis prefix index).
    """

    def __init__(self, info: EngineInfo, kv_pools: list[torch.Tensor], context: zmq.asyncio.Context,
                 input_socket: zmq.Socket, output_socket: zmq.asyncio.Socket, hang_timeout_s: float,
                 process: subprocess.Popen | None = None, thread: threading.Thread | None = None,
                 socket_dir: tempfile.TemporaryDirectory | None = None) -> None:
        self.info = info
        self.kv_pools = kv_pools
        self.block_events = BlockEventMirror()
        self.hang_timeout_s = hang_timeout_s
        self._context, self._input, self._output = context, input_socket, output_socket
        self._process, self._thread, self._socket_dir = process, thread, socket_dir
        self._encoder = msgspec.msgpack.Encoder()
        self._send_lock = threading.Lock()
        self._streams: dict[str, _Stream] = {}
        # Requests whose consumer left before their end, until the engine core has aborted them:
        # what still comes for them is theirs, not a later request's of the same id.
        self._closing: dict[str, int] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count(1)
        self._stats = EngineStats(num_total_blocks=info.num_blocks, num_free_blocks=info.num_blocks)
        self._dead: str | None = None
        self._stopping = False
        self._death_callbacks: list[Callable[[str], None]] = []
        self._last_message = time.monotonic()
        self._loop = asyncio.get_running_loop()
        self._tasks = [self._loop.create_task(self._read()), self._loop.create_task(self._watch_hang())]
        if process is not None:
            threading.Thread(target=self._watch_exit, name="engine-core-watch", daemon=True).start()

    # ------------------------------------------------------------- start-up
    @classmethod
    async def spawn(cls, model: str | dict | None, config: EngineConfig, load_format: str = "auto",
                    num_threads: int | None = None, hang_timeout_s: float = 60.0) -> EngineCoreClient:
        """Start an engine core process for ``model`` and wait until it is ready.

        Args:
            model, config, load_format: as :class:`~engine.core.engine_core.EngineCore`'s.
            num_threads: PyTorch's intra-op threads in the engine core (``None``: its default).
            hang_timeout_s: seconds one iteration of its busy loop may take before it is
                declared hung (a step; a long prompt chunk on a CPU takes seconds).

        Raises:
            ValueError: a bad model or setting (the engine's own message).
            RuntimeError: the process exited while starting, or did not start within
                ``STARTUP_TIMEOUT_S``.
        """
        socket_dir = tempfile.TemporaryDirectory(prefix="tandem-core-")
        context = zmq.asyncio.Context()
        input_address, output_address = (f"ipc://{socket_dir.name}/{name}" for name in ("input", "output"))
        input_socket = context.socket(zmq.PUSH, socket_class=zmq.Socket)
        input_socket.bind(input_address)
        output_socket = context.socket(zmq.PULL)
        output_socket.bind(output_address)
        device = torch.device(str(config.device)) if config.device not in ("auto",) else None
        if torch.cuda.is_available() and (device is None or device.type == "cuda"):
            torch.zeros(1, device=device or "cuda")  # this process's context exists before the core sizes its cache
        spec = {"model": model, "config": dataclasses.asdict(config), "load_format": load_format,
                "input": input_address, "output": output_address, "num_threads": num_threads,
                "log_level": logging.getLevelName(logging.getLogger().getEffectiveLevel())}
        pythonpath = os.pathsep.join(p for p in (_PROJECT_ROOT, os.environ.get("PYTHONPATH", "")) if p)
        process = subprocess.Popen([sys.executable, "-m", "engine.core.core_proc", json.dumps(spec)],
                                   env={**NVLINK_MULTICAST_OFF, **os.environ, "PYTHONPATH": pythonpath},
                                   stdin=subprocess.DEVNULL)
        decoder = msgspec.msgpack.Decoder(Output)
        pools, handles = [], []
        try:
            while True:
                frame = await _receive_or_exit(output_socket, process, STARTUP_TIMEOUT_S)
                message = decoder.decode(frame)
                if isinstance(message, AllocatePools):
                    dtype = KV_POOL_DTYPES[message.dtype]
                    for device_name in message.devices:
                        pool, handle = allocate_shared(tuple(message.shape), dtype, torch.device(device_name))
                        pools.append(pool)
                        handles.append(handle)
                    input_socket.send(msgspec.msgpack.encode(PoolHandles(handles)))
                elif isinstance(message, StartupFailed):
                    raise _ERRORS.get(message.error_type, RuntimeError)(message.error)
                elif isinstance(message, Ready):
                    break
        except BaseException:
            _kill(process)
            input_socket.close(linger=0)
            output_socket.close(linger=0)
            context.term()
            socket_dir.cleanup()
            raise
        finally:
            for handle in handles:
                release_handle(handle)  # every process that maps it has (or never will)
        return cls(message.info, pools, context, input_socket, output_socket, hang_timeout_s, process=process,
                   socket_dir=socket_dir)

    @classmethod
    async def embed(cls, core: EngineCore, num_threads: int | None = None,
                    hang_timeout_s: float = 60.0) -> EngineCoreClient:
        """Run ``core``'s busy loop on a thread of this process (it owns ``core`` from now on).

        Args:
            num_threads: PyTorch's intra-op threads of the loop's thread (``None``: as they are).
        """
        context = zmq.asyncio.Context()
        name = f"inproc://engine-core-{id(core)}-{time.monotonic_ns()}"
        input_socket = context.socket(zmq.PUSH, socket_class=zmq.Socket)
        input_socket.bind(f"{name}-input")
        output_socket = context.socket(zmq.PULL)
        output_socket.bind(f"{name}-output")
        core_input = context.socket(zmq.PULL, socket_class=zmq.Socket)
        core_input.connect(f"{name}-input")
        core_output = context.socket(zmq.PUSH, socket_class=zmq.Socket)
        core_output.connect(f"{name}-output")

        def run() -> None:
            try:
                EngineCoreProc(core, core_input, core_output, num_threads).run()
            finally:
                core_input.close(linger=0)
                core_output.close()

        thread = threading.Thread(target=run, name="engine-core", daemon=True)
        thread.start()
        message = msgspec.msgpack.Decoder(Output).decode(await output_socket.recv())
        assert isinstance(message, Ready), message
        return cls(message.info, list(core.kv_pools), context, input_socket, output_socket, hang_timeout_s,
                   thread=thread)

    # -------------------------------------------------------------- lifecycle
    def on_death(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(reason)`` on the event loop when the engine core dies or hangs."""
        self._death_callbacks.append(callback)

    @property
    def is_running(self) -> bool:
        return self._dead is None and not self._stopping

    async def shutdown(self) -> None:
        """Abort every request (their streams end with ``finish_reason="abort"``), release pinned
        blocks, stop the engine core (and its tensor-parallel ranks) and close the sockets.
        Idempotent."""
        if self._stopping:
            return
        if self._dead is None:
            with contextlib.suppress(EngineError, EngineStoppedError):
                await self.abort_all()
            self._send(Shutdown())
        self._stopping = True
        if self._process is not None:
            try:
                await asyncio.wait_for(asyncio.to_thread(self._process.wait), EXIT_TIMEOUT_S)
            except asyncio.TimeoutError:
                logger.warning("the engine core (pid %d) did not exit: killing it", self._process.pid)
                _kill(self._process)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._context.term()
        if self._socket_dir is not None:
            self._socket_dir.cleanup()
        self._fail_waiting(EngineStoppedError("the engine has shut down"))

    # -------------------------------------------------------------- requests
    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       pin_prompt_blocks: bool = False, release_blocks: list[int] = (),
                       cache_salt: str = "") -> AsyncIterator[RequestOutput]:
        """Run a request; yields its cumulative output each time it gains tokens (or, with
        ``pin_prompt_blocks``, pins more prompt blocks), the last one finished. The same object
        is yielded each time, updated in place. Closing or cancelling the iterator early aborts
        the request (blocks freed at the engine's next iteration), pinned blocks included; after
        a normal finish, pinned blocks stay until :meth:`release`. ``release_blocks`` (a
        reservation the request replaces) are freed as the request is queued, whatever happens
        (see ``EngineCore.add_request``, also for ``cache_salt``).

        Raises:
            ValueError: bad prompt or duplicate ``request_id`` (nothing was queued).
            EngineError: the engine failed while running the request.
        """
        stream = self._open(request_id, prompt_ids, params)
        self._send(AddRequest(request_id, list(prompt_ids), params, pin_prompt_blocks, list(release_blocks),
                              cache_salt, self._block_hashes(prompt_ids, cache_salt)))
        async for out in self._follow(request_id, stream):
            yield out

    async def add_prefilled(self, request_id: str, prompt_ids: list[int], first_token_ids: list[int],
                            params: SamplingParams, block_ids: list[int],
                            cache_salt: str = "") -> AsyncIterator[RequestOutput]:
        """Join a request whose prompt KV fills ``block_ids`` to the running batch (see
        ``EngineCore.add_prefilled_request``); yields its output so far first, then as for
        :meth:`generate`. Takes ownership of ``block_ids`` whatever happens: if the engine
        refuses the request they are freed.

        Raises:
            ValueError: wrong number of first tokens or blocks, bad prompt, duplicate id.
        """
        try:
            stream = self._open(request_id, prompt_ids, params)
        except BaseException:
            self.free_blocks(block_ids)
            raise
        self._send(AddPrefilledRequest(request_id, list(prompt_ids), list(first_token_ids), params, list(block_ids),
                                       cache_salt, self._block_hashes(prompt_ids, cache_salt)))
        async for out in self._follow(request_id, stream):
            yield out

    def _open(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> _Stream:
        self._check_running()
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        stream = _Stream(RequestOutput(request_id, None, list(prompt_ids), 0,
                                       [CompletionOutput(i) for i in range(params.n)], False))
        self._streams[request_id] = stream
        return stream

    async def _follow(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                await stream.changed.wait()
                stream.changed.clear()
                if stream.error is not None:
                    finished = True  # the engine already ended it
                    raise stream.error
                finished = stream.output.finished
                yield stream.output
                if finished:
                    return
        finally:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
            if not finished:
                self._abandon(request_id)

    def _abandon(self, request_id: str) -> None:
        """Abort a request whose consumer has left, and drop what comes for it until the engine
        core confirms (its replies follow the request's last output)."""
        self._closing[request_id] = self._closing.get(request_id, 0) + 1

        def closed(_: asyncio.Future) -> None:
            if self._closing[request_id] == 1:
                del self._closing[request_id]
            else:
                self._closing[request_id] -= 1

        self.abort(request_id).add_done_callback(closed)

    def _block_hashes(self, prompt_ids: list[int], cache_salt: str) -> list[bytes] | None:
        """The prompt's block hashes, computed here, on the event loop, while the engine core
        runs a step, rather than there between two steps, where a long prompt's would delay every
        running stream's next token; ``None`` for a prompt the engine refuses (it answers with
        the error naming the field)."""
        info = self.info
        try:
            check_prompt(prompt_ids, info.max_model_len, info.vocab_size)
        except ValueError:
            return None
        return hash_blocks(list(prompt_ids), info.block_size, salted_seed(info.hash_seed, cache_salt))

    def abort(self, request_id: str) -> asyncio.Future[bool]:
        """Abort a request wherever it is (queued, running, pinned) and free its blocks; its stream
        ends with ``finish_reason="abort"``. Returns at once (safe in a cancelled task); the
        future says whether the engine knew the request."""
        return self._call("abort", request_id)

    def release(self, request_id: str) -> asyncio.Future[bool]:
        """Unpin a request's pinned prompt blocks (returns at once, like :meth:`abort`)."""
        return self._call("release", request_id)

    async def reserve_blocks(self, prompt_ids: list[int], cache_salt: str = "",
                             params: SamplingParams | None = None) -> tuple[list[int], int]:
        """Reserve a prompt's blocks for incoming KV (``EngineCore.reserve_blocks``: cached leading
        blocks reused, headroom for the running batch kept free, ``params`` checked first);
        ``(block_ids, num_cached)``. A caller cancelled meanwhile gives the blocks back when
        they come.

        Raises:
            NoFreeBlocksError: the pool cannot hold them now.
            ValueError: the engine refuses ``params`` (the message names the field).
        """
        future = self._call("reserve_blocks", list(prompt_ids), cache_salt, self._block_hashes(prompt_ids, cache_salt),
                            params)
        try:
            block_ids, num_cached = await asyncio.shield(future)
        except asyncio.CancelledError:
            def undo(f: asyncio.Future) -> None:
                if not f.cancelled() and f.exception() is None:
                    self.free_blocks(f.result()[0])
            future.add_done_callback(undo)
            raise
        return block_ids, num_cached

    def free_blocks(self, block_ids: list[int]) -> None:
        """Return reserved blocks to the pool (returns at once; usable as a sync callback, e.g.
        ``ReservationTable``'s ``free_blocks``, from any thread)."""
        if self.is_running:
            self._send(Call(0, "free_blocks", [list(block_ids)]))

    async def abort_all(self, failure: str | None = None) -> int:
        """Abort every request and release every pin; returns how many requests there were.

        Args:
            failure: the streams end with :class:`EngineDeadError` (``failure``) rather than
                their final output (finish reason ``abort``): a worker whose drain ran out of
                time fails them, and the gateway retries or resumes them elsewhere.
        """
        return await self._call("abort_all", failure)

    def fail_all(self, reason: str) -> asyncio.Future[None]:
        """End every request with :class:`EngineDeadError` (``reason``), before any command sent
        after this one (a worker whose engine died: its streams must end in failure, which the
        gateway retries elsewhere, not in a normal abort). Returns at once."""
        if self._dead is not None:
            future = self._loop.create_future()
            future.set_result(None)
            return future
        return self._call("fail_all", f"the engine is down: {reason}")

    # ------------------------------------------------------------------ stats
    def stats(self) -> EngineStats:
        """The latest snapshot (no round trip to the engine core)."""
        return self._stats

    async def num_free_blocks(self) -> int:
        """Free blocks after every request sent before this one has run (exact, for tests)."""
        return await self._call("num_free_blocks")

    # ---------------------------------------------------------------- sockets
    def _check_running(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if self._stopping:
            raise EngineStoppedError("the engine has shut down")

    def _send(self, message) -> None:
        frame = self._encoder.encode(message)
        with self._send_lock:
            self._input.send(frame, copy=False)

    def _call(self, method: str, *args) -> asyncio.Future:
        future = self._loop.create_future()
        try:
            self._check_running()
        except (EngineError, EngineStoppedError) as exc:
            future.set_exception(exc)
            return future
        call_id = next(self._call_ids)
        self._calls[call_id] = future
        self._send(Call(call_id, method, list(args)))
        return future

    async def _read(self) -> None:
        decoder = msgspec.msgpack.Decoder(Output)
        while True:
            message = decoder.decode(await self._output.recv())
            self._last_message = time.monotonic()
            if isinstance(message, Outputs):
                self._deliver(message)
            elif isinstance(message, Reply):
                future = self._calls.pop(message.call_id, None)
                if future is None or future.done():
                    continue
                if message.error_type is None:
                    future.set_result(message.value)
                else:
                    future.set_exception(_ERRORS.get(message.error_type, RuntimeError)(message.error))
            elif isinstance(message, Heartbeat) and message.stalled_s > self.hang_timeout_s:
                self._declare_dead(f"the engine core's loop has been stuck for {message.stalled_s:.0f} s")

    def _deliver(self, message: Outputs) -> None:
        for delta in message.deltas:
            stream = self._streams.get(delta.request_id)
            if stream is None or delta.request_id in self._closing:
                continue
            if isinstance(delta, RequestFailed):
                del self._streams[delta.request_id]
                error = {"invalid": ValueError, "failed": EngineError, "dead": EngineDeadError}[delta.kind]
                stream.fail(error(delta.message))
            else:
                stream.apply(delta)
                if delta.finished:
                    del self._streams[delta.request_id]
        self._stats = message.stats
        self.block_events.absorb(BlockEvents(message.stored, message.removed))

    async def _watch_hang(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            silent = time.monotonic() - self._last_message
            if silent > self.hang_timeout_s:
                self._declare_dead(f"the engine core has sent nothing for {silent:.0f} s")

    def _watch_exit(self) -> None:  # a thread of its own
        code = self._process.wait()
        if not self._stopping:
            with contextlib.suppress(RuntimeError):  # the loop has closed
                self._loop.call_soon_threadsafe(self._declare_dead, f"the engine core exited with code {code}")

    def _declare_dead(self, reason: str) -> None:
        if self._dead is not None or self._stopping:
            return
        self._dead = reason
        logger.error("%s: the engine is down", reason)
        if self._process is not None:
            _kill(self._process)
        self._fail_waiting(EngineDeadError(f"the engine is down: {reason}"))
        for callback in self._death_callbacks:
            callback(reason)

    def _fail_waiting(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream.fail(error)
        self._streams.clear()
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)
        self._calls.clear()


async def _receive_or_exit(socket: zmq.asyncio.Socket, process: subprocess.Popen, timeout_s: float) -> bytes:
    """The next frame on ``socket``, unless ``process`` exits first or ``timeout_s`` passes.

    Raises:
        RuntimeError: the process exited, or nothing came in time.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if await socket.poll(250):
            return await socket.recv()
        if process.poll() is not None:
            raise RuntimeError(f"the engine core exited with code {process.returncode} while starting")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the engine core did not start within {timeout_s:.0f} s")


def _kill(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
        process.wait()
