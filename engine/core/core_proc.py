"""A worker's engine core on its own: ``EngineCoreProc`` runs an :class:`EngineCore`'s busy loop
between two ZeroMQ sockets (vLLM v1's ``EngineCoreProc``), in a process of its own
(``python -m engine.core.core_proc SPEC``, started by :class:`engine.core.core_client.EngineCoreClient`)
or, embedded, on a thread.

Three threads share the work, so that the busy loop never waits on a socket: an input thread
decodes the front end's requests (:mod:`engine.core.messages`) into a queue, the busy loop takes
them between two steps and steps the engine, and an output thread encodes what each iteration
produced and sends it, and sends a :class:`~engine.core.messages.Heartbeat` every ``HEARTBEAT_S``
meanwhile (how the front end tells a hung loop from an idle one). With nothing to step the loop
blocks on the queue: an idle engine core costs no CPU.

A step that fails aborts the requests it ran, which end with ``RequestFailed("failed")``; a
tensor-parallel rank's death ends every request with ``RequestFailed("dead")`` and the process
(exit status 1). The process ignores SIGINT and SIGTERM (its worker drains, then tells it to
stop) and exits at once if its worker dies.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence

import msgspec
import torch
import zmq

from engine.config import EngineConfig
from engine.core.block_pool import NoFreeBlocksError
from engine.core.engine_core import EngineCore
from engine.core.messages import (
    AddPrefilledRequest, AddRequest, AllocatePools, Call, EngineInfo, Heartbeat, Output, Outputs, PoolHandles,
    Ready, Reply, Request, RequestDelta, RequestFailed, SampleDelta, Shutdown, StartupFailed,
)
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.parallel.child import exit_with_parent
from engine.parallel.distributed import RankFailedError
from engine.runner.devices import use_device

logger = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
# How often the input thread looks up from its socket to see whether the loop has ended.
_RECEIVE_POLL_MS = 200


def engine_info(core: EngineCore, num_threads: int) -> EngineInfo:
    """The settings of ``core`` that its front end reads."""
    c = core.config
    return EngineInfo(core.model_id, c.block_size, core.max_model_len, core.kv_cache_dtype, core.hash_seed,
                      core.vocab_size, c.tensor_parallel_size, core.quantization, c.max_num_batched_tokens,
                      c.max_num_seqs, core.num_blocks, sorted(core.eos_token_ids), str(core.device), num_threads)


class EngineCoreProc:
    """Steps ``core`` for a front end on the other side of two sockets.

    Args:
        core: the engine; from :meth:`run` on, only the busy loop's thread touches it.
        input_socket: a connected ZeroMQ ``PULL`` socket the requests arrive on.
        output_socket: a connected ZeroMQ ``PUSH`` socket for outputs, replies and heartbeats.
        num_threads: PyTorch's intra-op threads of the busy loop (``None``: as they are).
    """

    def __init__(self, core: EngineCore, input_socket: zmq.Socket, output_socket: zmq.Socket,
                 num_threads: int | None = None) -> None:
        self.core = core
        self.num_threads = num_threads
        self._input_socket, self._output_socket = input_socket, output_socket
        self._inputs: queue.Queue[Request] = queue.Queue()
        self._outputs: queue.Queue[Output | None] = queue.Queue()
        self._deltas: list[RequestDelta | RequestFailed] = []
        self._sent: dict[str, tuple[list[int], int]] = {}  # request id -> (tokens sent per sample, pins sent)
        self._iteration_started: float | None = None  # None while waiting for work
        self._stopped = threading.Event()
        self._utilities: dict[str, Callable] = {
            "abort": self._abort, "release": core.release, "reserve_blocks": self._reserve_blocks,
            "free_blocks": core.free_blocks, "abort_all": self._abort_all,
            "fail_all": lambda reason: self._fail_requests("dead", reason),
            "num_free_blocks": lambda: core.num_free_blocks,
        }

    # ------------------------------------------------------------------ loop
    def run(self) -> None:
        """Serve until a :class:`~engine.core.messages.Shutdown` (then shut the engine down) or
        until the engine dies (a tensor-parallel rank: ``RankFailedError`` is raised after every
        request was failed and that news sent)."""
        if self.num_threads is not None:
            torch.set_num_threads(self.num_threads)
        use_device(self.core.device)
        self._outputs.put(Ready(engine_info(self.core, torch.get_num_threads())))
        threads = [threading.Thread(target=self._receive, name="core-input", daemon=True),
                   threading.Thread(target=self._send, name="core-output", daemon=True)]
        for thread in threads:
            thread.start()
        try:
            self._busy_loop()
        finally:
            self._stopped.set()
            self._outputs.put(None)
            for thread in threads:
                thread.join()

    def _busy_loop(self) -> None:
        core, stalled = self.core, False
        while True:
            idle = stalled or not (core.has_unfinished_requests or core.has_steps_in_flight)
            self._iteration_started = None if idle else time.monotonic()
            requests = [self._inputs.get()] if idle else []
            self._iteration_started = time.monotonic()
            while True:
                try:
                    requests.append(self._inputs.get_nowait())
                except queue.Empty:
                    break
            for request in requests:
                if isinstance(request, Shutdown):
                    self._abort_all(None)
                    while core.has_steps_in_flight:  # their blocks go back when they complete
                        core.step()
                    self._publish()
                    core.shutdown()
                    return
                self._handle(request)
            if requests:
                stalled = False
            if core.has_unfinished_requests or core.has_steps_in_flight:
                stalled = not self._step()
            self._publish()

    def _step(self) -> bool:
        """One engine step; whether it launched or completed anything."""
        try:
            step = self.core.step()
        except RankFailedError as exc:
            logger.error("engine step failed (%s); failing %d requests", exc, len(self.core.requests))
            self._fail_requests("dead", f"the engine is down: {exc}")
            self._publish()
            raise
        except Exception as exc:  # noqa: BLE001 (fails the requests, not the engine core)
            logger.exception("engine step failed; aborting %d requests", len(self.core.requests))
            self._fail_requests("failed", f"engine step failed: {type(exc).__name__}: {exc}")
            return True
        for out in step.outputs:
            self._emit(out)
        return step.model_executed

    def _publish(self) -> None:
        events = self.core.block_pool.drain_events()
        self._outputs.put(Outputs(self._deltas, self.core.stats(), events.stored, events.removed))
        self._deltas = []

    # -------------------------------------------------------------- requests
    def _handle(self, request: Request) -> None:
        core = self.core
        if isinstance(request, AddRequest):
            try:
                core.add_request(request.request_id, request.prompt_token_ids, request.params,
                                 request.pin_prompt_blocks, request.release_blocks, request.cache_salt,
                                 request.block_hashes)
            except ValueError as exc:
                self._deltas.append(RequestFailed(request.request_id, "invalid", str(exc)))
                return
            self._sent[request.request_id] = ([0] * request.params.n, 0)
        elif isinstance(request, AddPrefilledRequest):
            try:
                out = core.add_prefilled_request(request.request_id, request.prompt_token_ids,
                                                 request.first_token_ids, request.params, request.block_ids,
                                                 request.cache_salt, request.block_hashes)
            except ValueError as exc:
                core.free_blocks(request.block_ids)
                self._deltas.append(RequestFailed(request.request_id, "invalid", str(exc)))
                return
            self._sent[request.request_id] = ([0] * request.params.n, 0)
            self._emit(out)
        elif isinstance(request, Call):
            self._call(request)

    def _call(self, call: Call) -> None:
        try:
            reply = Reply(call.call_id, self._utilities[call.method](*call.args))
        except (ValueError, NoFreeBlocksError, KeyError) as exc:
            reply = Reply(call.call_id, None, type(exc).__name__, str(exc))
        if call.call_id:
            self._publish()  # a reply follows every output its call caused (an abort's last)
            self._outputs.put(reply)

    def _reserve_blocks(self, prompt_token_ids: list[int], cache_salt: str, block_hashes: list[bytes] | None,
                        params: dict | None = None) -> tuple[list[int], int]:
        return self.core.reserve_blocks(prompt_token_ids, cache_salt, block_hashes, _params(params))

    def _abort(self, request_id: str) -> bool:
        pinned = self.core.release(request_id)
        out = self.core.abort_request(request_id)
        if out is not None:
            self._emit(out)
        self._sent.pop(request_id, None)
        return pinned or out is not None

    def _abort_all(self, failure: str | None) -> int:
        """Abort every request and release every pin; their streams end with their final output,
        or, given ``failure``, with ``RequestFailed("dead")``."""
        ids = list(self.core.requests) + list(self.core.pinned)
        for request_id in ids:
            self.core.release(request_id)
            out = self.core.abort_request(request_id)
            if failure is None and out is not None:
                self._emit(out)
            elif out is not None:
                self._deltas.append(RequestFailed(request_id, "dead", failure))
            self._sent.pop(request_id, None)
        return len(ids)

    def _fail_requests(self, kind: str, message: str) -> None:
        for request_id in list(self.core.requests):
            try:
                self.core.abort_request(request_id)
            except Exception:  # noqa: BLE001
                logger.exception("aborting %s after a failed step failed too", request_id)
            self._sent.pop(request_id, None)
            self._deltas.append(RequestFailed(request_id, kind, message))

    def _emit(self, out: RequestOutput) -> None:
        """Queue what ``out`` gained since its last delta."""
        sent = self._sent.get(out.request_id)
        if sent is None:
            return
        tokens, pins = sent
        samples = []
        for c in out.outputs:
            i = c.index
            if len(c.token_ids) > tokens[i] or c.finish_reason is not None:
                samples.append(SampleDelta(i, c.token_ids[tokens[i]:], c.logprobs[tokens[i]:], c.finish_reason,
                                           c.stop_reason))
                tokens[i] = len(c.token_ids)
        new_pins = out.pinned_block_ids[pins:]
        self._deltas.append(RequestDelta(out.request_id, samples, out.num_cached_tokens, new_pins, out.finished))
        if out.finished:
            del self._sent[out.request_id]
        else:
            self._sent[out.request_id] = (tokens, pins + len(new_pins))

    # --------------------------------------------------------------- sockets
    def _receive(self) -> None:
        decoder = msgspec.msgpack.Decoder(Request)
        while not self._stopped.is_set():
            if not self._input_socket.poll(_RECEIVE_POLL_MS):
                continue
            frame = self._input_socket.recv()
            try:
                request = decoder.decode(frame)
            except msgspec.ValidationError as exc:
                logger.error("a request from the front end does not decode: %s", exc)
                continue
            self._compile_ahead(request)
            self._inputs.put(request)
            if isinstance(request, Shutdown):
                return

    def _compile_ahead(self, request: Request) -> None:
        """Compile a request's structured output here, on the input thread, before the busy loop
        takes the request: compiling releases the GIL, so the running steps go on meanwhile,
        and the busy loop finds the grammar in the compiler's cache (``engine.runner.grammar``).
        A spec that does not compile is refused by the busy loop, naming the field."""
        if isinstance(request, (AddRequest, AddPrefilledRequest)):
            params = request.params
        elif isinstance(request, Call) and request.method == "reserve_blocks" and len(request.args) > 3:
            try:
                params = _params(request.args[3])
            except ValueError:
                return
        else:
            return
        if params is not None and params.structured_output is not None:
            try:
                self.core.grammars.compile(params.structured_output)
            except Exception:  # noqa: BLE001 (the busy loop compiles it again and refuses the request)
                pass

    def _send(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while True:
            try:
                item = self._outputs.get(timeout=HEARTBEAT_S)
            except queue.Empty:
                started = self._iteration_started
                item = Heartbeat(0.0 if started is None else time.monotonic() - started)
            if item is None:
                return
            self._output_socket.send(encoder.encode(item), copy=False)


def _params(args: dict | None) -> SamplingParams | None:
    """A :class:`Call`'s sampling parameters (msgpack'd as a map, its arguments being untyped).

    Raises:
        ValueError: a field out of range (``SamplingParams``' own checks).
    """
    if args is None:
        return None
    try:
        return msgspec.convert(args, SamplingParams)
    except msgspec.ValidationError as exc:
        raise ValueError(f"params: {exc}") from None


# --------------------------------------------------------------------------- process
def _pool_allocator(input_socket: zmq.Socket, output_socket: zmq.Socket):
    """The ``allocate_pools`` of an engine core whose front end holds the KV pools: it asks for
    them over the sockets (before the loop's threads start) and maps what comes back."""
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(Request)

    def allocate(shape: Sequence[int], dtype: torch.dtype, devices: Sequence[torch.device]) -> list[dict]:
        output_socket.send(encoder.encode(AllocatePools(list(shape), str(dtype).removeprefix("torch."),
                                                        [str(d) for d in devices])))
        reply = decoder.decode(input_socket.recv())
        if not isinstance(reply, PoolHandles):
            raise RuntimeError(f"expected the KV pools' handles, got {type(reply).__name__}")
        return reply.handles

    return allocate


def main(argv: Sequence[str] | None = None) -> int:
    """Build the engine of ``SPEC`` (JSON: ``model``, ``config``, ``load_format``, ``input`` and
    ``output`` socket addresses, ``num_threads``, ``log_level``) and serve it; exit status 0
    after a shutdown, 1 after a failed start-up or the engine's death."""
    spec = json.loads((sys.argv[1:] if argv is None else argv)[0])
    logging.basicConfig(level=spec["log_level"], stream=sys.stderr,
                        format="%(asctime)s %(levelname)s engine-core %(name)s: %(message)s")
    exit_with_parent()
    context = zmq.Context()
    input_socket, output_socket = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    input_socket.connect(spec["input"])
    output_socket.connect(spec["output"])
    output_socket.setsockopt(zmq.LINGER, 5000)
    if spec["num_threads"]:
        torch.set_num_threads(spec["num_threads"])
    try:
        core = EngineCore(spec["model"], EngineConfig(**spec["config"]), spec["load_format"],
                          allocate_pools=_pool_allocator(input_socket, output_socket))
    except Exception as exc:  # noqa: BLE001 (reported to the front end, which raises it)
        logger.exception("the engine did not start")
        output_socket.send(msgspec.msgpack.encode(StartupFailed(type(exc).__name__, str(exc))))
        output_socket.close()
        return 1
    try:
        EngineCoreProc(core, input_socket, output_socket).run()
    except RankFailedError:
        code = 1
    else:
        code = 0
    input_socket.close()
    output_socket.close()
    context.term()  # once what was sent has gone (the output socket's linger)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # a dead rank's process group is in no state for the interpreter's teardown


if __name__ == "__main__":
    sys.exit(main())
