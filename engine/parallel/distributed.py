"""The process group of a tensor-parallel engine: one process per rank, rank 0 the scheduler's.

Two groups span the ranks. The device group carries the model's collectives: the all-reduce
after each row-parallel projection and the logits gather (NCCL on CUDA, where the all-reduces
are captured in the decode CUDA graphs; gloo on the CPU). A gloo group carries each step's
inputs from rank 0 to the others as host int64 arrays (:meth:`TPGroup.broadcast_step`), the
way vLLM v1's scheduler hands every worker the same step: rank 0 alone schedules, and the other
ranks run what it sends. Between steps the other ranks wait in that broadcast, however long the
engine idles.

A rank that dies closes its sockets: gloo fails the operation the others are in at once (the
step broadcast included), and :meth:`TPGroup.abort` ends NCCL operations that would otherwise
wait for it.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading

import numpy as np
import torch
import torch.distributed as dist

from engine.config import NVLINK_MULTICAST_OFF

logger = logging.getLogger(__name__)

# The model's collectives complete within a step; a rank missing for this long is gone.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
# The step broadcast also waits while the engine idles: no bound (a dead rank 0 fails it anyway).
IDLE_TIMEOUT = datetime.timedelta(days=365)
DESTROY_TIMEOUT_S = 10.0
# int64 words of a step broadcast's first message: steps this small (a few decoding sequences)
# cross in one message, larger ones in two.
_FIRST_MESSAGE = 512
_SHUTDOWN = -1


class RankFailedError(RuntimeError):
    """A tensor-parallel rank died or a collective failed: the engine cannot step any more."""


class TPGroup:
    """This process's place among the ranks of a tensor-parallel engine.

    Args:
        rank: this process's rank, ``0 <= rank < world_size``.
        world_size: the tensor-parallel size.
        device: this rank's device (its GPU, or the CPU).
        store: the rendezvous store (rank 0's ``TCPStore``).

    Blocks until every rank has joined.
    """

    def __init__(self, rank: int, world_size: int, device: torch.device, store: dist.Store) -> None:
        for key, value in NVLINK_MULTICAST_OFF.items():
            os.environ.setdefault(key, value)
        self.rank = rank
        self.world_size = world_size
        self.device = device
        cuda = device.type == "cuda"
        dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=world_size,
                                timeout=COLLECTIVE_TIMEOUT, device_id=device if cuda else None)
        self.device_group = dist.group.WORLD
        self.cpu_group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        self._first = torch.zeros(_FIRST_MESSAGE, dtype=torch.int64)

    @property
    def is_driver(self) -> bool:
        """Whether this is rank 0, which schedules and broadcasts the steps."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns ``x`` (usable as a forward hook's output)."""
        dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` ``[n, m]`` along the last dimension: ``[n, world_size * m]``."""
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=-1)

    def min(self, value: int) -> int:
        """The smallest of every rank's ``value``."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def barrier(self) -> None:
        """Return once every rank has called it."""
        dist.barrier(group=self.cpu_group)

    def broadcast_step(self, payload: np.ndarray | None) -> np.ndarray | None:
        """Send one step's int64 inputs from rank 0 (``payload``; ``None``: shut down) and
        receive them on the others.

        Returns:
            The payload (on every rank), or ``None`` when rank 0 shuts the group down.

        Raises:
            RuntimeError: a rank died (gloo reports the closed connection).
        """
        first = self._first
        if self.is_driver:
            size = _SHUTDOWN if payload is None else len(payload)
            first[0] = size
            head = min(max(size, 0), _FIRST_MESSAGE - 1)
            if head:
                first[1:head + 1] = torch.from_numpy(payload[:head])
        dist.broadcast(first, 0, group=self.cpu_group)
        size = int(first[0])
        if size == _SHUTDOWN:
            return None
        head = min(size, _FIRST_MESSAGE - 1)
        if self.is_driver:
            rest = torch.from_numpy(payload[head:])
        else:
            payload = np.empty(size, dtype=np.int64)
            payload[:head] = first[1:head + 1].numpy()
            rest = torch.from_numpy(payload[head:])
        if size > head:
            dist.broadcast(rest, 0, group=self.cpu_group)
        return payload

    def abort(self) -> None:
        """End the group's pending and future operations with an error (a rank is gone): a step
        blocked in a collective raises instead of waiting for the dead rank. The group is gone
        afterwards (this process may join another)."""
        try:
            dist.distributed_c10d._abort_process_group()
        except Exception as exc:  # noqa: BLE001 (best effort: the process is failing anyway)
            logger.warning("aborting the tensor-parallel group failed: %s", exc)

    def destroy(self) -> None:
        """Leave the group, on every rank at once (rank 0 right after it broadcast the shutdown):
        an NCCL communicator's teardown waits for its peers, and for the CUDA graphs that captured
        its collectives to be gone (:meth:`engine.runner.model_runner.ModelRunner.release_cuda_graphs`
        first: with them alive it had not ended after 20 s on two H200s). Bounded by ``DESTROY_TIMEOUT_S``:
        a teardown that does not end is left behind (logged; this process cannot start another
        tensor-parallel engine then)."""
        teardown = threading.Thread(target=dist.destroy_process_group, name="tp-destroy", daemon=True)
        teardown.start()
        teardown.join(DESTROY_TIMEOUT_S)
        if teardown.is_alive():
            logger.warning("leaving the tensor-parallel group did not finish within %.0f s", DESTROY_TIMEOUT_S)
