"""Rank 0's side of a tensor-parallel engine: it starts ranks 1..T-1 as child processes
(``python -m engine.parallel.tp_follower``), joins them in one :class:`engine.parallel.distributed.TPGroup`, and
watches them.

Rank 0 is the engine's own process (the worker process, or the offline ``LLM``'s): it runs the
scheduler and broadcasts every step. A rank that exits while the engine runs is a failure of
the whole engine: :attr:`FollowerRanks.failure` says which rank and how, the group is aborted so
that no step waits for the dead rank, and the callbacks registered with
:meth:`FollowerRanks.on_failure` run (a worker stops itself; the gateway's failover takes its
requests elsewhere). The other ranks exit on their own when rank 0 goes away.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from engine.config import NVLINK_MULTICAST_OFF, EngineConfig
from engine.runner.devices import rank_device
from engine.parallel.distributed import DESTROY_TIMEOUT_S, TPGroup
from engine.loading.model_config import ModelConfig
from engine.model_source import resolve_model
from engine.parallel.tensor_parallel import shard_config

logger = logging.getLogger(__name__)

# How long the ranks may take to start and join (importing torch on a busy host included).
JOIN_TIMEOUT_S = 300.0
# How long the ranks get to exit after rank 0 sent them the shutdown, before they are killed.
EXIT_TIMEOUT_S = 10.0
_PROJECT_ROOT = str(Path(__file__).resolve().parents[2])


class FollowerRanks:
    """Start ranks ``1 .. config.tensor_parallel_size - 1`` and join them as rank 0.

    Args:
        model, config, load_format: what every rank loads (as ``EngineCore``'s).
        device: rank 0's device; rank ``r`` runs on :func:`engine.runner.devices.rank_device` ``(device, r)``.

    Attributes:
        group: rank 0's place in the group.
        store: the ranks' rendezvous store (rank 0 serves it on a free loopback port).
        failure: ``None`` while every rank runs; else what happened to the first that exited.

    Raises:
        ValueError: the model's heads cannot be split over the ranks, the GPUs the ranks need are
            not all visible, or this process already runs a tensor-parallel engine.
        RuntimeError: a rank exited before joining, or did not join within ``JOIN_TIMEOUT_S``.
    """

    def __init__(self, model: str | dict | None, config: EngineConfig, load_format: str, device: torch.device) -> None:
        world_size = config.tensor_parallel_size
        if dist.is_initialized():
            raise ValueError("tensor_parallel_size: this process already runs a tensor-parallel engine (one per process)")
        shard_config(ModelConfig.from_hf_dict(resolve_model(model).hf_config), world_size)  # refused before any process starts
        devices = [rank_device(device, rank) for rank in range(world_size)]
        for other in devices[1:]:
            if other.type == "cuda":  # rank 0 allocates that rank's KV pool there: its context exists before
                torch.zeros(1, device=other)  # the rank measures the memory it has
        self.store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S))
        spec = {"model": model, "config": dataclasses.asdict(config), "load_format": load_format,
                "world_size": world_size, "store_port": self.store.port,
                "log_level": logging.getLevelName(logging.getLogger().getEffectiveLevel())}
        pythonpath = os.pathsep.join(p for p in (_PROJECT_ROOT, os.environ.get("PYTHONPATH", "")) if p)
        env = {**NVLINK_MULTICAST_OFF, **os.environ, "PYTHONPATH": pythonpath}
        self.failure: str | None = None
        self._abort: threading.Thread | None = None
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[str], None]] = []
        self._stopping = False
        self._procs = [subprocess.Popen(
            [sys.executable, "-m", "engine.parallel.tp_follower",
             json.dumps({**spec, "rank": rank, "device": str(devices[rank])})],
            env=env, stdin=subprocess.DEVNULL) for rank in range(1, world_size)]
        try:
            self._wait_joined()
            self.group = TPGroup(0, world_size, device, self.store)
            self.group.peers_alive = lambda: self.failure is None and all(p.poll() is None for p in self._procs)
        except BaseException:
            self._kill()
            raise
        for rank, proc in enumerate(self._procs, start=1):
            threading.Thread(target=self._watch, args=(rank, proc), name=f"tp-rank-{rank}-watch", daemon=True).start()
        logger.info("tensor parallelism: %d ranks on %s", world_size, ", ".join(map(str, devices)))

    def _wait_joined(self) -> None:
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for rank, proc in enumerate(self._procs, start=1):
            while not self.store.check([f"joined/{rank}"]):
                if proc.poll() is not None:
                    raise RuntimeError(f"tensor-parallel rank {rank} exited with code {proc.returncode} while starting")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"tensor-parallel rank {rank} did not start within {JOIN_TIMEOUT_S:.0f} s")
                time.sleep(0.05)

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(reason)`` (from a watcher thread) when a rank exits while the engine runs."""
        self._callbacks.append(callback)

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        self._fail(rank, proc, proc.wait())

    def _fail(self, rank: int, proc: subprocess.Popen, code: int) -> None:
        with self._lock:
            if self._stopping or self.failure is not None:
                return
            self.failure = f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {code}"
        logger.error("%s: the engine cannot step any more", self.failure)
        for callback in self._callbacks:
            callback(self.failure)
        # Aborting NCCL communicators can block behind the kernel waiting for the dead rank: on a
        # thread of its own, so that nothing else does. Published once started: close() on another
        # thread may read it as soon as the failure is set (a full run joined it unstarted).
        abort = threading.Thread(target=self.group.abort, name="tp-abort", daemon=True)
        abort.start()
        self._abort = abort

    def explain(self, error: Exception, wait_s: float = 2.0) -> str:
        """Why a step's collective failed with ``error``: the rank that died, when one exits
        within ``wait_s`` seconds (a peer's closed connection fails a gloo operation at once,
        before the rank's exit is seen), else ``error`` itself."""
        deadline = time.monotonic() + wait_s
        while self.failure is None and time.monotonic() < deadline:
            for rank, proc in enumerate(self._procs, start=1):
                if proc.poll() is not None:
                    self._fail(rank, proc, proc.returncode)
            time.sleep(0.05)
        return self.failure or f"a tensor-parallel step failed: {error}"

    def close(self) -> None:
        """Tell the ranks to exit (after the engine's last step), wait for them (killing those
        that overrun ``EXIT_TIMEOUT_S``) and leave the group. Idempotent."""
        if self._stopping:
            return
        self._stopping = True
        if self.failure is None:
            try:
                self.group.broadcast_step(None)
                self.group.destroy()  # the ranks tear it down at the same time, then exit
            except RuntimeError as exc:  # a rank went away meanwhile
                logger.warning("telling the tensor-parallel ranks to exit failed: %s", exc)
        elif self._abort is not None:
            self._abort.join(DESTROY_TIMEOUT_S)  # the aborted group is gone once it returns
        deadline = time.monotonic() + EXIT_TIMEOUT_S
        for proc in self._procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("tensor-parallel rank (pid %d) did not exit: killing it", proc.pid)
        self._kill()

    def _kill(self) -> None:
        self._stopping = True
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
