"""Attention over the paged KV cache: per-step metadata and the backend that runs it.

The model runner orders each step's batch with decode sequences (one new token each) first
and prefill chunks after them, so one backend call per layer splits cleanly into a decode
part (``paged_decode_attention``) and a prefill part (``paged_prefill_attention``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

import kernels
import kernels.reference
from engine.layers.ops import cpu_kernels
from kernels.cpu_ops import CpuKernels


@dataclass
class AttentionMetadata:
    """What one forward step's attention needs, built once per step by the model runner.

    Attributes:
        slot_mapping: ``[num_tokens]`` int64 cache slot of every new token (-1: skip).
        block_tables: ``[num_seqs, max_blocks_per_seq]`` int32.
        seq_lens: ``[num_seqs]`` int32 tokens in the cache after this step's writes.
        query_start_loc: ``[num_seqs + 1]`` int32 prefix sums of new tokens per sequence.
        num_decodes: the first ``num_decodes`` sequences have exactly one new token.
        max_query_len: host int, the longest prefill chunk (0 when there is none).
        max_seq_len: host int, ``max(seq_lens)``.
        max_decode_seq_len: host int, the longest decode context (0 when there is none).
        num_kv_splits: the decode kernel's slices per context (a CUDA graph's fixed count);
            ``None``: the kernel's default for ``max_decode_seq_len``.
        attn_out: ``[num_tokens, num_q_heads * head_dim]`` where the CUDA backend writes each
            layer's attention output (the buffer the piecewise graphs read it from, so it needs
            no copy there); ``None``: a buffer of the backend's own (the CPU backend always).
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    num_decodes: int
    max_query_len: int
    max_seq_len: int
    max_decode_seq_len: int
    num_kv_splits: int | None = None
    attn_out: torch.Tensor | None = None

    @functools.cached_property
    def prefill_query_start_loc(self) -> torch.Tensor:
        """``[num_seqs - num_decodes + 1]`` int32 prefix sums of the prefill chunks' new tokens,
        from 0 (their rows follow the decode rows): one op per step, not one per layer."""
        return self.query_start_loc[self.num_decodes:] - self.num_decodes


