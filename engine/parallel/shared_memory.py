"""KV pools that rank 0 of a tensor-parallel engine allocates and the other ranks map.

Rank 0 is the worker process: it alone talks to other workers, so every rank's KV pool must be
within its reach, for the gRPC transport's copies and for NIXL, which can export (serve reads
from) only memory its own process allocated. So rank 0 allocates each rank's pool on that rank's
device and shares it; the rank maps it and computes into it. On CUDA the pool is shared by a
CUDA IPC handle (``cudaIpcGetMemHandle`` through PyTorch's storage sharing, the mechanism of
``torch.multiprocessing``); on the CPU it is a file in ``/dev/shm`` (or the temp directory)
that both map shared, and that rank 0 deletes once every rank has mapped it.

A handle is a JSON-serializable dict: it travels through the ranks' rendezvous store (on this
host, between processes of one worker), never over the network.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import uuid

import torch

from engine.runner.devices import KV_POOL_DTYPES

_SHM_DIR = "/dev/shm"


def _contiguous_strides(shape: tuple[int, ...]) -> list[int]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return strides[::-1]


def shm_path(nbytes: int, prefix: str = "tandem-kv-") -> str:
    """A new file name in ``/dev/shm`` if it has room for ``nbytes``, else in the temp directory."""
    directory = _SHM_DIR if os.path.isdir(_SHM_DIR) and shutil.disk_usage(_SHM_DIR).free > nbytes else tempfile.gettempdir()
    return os.path.join(directory, f"{prefix}{uuid.uuid4().hex}")


def allocate_shared(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, dict]:
    """A zero-filled tensor that another process of this host can map with :func:`open_shared`.

    Returns:
        ``(tensor, handle)``; on the CPU call :func:`release_handle` once every process has
        mapped it (the file goes, the memory stays until the last mapping does).
    """
    numel = math.prod(shape)
    if device.type == "cuda":
        tensor = torch.zeros(shape, dtype=dtype, device=device)
        torch.cuda.synchronize(device)
        (index, handle, size, offset, counter, counter_offset, event, event_sync) = tensor.untyped_storage()._share_cuda_()
        return tensor, {"kind": "cuda", "device": index, "handle": handle.hex(), "size": size, "offset": offset,
                        "counter": counter.hex(), "counter_offset": counter_offset, "event": event.hex(),
                        "event_sync": bool(event_sync), "shape": list(shape), "dtype": str(dtype).removeprefix("torch.")}
    path = shm_path(numel * dtype.itemsize)
    with open(path, "xb") as f:
        f.truncate(numel * dtype.itemsize)  # a sparse file: reads as zeros
    tensor = torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape)
    return tensor, {"kind": "file", "path": path, "shape": list(shape), "dtype": str(dtype).removeprefix("torch.")}


def open_shared(handle: dict) -> torch.Tensor:
    """Map the tensor of :func:`allocate_shared`'s ``handle`` in this process."""
    shape, dtype = tuple(handle["shape"]), KV_POOL_DTYPES[handle["dtype"]]
    if handle["kind"] == "file":
        return torch.from_file(handle["path"], shared=True, size=math.prod(shape), dtype=dtype).view(shape)
    storage = torch.UntypedStorage._new_shared_cuda(
        handle["device"], bytes.fromhex(handle["handle"]), handle["size"], handle["offset"],
        bytes.fromhex(handle["counter"]), handle["counter_offset"], bytes.fromhex(handle["event"]), handle["event_sync"])
    device = torch.device("cuda", handle["device"])
    return torch.empty(0, dtype=dtype, device=device).set_(storage, 0, shape, _contiguous_strides(shape))


def release_handle(handle: dict) -> None:
    """Delete a CPU handle's file (every process that needs it has mapped it)."""
    if handle["kind"] == "file":
        os.unlink(handle["path"])
