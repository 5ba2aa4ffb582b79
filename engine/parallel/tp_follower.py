"""``python -m engine.parallel.tp_follower SPEC``: rank 1..T-1 of a tensor-parallel engine.

Started by rank 0 (:class:`engine.parallel.tp_ranks.FollowerRanks`) with a JSON ``SPEC`` (the model, the
engine's settings, this rank and its device, the rendezvous store's port). It builds its shard
in lockstep with the other ranks (:func:`engine.runner.model_shard.build_shard`), then runs every step
rank 0 broadcasts until rank 0 says to stop (exit 0) or goes away (exit 1): it never outlives
the engine.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys
from collections.abc import Sequence

import torch
import torch.distributed as dist

from engine.config import EngineConfig, resolve_async_scheduling
from engine.runner.devices import resolve_dtype, use_device
from engine.parallel.child import exit_with_parent
from engine.parallel.distributed import TPGroup
from engine.runner.model_shard import build_shard
from engine.parallel.tp_ranks import JOIN_TIMEOUT_S

logger = logging.getLogger("engine.parallel.tp_follower")


def main(argv: Sequence[str] | None = None) -> int:
    spec = json.loads((sys.argv[1:] if argv is None else argv)[0])
    rank, world_size = spec["rank"], spec["world_size"]
    logging.basicConfig(level=spec["log_level"], stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s tp-rank-{rank} %(name)s: %(message)s")
    exit_with_parent()  # rank 0 ends this process (shutdown broadcast, or its death)
    device = torch.device(spec["device"])
    use_device(device)
    config = EngineConfig(**spec["config"])
    torch.manual_seed(config.seed)
    store = dist.TCPStore("127.0.0.1", spec["store_port"], world_size, is_master=False,
                          timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S))
    store.set(f"joined/{rank}", "1")
    group = TPGroup(rank, world_size, device, store)
    try:
        shard = build_shard(spec["model"], config, spec["load_format"], device, resolve_dtype(config.dtype, device),
                            group, store)
        if resolve_async_scheduling(config, device.type):
            shard.runner.share_sampled = group.broadcast_tensor
        while (packed := group.broadcast_step(None)) is not None:
            shard.runner.follow(packed)
    except Exception:  # noqa: BLE001 (logged; rank 0 sees this rank exit)
        logger.exception("tensor-parallel rank %d failed", rank)
        return 1
    shard.runner.release_cuda_graphs()
    group.destroy()  # with rank 0, which tears the group down as it sent the shutdown
    # Nothing of the group is left for the interpreter's teardown to trip on.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