class PagedAttentionBackend:
    """Writes new K/V into the cache and attends over it, through one kernel module.

    Args:
        ops: a module with ``write_kv_cache``, ``paged_decode_attention`` and
            ``paged_prefill_attention`` (``kernels.reference`` on CPU, ``kernels`` for Triton).
    """

    def __init__(self, ops: ModuleType = kernels.reference) -> None:
        self.ops = ops

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Run one layer's attention for the step.

        Args:
            query: ``[num_tokens, num_q_heads, head_dim]``.
            key, value: ``[num_tokens, num_kv_heads, head_dim]`` (after RoPE for key).
            k_cache, v_cache: this layer's ``[num_blocks, block_size, num_kv_heads, head_dim]`` views.
            metadata: the step's :class:`AttentionMetadata`.
            scale: softmax scale.

        Returns:
            ``[num_tokens, num_q_heads, head_dim]`` in query's dtype.
        """
        self.write_kv(key, value, k_cache, v_cache, metadata)
        return self.attend(query, k_cache, v_cache, metadata, scale)

    def rope_attention(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                       k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: AttentionMetadata,
                       num_q_heads: int, scale: float) -> torch.Tensor | None:
        """RoPE and :meth:`forward` from the fused QKV projection, in fewer launches where this
        backend has a way for the step: ``qkv`` ``[num_tokens, (num_q_heads + 2 * num_kv_heads) *
        head_dim]`` and ``rope`` ``(cos, sin)`` (``[num_tokens, 1, head_dim // 2]`` each) ->
        ``[num_tokens, num_q_heads * head_dim]``; ``None`` when it has none (the caller then applies
        RoPE and calls :meth:`forward`). Here always: RoPE and the KV write are one kernel
        (``rotary_write_kv_cache``), then :meth:`attend`."""
        num_tokens, (_, _, num_kv_heads, head_dim) = qkv.shape[0], k_cache.shape
        q, k, v = qkv.view(num_tokens, -1, head_dim).split([num_q_heads, num_kv_heads, num_kv_heads], dim=1)
        query = self.ops.rotary_write_kv_cache(q, k, v, *rope, k_cache, v_cache, metadata.slot_mapping)
        return self.attend(query, k_cache, v_cache, metadata, scale).view(num_tokens, num_q_heads * head_dim)

    def attend(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        """The step's attention over the cache, its new K/V already written: ``query``
        ``[num_tokens, num_q_heads, head_dim]`` -> a new tensor like it (decode rows by
        :meth:`decode`, prefill rows by :meth:`prefill`)."""
        md = metadata
        out = torch.empty_like(query)
        nd = md.num_decodes
        if nd:
            self.decode(query[:nd], k_cache, v_cache, md, scale, out[:nd])
        if md.max_query_len:
            self.prefill(query[nd:], k_cache, v_cache, md, scale, out[nd:])
        return out

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 metadata: AttentionMetadata) -> None:
        """Write the step's new K/V (``[num_tokens, num_kv_heads, head_dim]``) at their slots."""
        self.ops.write_kv_cache(key, value, k_cache, v_cache, metadata.slot_mapping)

    def prefill(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                metadata: AttentionMetadata, scale: float, out: torch.Tensor) -> None:
        """Attention of the step's prefill chunks (``query`` ``[num_tokens - num_decodes,
        num_q_heads, head_dim]``, the rows after the decode tokens) into ``out``, like it."""
        md, nd = metadata, metadata.num_decodes
        self.ops.paged_prefill_attention(
            query, k_cache, v_cache, md.block_tables[nd:], md.prefill_query_start_loc, md.seq_lens[nd:], scale,
            out=out, max_query_len=md.max_query_len, max_seq_len=md.max_seq_len,
        )

    def decode(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               metadata: AttentionMetadata, scale: float, out: torch.Tensor) -> None:
        """Attention of the step's ``num_decodes`` decode tokens (``query``
        ``[num_decodes, num_q_heads, head_dim]``) into ``out``, like it."""
        nd = metadata.num_decodes
        self.ops.paged_decode_attention(query, k_cache, v_cache, metadata.block_tables[:nd], metadata.seq_lens[:nd],
                                        scale, out=out, max_seq_len=metadata.max_decode_seq_len,
                                        num_splits=metadata.num_kv_splits)


class TritonPagedAttentionBackend(PagedAttentionBackend):
    """The CUDA backend: the Triton kernels, their launches prepared once a step.

    An eager step's attention (a prompt chunk's, between two piecewise graphs) is bound by the
    host: each layer worked out three or four launches (checks, split counts, tile configs, some
    thirty integer arguments each), allocated their outputs and went through Triton's JIT for
    each. The layers of one step attend with the same shapes over caches of one layout, so the
    step's first layer prepares the launches (:class:`_StepLaunches`, the kernels' ``*Launch``
    classes, which check what they are given, then launch the compiled kernels directly) and
    every layer runs them; the rotated query and the attention output are one buffer each for
    the step's layers (each layer's are read before the next layer's are written: one stream
    orders them), the latter ``metadata.attn_out`` where given. Launching each kernel through its
    entry point and Triton's JIT would cost an H200's host about as long as the layer's device
    work (docs/engine.md, "Launches").

    Args:
        ops: the kernel package (``kernels``; under ``TRITON_INTERPRET=1`` on the CPU, tests).
    """

    def __init__(self, ops: ModuleType = kernels) -> None:
        super().__init__(ops)
        self._metadata: AttentionMetadata | None = None
        self._step: _StepLaunches | None = None

    def rope_attention(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                       k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: AttentionMetadata,
                       num_q_heads: int, scale: float) -> torch.Tensor:
        """As the base class's: RoPE and the KV write in one launch, then the attention."""
        num_tokens, (_, _, num_kv_heads, head_dim) = qkv.shape[0], k_cache.shape
        q, k, v = qkv.view(num_tokens, -1, head_dim).split([num_q_heads, num_kv_heads, num_kv_heads], dim=1)
        step = self._step
        if metadata is not self._metadata or step.rotary is None:
            query = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            step = self._prepare(metadata, query, k_cache, v_cache, scale)
            step.rotary = self.ops.RotaryWriteKVLaunch(q, k, v, *rope, k_cache, v_cache, metadata.slot_mapping, query)
        step.rotary(q, k, v, k_cache, v_cache, step.query)
        return step.attend(step.query, k_cache, v_cache).view(num_tokens, num_q_heads * head_dim)

    def attend(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        """As the base class's, into the step's output buffer."""
        step = self._step
        if metadata is not self._metadata or step.rotary is not None:
            step = self._prepare(metadata, query, k_cache, v_cache, scale)
        return step.attend(query, k_cache, v_cache)

    def _prepare(self, metadata: AttentionMetadata, query: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, scale: float) -> _StepLaunches:
        """The step's launches, from its first layer's tensors (the metadata object held here
        keeps its identity from being reused by the next step's)."""
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device) if metadata.attn_out is None \
            else metadata.attn_out.view(query.shape)
        self._step = _StepLaunches(self.ops, query, k_cache, v_cache, metadata, scale, out)
        self._metadata = metadata
        return self._step


class _StepLaunches:
    """One step's attention launches, prepared from its first layer's tensors.

    Attributes:
        query: the example query ``[num_tokens, num_q_heads, head_dim]`` (the step's rotated
            query buffer on the RoPE path); its decode and prefill rows are sliced once.
        out: the step's output buffer, like ``query``.
        rotary: the RoPE + KV write launch (:meth:`TritonPagedAttentionBackend.rope_attention`'s
            steps), else ``None``.
    """

    def __init__(self, ops: ModuleType, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 md: AttentionMetadata, scale: float, out: torch.Tensor) -> None:
        nd = self.num_decodes = md.num_decodes
        self.query, self.out, self.rotary = query, out, None
        self.query_rows, self.out_rows = (query[:nd], query[nd:]), (out[:nd], out[nd:])
        self.decode = ops.PagedDecodeLaunch(
            query[:nd], k_cache, v_cache, md.block_tables[:nd], md.seq_lens[:nd], scale, out[:nd],
            max_seq_len=md.max_decode_seq_len, num_splits=md.num_kv_splits) if nd else None
        self.prefill = ops.PagedPrefillLaunch(
            query[nd:], k_cache, v_cache, md.block_tables[nd:], md.prefill_query_start_loc, md.seq_lens[nd:],
            scale, out[nd:], max_query_len=md.max_query_len) if md.max_query_len else None

    def attend(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """One layer's attention of ``query`` (like :attr:`query`) into :attr:`out`, returned."""
        nd = self.num_decodes
        decode_rows, prefill_rows = self.query_rows if query is self.query else (query[:nd], query[nd:])
        if self.decode is not None:
            self.decode(decode_rows, k_cache, v_cache, self.out_rows[0])
        if self.prefill is not None:
            self.prefill(prefill_rows, k_cache, v_cache, self.out_rows[1])
        return self.out


class CpuPagedAttentionBackend(PagedAttentionBackend):
    """The CPU backend: :mod:`kernels.reference`'s computation, with the step's indexing (slots
    to block and offset, the decode sequences' block gather, their padding mask) worked out once
    per step and shared by every layer rather than redone in each. A decode step of a small
    model on the CPU is bound by such per-op overhead, not by arithmetic (SmolLM2-135M: ~40 ops
    per layer for attention alone, a few µs each).

    Like the reference, the decode attention runs in float32 whatever the cache's dtype
    (PyTorch's CPU attention is also 2-5x faster in float32 than in bfloat16 at decode sizes):
    both backends compute the same values. An fp8 cache is written with the reference's
    saturating cast and read upcast to float32, as the reference does.

    Over a float32 cache, a step's decode tokens run each layer's RoPE, KV write and attention as
    one C call (:meth:`kernels.cpu_ops.CpuKernels.rope_decode_attention`) when ``cpu_kernels`` is
    given, whatever else the step holds (its prefill chunks then go the reference's way).

    Args:
        cpu_kernels: the compiled C kernels, or ``None`` (PyTorch ops only).
    """

    def __init__(self, cpu_kernels: CpuKernels | None = None) -> None:
        super().__init__(kernels.reference)
        self.cpu_kernels = cpu_kernels
        self._metadata: AttentionMetadata | None = None
        self._plan: _StepPlan | None = None

    def rope_attention(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                       k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: AttentionMetadata,
                       num_q_heads: int, scale: float) -> torch.Tensor | None:
        """The C call below where it applies (a float32 cache and C kernels), else ``None``: the
        reference's RoPE and :meth:`forward` then run as the model calls them."""
        if self.cpu_kernels is None or qkv.dtype != torch.float32 or k_cache.dtype != torch.float32:
            return None
        md, nd, (_, _, num_kv_heads, head_dim) = metadata, metadata.num_decodes, k_cache.shape
        out = qkv.new_empty(qkv.shape[0], num_q_heads * head_dim)
        cos, sin = rope
        # Decode rows always take the C call, with or without prefill chunks in the step: a decode
        # token's result must not depend on what it is batched with (the float32 rounding of the
        # two paths differs, and the quantized path turns that into different greedy tokens).
        if not md.max_query_len:  # decode only: every row (no slicing, ~8 ops a layer)
            return self.cpu_kernels.rope_decode_attention(qkv, cos, sin, k_cache, v_cache, md.slot_mapping,
                                                          md.block_tables, md.seq_lens, num_q_heads, scale, out)
        self.cpu_kernels.rope_decode_attention(qkv[:nd], cos[:nd], sin[:nd], k_cache, v_cache, md.slot_mapping[:nd],
                                               md.block_tables[:nd], md.seq_lens[:nd], num_q_heads, scale, out[:nd])
        # the prefill chunks: as forward() computes them
        q, k, v = qkv[nd:].view(-1, num_q_heads + 2 * num_kv_heads, head_dim).split(
            [num_q_heads, num_kv_heads, num_kv_heads], dim=1)
        q, k = self.ops.rotary_embedding(q, k, cos[nd:], sin[nd:])
        self.ops.write_kv_cache(k, v, k_cache, v_cache, md.slot_mapping[nd:])
        self.prefill(q, k_cache, v_cache, md, scale, out[nd:].view(-1, num_q_heads, head_dim))
        return out

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 metadata: AttentionMetadata) -> None:
        plan = self._plan_for(metadata, k_cache)
        if plan.write_rows is not None:
            key, value = key[plan.write_rows], value[plan.write_rows]
        k_cache[plan.write_blocks, plan.write_offsets] = kernels.reference.to_cache_dtype(key, k_cache.dtype)
        v_cache[plan.write_blocks, plan.write_offsets] = kernels.reference.to_cache_dtype(value, v_cache.dtype)

    def decode(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               metadata: AttentionMetadata, scale: float, out: torch.Tensor) -> None:
        plan = self._plan_for(metadata, k_cache)
        nd, (_, _, num_kv_heads, head_dim) = query.shape[0], k_cache.shape
        # the sequences' blocks in order, [num_decodes, blocks * block_size, num_kv_heads, head_dim],
        # as [num_decodes, num_kv_heads, context, head_dim]: one gather of whole blocks (an
        # index_select, several times cheaper than indexing the heads too)
        k, v = (cache.index_select(0, plan.decode_blocks).view(nd, -1, num_kv_heads, head_dim).transpose(1, 2).float()
                for cache in (k_cache, v_cache))
        q = query.float().unsqueeze(2)  # [num_decodes, num_q_heads, 1, head_dim]
        result = F.scaled_dot_product_attention(q, k, v, attn_mask=plan.decode_mask, scale=scale, enable_gqa=True)
        out.copy_(result.squeeze(2))

    def _plan_for(self, metadata: AttentionMetadata, k_cache: torch.Tensor) -> _StepPlan:
        """This step's :class:`_StepPlan`, computed at the step's first layer. A step is one
        :class:`AttentionMetadata` object (the model runner builds one per step; the one held
        here keeps its identity from being reused by the next)."""
        if metadata is not self._metadata:
            self._plan, self._metadata = _StepPlan.of(metadata, k_cache), metadata
        return self._plan


@dataclass
class _StepPlan:
    """One step's cache indexing, shared by every layer.

    Attributes:
        write_rows: ``[n]`` int64 rows of the step's tokens written to the cache (``None``: all).
        write_blocks, write_offsets: ``[n]`` int64 block and offset of each written token.
        decode_blocks: ``[num_decodes * blocks]`` int64, each decode sequence's first blocks
            (enough for the longest context), one sequence after the other.
        decode_mask: ``[num_decodes, 1, 1, blocks * block_size]`` bool, True at context positions.
    """

    write_rows: torch.Tensor | None
    write_blocks: torch.Tensor
    write_offsets: torch.Tensor
    decode_blocks: torch.Tensor
    decode_mask: torch.Tensor

    @staticmethod
    def of(md: AttentionMetadata, k_cache: torch.Tensor) -> _StepPlan:
        block_size = k_cache.shape[1]
        slots = md.slot_mapping
        keep = slots >= 0
        rows = None if bool(keep.all()) else keep.nonzero().squeeze(1)
        if rows is not None:
            slots = slots[rows]
        nd = md.num_decodes
        num_blocks = -(-md.max_decode_seq_len // block_size)
        positions = torch.arange(num_blocks * block_size)
        mask = positions[None, :] < md.seq_lens[:nd, None].long()
        return _StepPlan(rows, slots // block_size, slots % block_size,
                         md.block_tables[:nd, :num_blocks].reshape(-1).long(),
                         mask[:, None, None, :])


def get_attention_backend(device: torch.device) -> PagedAttentionBackend:
    """Return the Triton backend (:class:`TritonPagedAttentionBackend`) on CUDA, the CPU backend
    (:class:`CpuPagedAttentionBackend`, with the C kernels where a compiler built them) elsewhere."""
    if device.type == "cuda":
        return TritonPagedAttentionBackend()
    return CpuPagedAttentionBackend(cpu_kernels())
