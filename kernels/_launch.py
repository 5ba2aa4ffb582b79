"""Helpers shared by the Triton entry points: where a kernel may run and what it computes in."""

from __future__ import annotations

import functools
import os

import torch
import triton.language as tl

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
_CACHE_DTYPES = (*_TL_DTYPES, torch.float8_e4m3fn)


def next_power_of_2(n: int) -> int:
    """The least power of two ``>= n`` (0 for 0), as ``triton.next_power_of_2``.

    A plain function on purpose: Triton 3.6 makes its own (and ``triton.cdiv``) a
    ``ConstexprFunction``, whose call from the host goes through the JIT's argument unwrapping,
    ~4 µs a call on a 2-core EPYC, several times a launch (the decode entry point made five such
    calls), on every launch of every layer of an eager step."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints, ``b > 0``: ``triton.cdiv`` as a plain function (see
    :func:`next_power_of_2`)."""
    return -(-a // b)


def check_device(*tensors: torch.Tensor) -> torch.device:
    """Return the tensors' common device; raise if a Triton kernel cannot run there.

    Raises:
        RuntimeError: a CPU tensor without ``TRITON_INTERPRET=1`` (the kernels never fall back
            to :mod:`kernels.reference` on their own), or tensors on different devices.
    """
    device = tensors[0].device
    if any(t.device != device for t in tensors):
        raise RuntimeError(f"kernel inputs are on different devices: {[str(t.device) for t in tensors]}")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "Triton kernels got CPU tensors: run on a CUDA device, set TRITON_INTERPRET=1 before "
            "importing kernels, or use kernels.reference"
        )
    if device.type not in ("cpu", "cuda"):
        raise RuntimeError(f"Triton kernels run on CUDA devices, got {device}")
    return device


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Raise ValueError unless K and V caches are matching 4-D tensors of a KV cache dtype
    (float32, float16, bfloat16, float8_e4m3fn)."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if k_cache.dtype not in _CACHE_DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError("cache dtype must be float32, float16, bfloat16 or float8_e4m3fn, got "
                         f"{k_cache.dtype}/{v_cache.dtype}")


def dot_inputs(cache_dtype: torch.dtype, query_dtype: torch.dtype, device: torch.device) -> tuple[tl.dtype, str]:
    """Return the dtype fed to ``tl.dot`` and its ``input_precision`` for a cache of
    ``cache_dtype`` attended by queries of ``query_dtype``.

    An fp8 cache's tiles are upcast after their load to the query's dtype (every e4m3 value is
    exact in float32, float16 and bfloat16), and the dot then runs as over a cache of that
    dtype. float32 uses exact ("ieee") products rather than tf32. Under the CPU interpreter
    bfloat16 is widened to float32 because the interpreter's ``tl.dot`` multiplies the raw bf16
    bit patterns (seen with Triton 3.9).
    """
    dtype = query_dtype if cache_dtype == torch.float8_e4m3fn else cache_dtype
    if dtype == torch.bfloat16 and device.type == "cpu":
        return tl.float32, "ieee"
    return _TL_DTYPES[dtype], "ieee" if dtype == torch.float32 else "tf32"


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``; the interpreter pretends to have 4.

    Raises:
        ValueError: a CUDA device without an index (a tensor's device always has one; the
            thread's current device is not asked, so that every thread sees the same GPU).
    """
    if device.type != "cuda":
        return 4
    if device.index is None:
        raise ValueError(f"sm_count needs a CUDA device with an index, not {device}")
    return _cuda_sm_count(device.index)


class KernelLaunch:
    """One Triton kernel launched many times with one grid and the same arguments but for its
    tensors, which move (the layers of an engine step): the first launch goes through the JIT,
    the later ones straight to the kernel it compiled (or found).

    Why: ``kernel[grid](...)`` binds and specializes every argument anew, ~36 µs of host time a
    launch on an H200's host (``python -m bench.kernels --rope-kv``), three launches a layer of an
    eager step, which is bound by its host time; the compiled kernel's own launcher
    (``CompiledKernel[grid]``, Triton's launch of an already compiled kernel) skips that. It may
    only run arguments of the first launch's specialization: the integers and constexprs are
    fixed here, and a tensor whose address is not aligned (16 bytes) as the first launch's was
    goes through the JIT again, as does everything under the interpreter.

    Args:
        kernel: a ``@triton.jit`` function whose constexpr parameters all come after the others.
        grid: its launch grid.
        meta: its constexprs and launch options (``num_warps``, ``num_stages``) by name.
    """

    def __init__(self, kernel, grid: tuple[int, ...], meta: dict) -> None:
        self.kernel, self.grid, self.meta = kernel, grid, meta
        self._runner = None
        self._tensors: list[int] = []  # positions of the tensor arguments
        self._aligned: tuple[bool, ...] = ()
        params = getattr(kernel, "params", None)
        constexpr = [p.is_constexpr for p in params] if params is not None else []
        if constexpr and constexpr == sorted(constexpr):  # constexprs last: passed after the positional arguments
            self._constexprs = tuple(meta[p.name] for p in params if p.is_constexpr)
        else:
            self._constexprs = None

    def __call__(self, *args) -> None:
        """Launch with the kernel's non-constexpr arguments, in order."""
        if self._runner is not None and self._alignment(args) == self._aligned:
            self._runner(*args, *self._constexprs)
            return
        compiled = self.kernel[self.grid](*args, **self.meta)
        if self._runner is None and self._constexprs is not None and compiled is not None:
            self._tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
            if self._tensors and args[self._tensors[0]].is_cuda:
                grid = (*self.grid, 1, 1)[:3]  # the compiled kernel's launcher takes all three dimensions
                self._runner, self._aligned = compiled[grid], self._alignment(args)

    def _alignment(self, args: tuple) -> tuple[bool, ...]:
        """Whether each tensor argument's address is a multiple of 16 bytes (what the JIT
        specializes a pointer on)."""
        return tuple(not args[i].data_ptr() & 15 for i in self._tensors)
