"""Weights kept quantized on the CPU: group-wise integer codes with a scale and an offset per
group, computed with PyTorch's int4 weight-only matmul, or, for a prefill's prompt tokens, with
a dense bfloat16 matmul over the weight dequantized for the call.

The kernel is ``torch.ops.aten._weight_int4pack_mm_for_cpu`` (with its packing op
``_convert_weight_to_int4pack_for_cpu``): PyTorch's own, the one torchao's CPU int4 weight-only
layout (``Int4CPULayout``) dispatches to; we call it directly rather than through torchao, whose
tensor subclasses would bring a dependency for one op. It computes ``x @ W^T`` with
``W[n, k] = (q[n, k] - 8) * scale[k // group, n] + zero[k // group, n]``, ``q`` in ``[0, 16)``,
and reads 4 bits per weight plus the group's scale and zero. It is fast in bfloat16 only
(measured on a 2-core Zen 4: 15 µs for a 1536 x 576 matrix at one token, where its float32
path takes 620 µs and oneDNN's float32 sgemm 35 µs), so :class:`Int4Linear` casts its input to
bfloat16 and its output back; the rest of the model (norms, attention, the KV cache) keeps its
own dtype, float32 on the CPU, where PyTorch's CPU attention is 2-5x faster than in bfloat16.

The int4 kernel's time grows with the rows as a matrix-vector product's would (a 1536 x 576
weight on a 2-core Xeon: 33 µs at one row, 0.19 ms at 16, 1.7 ms at 150), while oneDNN's
bfloat16 GEMM over dense weights takes 0.1 ms at 16 rows and 0.23 at 150. So a prompt chunk
of at least :data:`DENSE_MIN_ROWS` tokens (:func:`prompt_chunks`) takes the weight dequantized
to bfloat16 by a C kernel (``kernels.cpu_ops.CpuKernels.dequantize_int4``, ~0.3 ms for that
weight, once a step) and a ``torch.mm`` of its own: the int4 matmuls of a 148-token prefill of
SmolLM2-135M took 230 ms of its 285, this way 96 of 146 (46 of them dequantizing). Every other
row (decodes, verifications, shorter chunks) keeps the int4 kernel, whose rows are computed
independently. So which path a row takes, and the GEMM's shape, depend on its own sequence's
chunk only, never on what else the step holds: a sequence's tokens are the same alone and in
any batch, with or without async scheduling (tests pin it). The codes are kept a second time for
it, packed two to a byte (:func:`kernels.reference.pack_int4`): half a byte per weight and
plane.

8-bit codes (GGUF's Q8_0) run losslessly as two int4 planes, ``c = 16 * hi + lo`` with ``hi``
in ``[-8, 8)`` and ``lo`` in ``[0, 16)``: two int4 matmuls summed, the same bytes as int8.
PyTorch's int8 weight-only kernel (``_weight_int8pack_mm``) takes one scale per row, not per
group of 32, so it could not hold Q8_0's scales without requantizing.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch import nn

from engine.layers.ops import cpu_kernels
from kernels.reference import pack_int4

# Tokens of a prompt chunk from which the dense matmul is faster than the int4 kernel,
# dequantization included (a 2-core Xeon, SmolLM2-135M's weights, through Int4Linear: a 1536 x 576
# weight takes 0.55 against 0.60 ms at 48 rows, 0.74 against 0.62 at 64; the other shapes cross alike).
DENSE_MIN_ROWS = 64

_PROMPT_CHUNKS: ContextVar[tuple[tuple[int, int], ...]] = ContextVar("prompt_chunks", default=())


@contextlib.contextmanager
def prompt_chunks(chunks: tuple[tuple[int, int], ...]) -> Iterator[None]:
    """Within the block, the :class:`Int4Linear` layers take the rows ``[start, end)`` of each of
    ``chunks`` (in row order, disjoint) as one prefill chunk of prompt tokens; the model runner
    sets it around each forward (``StepInputs.prompt_chunks``)."""
    token = _PROMPT_CHUNKS.set(chunks)
    try:
        yield
    finally:
        _PROMPT_CHUNKS.reset(token)


class _Scratch(threading.local):
    """A thread's bfloat16 buffer for the weight being dequantized: one for every layer, as the
    weight is used by one matmul right after (reused, not reallocated per call)."""

    def __init__(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.bfloat16)

    def take(self, rows: int, cols: int) -> torch.Tensor:
        if self.buffer.numel() < rows * cols:
            self.buffer = torch.empty(rows * cols, dtype=torch.bfloat16)
        return self.buffer[:rows * cols].view(rows, cols)


_scratch = _Scratch()


@dataclass
class GroupQuantized:
    """A ``[rows, cols]`` weight as integer codes in groups of ``group_size`` along ``cols``:
    ``w[r, c] = scale[r, c // group_size] * codes[r, c] + offset[r, c // group_size]``.

    Attributes:
        codes: ``[rows, cols]``, uint8 in ``[0, 2**bits)`` or int8 (signed) in
            ``[-2**(bits-1), 2**(bits-1))``.
        scale: ``[rows, cols // group_size]`` float32.
        offset: ``[rows, cols // group_size]`` float32.
        bits: bits per code, a multiple of 4.
        group_size: columns per group.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    bits: int
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self) -> torch.Tensor:
        """The float32 ``[rows, cols]`` weight."""
        expand = lambda t: t.repeat_interleave(self.group_size, dim=1)  # noqa: E731
        return self.codes.float() * expand(self.scale) + expand(self.offset)

    def rows(self, index: torch.Tensor | slice) -> GroupQuantized:
        """The rows at ``index`` (a permutation, a range), codes and groups alike."""
        return GroupQuantized(self.codes[index], self.scale[index], self.offset[index], self.bits, self.group_size)

    @staticmethod
    def cat(parts: list[GroupQuantized]) -> GroupQuantized:
        """``parts`` stacked along rows (a fused projection); they must share bits and group size.

        Raises:
            ValueError: the parts differ in bits or group size.
        """
        if len({(p.bits, p.group_size) for p in parts}) != 1:
            raise ValueError(f"cannot fuse weights of {sorted({(p.bits, p.group_size) for p in parts})} "
                             "(bits, group size)")
        return GroupQuantized(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]),
                              torch.cat([p.offset for p in parts]), parts[0].bits, parts[0].group_size)

    def int4_planes(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """This weight as int4 planes whose weights sum to it: ``[(q, scale, zero)]`` with ``q``
        ``[rows, cols]`` in ``[0, 16)`` and each plane's weight ``(q - 8) * scale + zero``.

        4-bit codes give one plane, 8-bit codes two (``c = 16 * hi + lo``), and so on, the top
        plane carrying the offset (and the sign of signed codes)."""
        signed = self.codes.dtype == torch.int8
        planes, rest, weight = [], self.codes.int(), 1
        for top in [False] * (self.bits // 4 - 1) + [True]:
            nibble = rest if top else rest & 15
            if not top:
                rest = rest >> 4
            scale = self.scale * weight
            if top and signed:  # nibble in [-8, 8): (nibble + 8 - 8) * scale
                planes.append((nibble + 8, scale, self.offset))
            else:  # nibble in [0, 16): (nibble - 8) * scale + 8 * scale
                planes.append((nibble, scale, 8 * scale + (self.offset if top else 0)))
            weight *= 16
        return planes


class Int4Linear(nn.Module):
    """``y = x @ W^T`` for a :class:`GroupQuantized` ``W``, in PyTorch's CPU int4 layout.

    Args:
        weight: ``[out_features, in_features]``; ``in_features`` a multiple of its group size.
        bias: ``[out_features]`` or ``None``.
        compute_dtype: the matmul's dtype (its input, scales and output): bfloat16.
        dense_prompt_chunks: whether prompt chunks take the dense matmul (a logits head's rows are
            never a prompt chunk's: it keeps no second copy of its codes).

    ``forward`` takes ``[num_tokens, in_features]`` and returns ``[num_tokens, out_features]`` in
    the input's dtype; the rows of a prompt chunk of :data:`DENSE_MIN_ROWS` tokens or more
    (:func:`prompt_chunks`) go through the dense matmul (module docstring) where the C kernels
    were built and the group size is a multiple of 32. Memory: 4 bits per weight and plane,
    twice, plus a scale and a zero per group.
    """

    def __init__(self, weight: GroupQuantized, bias: torch.Tensor | None = None,
                 compute_dtype: torch.dtype = torch.bfloat16, dense_prompt_chunks: bool = True) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.compute_dtype = compute_dtype
        self.bias = bias
        self.group_size = weight.group_size
        planes = weight.int4_planes()
        # [planes, groups, out, 2]: each plane's scale and zero per group, PyTorch's int4 layout
        self.scales_and_zeros = torch.stack([torch.stack([scale.t(), zero.t()], dim=-1) for _, scale, zero in planes]
                                            ).to(compute_dtype).contiguous()
        self.planes = [(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.int().contiguous(), 1), sz)
                       for (q, _, _), sz in zip(planes, self.scales_and_zeros)]
        self.nibbles = (pack_int4(torch.stack([q for q, _, _ in planes]), self.group_size)
                        if dense_prompt_chunks and self.group_size % 32 == 0 and compute_dtype == torch.bfloat16
                        else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_in = x.to(self.compute_dtype)
        chunks = [(a, b) for a, b in _PROMPT_CHUNKS.get() if b - a >= DENSE_MIN_ROWS]
        kernels = cpu_kernels() if chunks and self.nibbles is not None else None
        if kernels is None:
            out = self._int4(x_in)
        else:
            weight = kernels.dequantize_int4(self.nibbles, self.scales_and_zeros, self.group_size,
                                             _scratch.take(self.out_features, self.in_features)).t()
            parts, done = [], 0
            for start, end in chunks:  # the rows between chunks on the int4 kernel, each chunk a GEMM
                if start > done:
                    parts.append(self._int4(x_in[done:start]))
                parts.append(torch.mm(x_in[start:end], weight))
                done = end
            if done < x_in.shape[0]:
                parts.append(self._int4(x_in[done:]))
            out = torch.cat(parts) if len(parts) > 1 else parts[0]
        out = out.to(x.dtype)
        return out if self.bias is None else out.add_(self.bias.to(x.dtype))

    def _int4(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W^T`` by the int4 kernel, plane by plane, in the compute dtype."""
        out = None
        for packed, scales_and_zeros in self.planes:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, self.group_size, scales_and_zeros)
            out = y if out is None else out.add_(y)
        return out


class QuantizedEmbedding(nn.Module):
    """Token embedding looked up from a :class:`GroupQuantized` table, dequantizing only the
    rows a step asks for.

    Args:
        weight: ``[vocab_size, hidden_size]``.
        dtype: the dtype of the rows returned.

    ``forward`` takes ``[num_tokens]`` int64 ids and returns ``[num_tokens, hidden_size]``.
    """

    def __init__(self, weight: GroupQuantized, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = weight
        self.dtype = dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.weight.rows(input_ids).dequantize().to(self.dtype)


class RowInt8Linear(nn.Module):
    """``y ≈ x @ W^T`` with ``W`` requantized to int8 with one scale per row, through PyTorch's
    int8 weight-only matmul (``torch.ops.aten._weight_int8pack_mm``, in bfloat16): an
    approximation (each weight within half its row's step, ``max|W[r]| / 254``), for a shortlist
    that is then recomputed exactly, never for a model's own projections.

    Args:
        weight: ``[out_features, in_features]`` float32.

    ``forward`` takes ``[num_tokens, in_features]`` and returns ``[num_tokens, out_features]`` in
    the input's dtype (on bfloat16's grid). Memory: one byte per weight, a scale per row.
    """

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        scale = weight.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127
        self.codes = torch.round(weight / scale[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
        self.scale = scale.to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.codes, self.scale).to(x.dtype)


class QuantizedLogitsHead(nn.Module):
    """The logits head over a :class:`GroupQuantized` ``[vocab_size, hidden_size]`` weight, with
    float32 logits where they decide the output.

    A coarse matmul shortlists each row's ``refine`` best tokens; their logits are recomputed in
    float32 from the dequantized rows of the weight (the same weights, so exact up to float32
    summation) and written over the coarse ones. The coarse matmul's output is bfloat16: logits
    of 16-32 come out on a grid of 0.125, where near-ties become exact ties (greedy and
    ``top_k=1`` would pick different tokens) and the top log-probabilities lose their third
    digit; the recomputation removes both. The rest of the row keeps the coarse values (their
    error moves the softmax's normalizer by far less than the recomputation corrects).

    The coarse matmul is the weight's own int4 planes (:class:`Int4Linear`) for 4-bit codes; for
    8-bit codes (GGUF's Q8_0, the usual type of a tied embedding) it is a per-row int8
    requantization (:class:`RowInt8Linear`): one int8 matmul where the codes' two int4 planes
    take two, the same bytes in half the arithmetic (49152 x 576 on a 2-core Xeon: 7.9 against
    14.1 ms at 16 rows, 16 SmolLM2 streams 228 -> 241 tok/s; at one row, inside a decode step,
    both are bound by reading the 28 MB and take ~2.5 ms). Its extra error, within half a row's
    step per weight (~0.02 of a logit for SmolLM2-135M), is of the order of the bfloat16
    output's own, far below the gap that separates a row's best token from its 64th; the
    recomputed logits are exact either way (the accuracy workload's greedy tokens did not move).
    Measured on a 2-core Zen 4: ~70 µs per row at one row (top-k over 49152 and 64 rows
    dequantized), beside ~0.8 ms for the matmul.

    Args:
        weight: ``[vocab_size, hidden_size]``.
        refine: tokens per row recomputed in float32.

    ``forward`` takes ``[num_rows, hidden_size]`` and returns ``[num_rows, vocab_size]`` float32.
    """

    def __init__(self, weight: GroupQuantized, refine: int = 64) -> None:
        super().__init__()
        self.weight = weight
        self.linear = (RowInt8Linear(weight.dequantize()) if weight.bits == 8
                       else Int4Linear(weight, dense_prompt_chunks=False))
        self.refine = min(refine, weight.shape[0])

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden.float()
        logits = self.linear(hidden)  # float32 values on bfloat16's grid
        top = logits.topk(self.refine, dim=-1).indices  # [num_rows, refine]
        rows = self.weight.rows(top.flatten()).dequantize().view(*top.shape, -1)  # [num_rows, refine, hidden]
        exact = torch.bmm(rows, hidden.unsqueeze(2)).squeeze(2)
        return logits.scatter_(1, top, exact)
