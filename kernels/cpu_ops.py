"""Small ops of a decoder layer on the CPU as single C calls (``kernels/cpu/layer_ops.c``):
the residual add with RMSNorm, SwiGLU's ``silu(gate) * up``, a decode step's RoPE,
KV-cache write and paged attention, and the dequantization of an int4 weight to bfloat16 (for a
prefill's dense matmul).

Why C and why here: a decode step of a small model on the CPU is bound by per-op overhead, not
arithmetic. As PyTorch ops (:mod:`kernels.reference`, the references and test oracles) a decode
layer's attention is ~30 ops at a few µs each and a residual add with RMSNorm ~8 (``F.rms_norm``
composes ``pow``, ``mean``, ``rsqrt``...), SwiGLU 3; SmolLM2-135M at one stream spent ~120 of its ~390 µs
a layer in the attention ops and ~50 in the norms (2-core Xeon), more than in its four int4
matmuls. One C call does each in a few µs. The library is compiled with the machine's C
compiler (``cc``, or ``$CC``) the first time it is needed, once per machine and source (under a
file lock, as a GGUF's conversion is), and loaded with ``ctypes``: a C file without PyTorch's
headers builds in under a second, where a PyTorch C++ extension (``torch.utils.cpp_extension``)
took 23 s for one line of code on this 2-core machine, on every first ``make run``. Without a
compiler the callers keep the PyTorch ops (:func:`load` returns ``None`` and logs why).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from filelock import FileLock

from kernels import reference

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu") / "layer_ops.c"
# -fassociative-math (with the two flags it needs) lets the compiler vectorize the dot products'
# sums; the result then differs from a sequential sum by float32 rounding only.
CFLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-pthread", "-fno-math-errno", "-fno-trapping-math",
          "-fassociative-math", "-fno-signed-zeros"]

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "tandem_rope_decode_attention": [_P, _I, _I, _I, _I, _I, _P, _P, _I, _P, _P, _I, _I, _I, _I, _P, _P, _I, _P, _I,
                                     _F, _P, _I, _I],
    "tandem_rms_norm": [_P, _I, _P, _I, _P, _P, _I, _I, _F, _P],
    "tandem_silu_and_mul": [_P, _I, _I, _I, _P],
    "tandem_dequantize_int4": [_P, _P, _I, _I, _I, _I, _P],
}


class CpuKernels:
    """The compiled kernels, each called like its reference in :mod:`kernels.reference`.

    Args:
        library: the loaded shared library.
    """

    def __init__(self, library: ctypes.CDLL) -> None:
        for name, argtypes in _SIGNATURES.items():
            getattr(library, name).argtypes = argtypes
        self._attention = library.tandem_rope_decode_attention
        self._attention.restype = ctypes.c_int
        self._rms_norm = library.tandem_rms_norm
        self._rms_norm.restype = None
        self._silu_and_mul = library.tandem_silu_and_mul
        self._silu_and_mul.restype = None
        self._dequantize_int4 = library.tandem_dequantize_int4
        self._dequantize_int4.restype = None

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """:func:`kernels.reference.rms_norm`; in C for float32 ``[rows, size]`` tensors with a unit
        last stride (the decoder's hidden states), by the reference otherwise."""
        if not (_plain(x, 2) and weight.dtype == torch.float32 and weight.is_contiguous()
                and weight.shape == x.shape[1:]
                and (residual is None or (_plain(residual, 2) and residual.shape == x.shape))):
            return reference.rms_norm(x, weight, eps, residual)
        rows, size = x.shape
        out = torch.empty(rows, size)
        if residual is None:
            self._rms_norm(x.data_ptr(), x.stride(0), None, 0, None, weight.data_ptr(), rows, size, eps, out.data_ptr())
            return out
        summed = torch.empty(rows, size)
        self._rms_norm(x.data_ptr(), x.stride(0), residual.data_ptr(), residual.stride(0), summed.data_ptr(),
                       weight.data_ptr(), rows, size, eps, out.data_ptr())
        return out, summed

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """:func:`kernels.reference.silu_and_mul`; in C for float32 ``[rows, 2 * d]`` tensors with a
        unit last stride, by the reference otherwise."""
        if not _plain(x, 2) or x.shape[1] % 2:
            return reference.silu_and_mul(x)
        out = torch.empty(x.shape[0], x.shape[1] // 2)
        self._silu_and_mul(x.data_ptr(), x.stride(0), x.shape[0], out.shape[1], out.data_ptr())
        return out

    def dequantize_int4(self, nibbles: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
                        out: torch.Tensor) -> torch.Tensor:
        """:func:`kernels.reference.dequantize_int4` rounded to bfloat16 (to nearest even), into
        ``out`` ``[rows, cols]`` bfloat16 (returned), on one thread (the C source says why).
        About 0.35 ns a weight of one plane on a 2-core Xeon (a 1536 x 576 weight: 0.3 ms).

        Raises:
            ValueError: a tensor is not a contiguous CPU tensor of its dtype and shape, or
                ``group_size`` is not a multiple of 32.
        """
        planes, rows, half_cols = nibbles.shape
        if group_size % 32 or (2 * half_cols) % group_size:
            raise ValueError(f"group_size must be a multiple of 32 dividing the columns, got {group_size}")
        for name, t, dtype, shape in (
                ("nibbles", nibbles, torch.uint8, (planes, rows, half_cols)),
                ("scales_and_zeros", scales_and_zeros, torch.bfloat16, (planes, 2 * half_cols // group_size, rows, 2)),
                ("out", out, torch.bfloat16, (rows, 2 * half_cols))):
            if t.dtype != dtype or not t.is_cpu or not t.is_contiguous() or tuple(t.shape) != shape:
                raise ValueError(f"{name} must be a contiguous {dtype} CPU tensor of shape {shape}, got "
                                 f"{t.dtype} {tuple(t.shape)}")
        self._dequantize_int4(nibbles.data_ptr(), scales_and_zeros.data_ptr(), planes, rows, 2 * half_cols,
                              group_size, out.data_ptr())
        return out

    def rope_decode_attention(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                              v_cache: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                              seq_lens: torch.Tensor, num_q_heads: int, scale: float, out: torch.Tensor
                              ) -> torch.Tensor:
        """:func:`kernels.reference.rope_decode_attention`, float32 tensors only; a call with a
        long context (16k positions over its query heads) splits its heads over
        ``torch.get_num_threads()`` threads.

        Raises:
            ValueError: a tensor has a dtype, device, layout or shape the kernel does not take, or a
                sequence is longer than its block table holds.
            MemoryError: the kernel could not allocate its scratch.
        """
        num_tokens = qkv.shape[0]
        _, block_size, num_kv_heads, head_dim = k_cache.shape
        _check(qkv, cos, sin, k_cache, v_cache, out, slot_mapping, block_tables, seq_lens)
        if cos.stride() != sin.stride() or k_cache.stride() != v_cache.stride():
            raise ValueError("cos and sin, k_cache and v_cache must have the same strides")
        if (num_q_heads % num_kv_heads or head_dim % 2 or k_cache.shape != v_cache.shape
                or qkv.shape[1] != (num_q_heads + 2 * num_kv_heads) * head_dim
                or out.shape != (num_tokens, num_q_heads * head_dim) or cos.shape != (num_tokens, 1, head_dim // 2)
                or sin.shape != cos.shape or slot_mapping.shape != (num_tokens,) or seq_lens.shape != (num_tokens,)
                or block_tables.shape[0] != num_tokens):
            raise ValueError(f"shapes do not fit: qkv {tuple(qkv.shape)}, cos {tuple(cos.shape)}, k_cache "
                             f"{tuple(k_cache.shape)}, {num_q_heads} query heads, out {tuple(out.shape)}, slot_mapping "
                             f"{tuple(slot_mapping.shape)}, block_tables {tuple(block_tables.shape)}, seq_lens "
                             f"{tuple(seq_lens.shape)}")
        if num_tokens == 0:
            return out
        status = self._attention(
            qkv.data_ptr(), num_tokens, qkv.stride(0), num_q_heads, num_kv_heads, head_dim,
            cos.data_ptr(), sin.data_ptr(), cos.stride(0),
            k_cache.data_ptr(), v_cache.data_ptr(), block_size, *k_cache.stride()[:3],
            slot_mapping.data_ptr(), block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(),
            block_tables.shape[1], scale, out.data_ptr(), out.stride(0), torch.get_num_threads(),
        )
        if status == -2:
            raise ValueError("a sequence's length exceeds its block table")
        if status != 0:
            raise MemoryError("rope_decode_attention: out of memory for its scratch")
        return out


def _plain(t: torch.Tensor, dim: int) -> bool:
    """``t`` is a ``dim``-D float32 CPU tensor with a unit last stride."""
    return t.dim() == dim and t.dtype == torch.float32 and t.is_cpu and t.stride(-1) == 1


def _check(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           out: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor) -> None:
    """Raise ``ValueError`` unless every tensor is on the CPU in the dtype and layout the C code reads."""
    for name, t, dtype in (("qkv", qkv, torch.float32), ("cos", cos, torch.float32), ("sin", sin, torch.float32),
                           ("k_cache", k_cache, torch.float32), ("v_cache", v_cache, torch.float32),
                           ("out", out, torch.float32), ("slot_mapping", slot_mapping, torch.int64),
                           ("block_tables", block_tables, torch.int32), ("seq_lens", seq_lens, torch.int32)):
        if t.dtype != dtype or not t.is_cpu or t.stride(-1) != 1:
            raise ValueError(f"{name} must be a {dtype} CPU tensor with a unit last stride")


def load(cache_dir: Path) -> CpuKernels | None:
    """The kernels, compiled into ``cache_dir`` unless a build of this source for this machine is
    there already; ``None`` (with a warning logged) when they cannot be compiled or loaded."""
    try:
        return CpuKernels(ctypes.CDLL(str(_build(cache_dir))))
    except (OSError, subprocess.CalledProcessError) as exc:
        logger.warning("the CPU kernels are unavailable (%s); those layer ops run as PyTorch ops",
                       getattr(exc, "stderr", None) or exc)
        return None


def _build(cache_dir: Path) -> Path:
    """Compile :data:`SOURCE` once per machine into ``cache_dir`` and return the library's path.

    Raises:
        OSError: no C compiler, or the cache directory cannot be written.
        subprocess.CalledProcessError: the compiler failed.
    """
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise OSError(f"no C compiler {compiler!r} on PATH")
    key = hashlib.sha256("\0".join([SOURCE.read_text(), compiler, *CFLAGS, _cpu_identity()]).encode()).hexdigest()
    target = cache_dir / f"layer_ops-{key[:16]}.so"
    if target.is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(cache_dir / f"{target.name}.lock"):
        if not target.is_file():
            with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
                built = Path(tmp) / target.name
                subprocess.run([compiler, *CFLAGS, "-o", str(built), str(SOURCE), "-lm"],
                               check=True, capture_output=True, text=True)
                os.replace(built, target)
    return target


def _cpu_identity() -> str:
    """The CPU's model and feature flags (what ``-march=native`` compiles for), so that a cache
    directory shared by different machines never hands one a library built for another."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return os.uname().machine
    return "\n".join(sorted({line for line in lines if line.startswith(("model name", "flags"))}))
