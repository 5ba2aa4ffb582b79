"""The process group of a tensor-parallel engine: one process per rank, rank 0 the scheduler's.

Two groups span the ranks. The device group carries the model's collectives: the all-reduce
after each row-parallel projection and the logits gather (NCCL on CUDA, where the all-reduces
are captured in the decode CUDA graphs; gloo on the CPU), and, under async scheduling, rank 0's
sampled tokens of each step (which the next step reads on the device). A gloo group carries the
start-up's few host collectives. Each step's inputs go from rank 0 to the others as host int64
arrays through a shared-memory ring (:meth:`TPGroup.broadcast_step`,
:mod:`engine.parallel.shm_broadcast`), the way vLLM v1's scheduler hands every worker the same
step: rank 0 alone schedules, and the other ranks run what it sends. Between steps the other
ranks wait on that ring, however long the engine idles.

A rank that dies closes its sockets: gloo and the ring fail the operation the others are in
(the ring when rank 0 sees the rank gone: :attr:`TPGroup.peers_alive`), and
:meth:`TPGroup.abort` ends NCCL operations that would otherwise wait for it.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

from engine.config import NVLINK_MULTICAST_OFF
from engine.parallel.shm_broadcast import ShmBroadcast

logger = logging.getLogger(__name__)

# The model's collectives complete within a step; a rank missing for this long is gone.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
DESTROY_TIMEOUT_S = 10.0


class RankFailedError(RuntimeError):
    """A tensor-parallel rank died or a collective failed: the engine cannot step any more."""


class TPGroup:
    """This process's place among the ranks of a tensor-parallel engine.

    Args:
        rank: this process's rank, ``0 <= rank < world_size``.
        world_size: the tensor-parallel size.
        device: this rank's device (its GPU, or the CPU).
        store: the rendezvous store (rank 0's ``TCPStore``).

    Attributes:
        peers_alive: on rank 0, whether every other rank still runs (set by its owner; a step
            broadcast that waits for a rank fails once it says no).

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
        self.cpu_group = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
        self.peers_alive: Callable[[], bool] = lambda: True
        if self.is_driver:
            self._steps = ShmBroadcast(world_size - 1)
            store.set("tp_steps", self._steps.path)
        else:
            self._steps = ShmBroadcast(world_size - 1, store.get("tp_steps").decode(), reader=rank - 1)
        self.barrier()
        if self.is_driver:
            self._steps.unlink()  # every rank has mapped it

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
            RuntimeError: rank 0 waited for a rank that is gone (:attr:`peers_alive`).
        """
        if self.is_driver:
            self._steps.send(payload, self.peers_alive)
            return payload
        return self._steps.receive()

    def broadcast_tensor(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` on every rank, in place, in the device's stream order; returns ``x``."""
        dist.broadcast(x, 0, group=self.device_group)
        return x

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
