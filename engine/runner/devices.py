"""Which device and dtype an engine runs on, and binding a thread to that device.

CUDA's current device is per thread, and Triton kernels, CUDA events, streams and graph capture
all use it: a worker on ``cuda:1`` whose step loop ran in a thread still on device 0 failed at
its first kernel. Every thread that touches a worker's GPU calls :func:`use_device` first.
"""

from __future__ import annotations

import torch

from engine.config import DTYPE_NAMES

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}  # names from engine.config, a fixed list
# The KV cache dtypes that are no model dtype, by their ``engine.config.KV_CACHE_DTYPES`` name.
FP8_KV_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn}
# Every dtype a KV pool may have, by torch's name (what a shared-memory handle carries).
KV_POOL_DTYPES = {**DTYPES, **{str(d).removeprefix("torch."): d for d in FP8_KV_DTYPES.values()}}


def resolve_device(name: str) -> torch.device:
    """``"auto"`` → the first visible GPU when there is one, else the CPU; ``"cuda"`` → the
    first visible GPU; any other name as it is (``"cpu"``, ``"cuda:N"``)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    return torch.device("cuda", 0) if device.type == "cuda" and device.index is None else device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``"auto"`` → bfloat16 on CUDA, float32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> tuple[str, torch.dtype]:
    """The KV cache's published name and its torch dtype for the setting ``name``
    (``engine.config.KV_CACHE_DTYPES``): ``"auto"`` → the model's dtype under its own name
    (``"bfloat16"``, ...); ``"fp8_e4m3"`` → ``torch.float8_e4m3fn`` under that name."""
    if name == "auto":
        return str(model_dtype).removeprefix("torch."), model_dtype
    return name, FP8_KV_DTYPES[name]


def check_kv_cache_dtype(kv_dtype: torch.dtype, device: torch.device) -> None:
    """Refuse a KV cache dtype the device's kernels cannot run: float8 needs a GPU of compute
    capability 8.9 or later (Triton's float8 conversions; an A100 would fail when the attention
    kernels first compile, mid-start-up). The CPU path runs every dtype.

    Raises:
        ValueError: float8 on an older GPU, naming ``kv_cache_dtype`` and the GPU.
    """
    if device.type != "cuda" or kv_dtype.itemsize != 1:
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        raise ValueError(f"kv_cache_dtype: a float8 KV cache needs a GPU of compute capability 8.9 or later "
                         f"(Ada, Hopper); {device} is {capability[0]}.{capability[1]}: use kv_cache_dtype=auto")


def rank_device(device: torch.device, rank: int) -> torch.device:
    """The device of tensor-parallel rank ``rank`` of a worker whose rank 0 runs on ``device``:
    the GPU ``rank`` places after it (one GPU per rank), or the CPU.

    Raises:
        ValueError: that GPU does not exist here.
    """
    if device.type != "cuda":
        return device
    index = device.index + rank
    if index >= torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size: rank {rank} needs GPU {index} after {device}, but "
                         f"{torch.cuda.device_count()} GPUs are visible")
    return torch.device("cuda", index)


def use_device(device: torch.device) -> None:
    """Make ``device`` the calling thread's current CUDA device (nothing to do off CUDA)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def device_ids(tensors: list[torch.Tensor]) -> tuple[str, ...]:
    """The physical GPUs the ``tensors`` lie on, as NVIDIA's UUIDs (``"GPU-..."``, the ids
    ``nvidia-smi -L`` prints; a MIG instance's own), sorted, each once: the same string in every
    process and container that uses the GPU, whatever its CUDA index there. Host memory has none."""
    return tuple(sorted({f"GPU-{torch.cuda.get_device_properties(t.device).uuid}" for t in tensors if t.is_cuda}))


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on ``device`` without waiting for the work queued there: through pinned
    memory, asynchronously (a copy from pageable memory would wait for the step in flight).
    PyTorch's pinned-memory allocator keeps the staging buffer until the copy is done. On the
    CPU, ``host`` itself."""
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
