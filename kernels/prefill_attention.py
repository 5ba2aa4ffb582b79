"""Paged prefill attention: causal attention of new query tokens over their paged context.

FlashAttention-2 (Dao, 2023) tiling and online softmax with PagedAttention (Kwon et al., SOSP
2023) addressing: one program per (query tile, sequence, query head) walks the KV tiles of its
sequence through the block table. KV tiles that lie wholly before the query tile's first query
run without a mask; the diagonal tiles apply the causal mask; tiles after the last query are
never visited. Covers plain, chunked and prefix-cached prefill alike.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels._launch import KernelLaunch, cdiv, check_cache, check_device, dot_inputs, next_power_of_2

__all__ = ["PagedPrefillLaunch", "launch_paged_prefill", "paged_prefill_attention"]

_LOG2E = 1.0 / math.log(2.0)


@triton.jit
def _attend_tiles(
    acc, l_i, m_i, q, k_base, v_base, table, lo, hi, q_pos, seq_len,
    stride_kb, stride_kt, stride_vb, stride_vt, scale_log2,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, CAUSAL: tl.constexpr,
):
    offs_n = tl.arange(0, BLOCK_N)
    d_mask = (tl.arange(0, BLOCK_D) < HEAD_DIM)[None, :]
    for tile in range(lo, hi, BLOCK_N):
        pos = tile + offs_n
        n_mask = pos < seq_len
        block = tl.load(table + pos // PAGE, mask=n_mask, other=0).to(tl.int64)
        row = pos % PAGE
        k = tl.load(k_base + block[:, None] * stride_kb + row[:, None] * stride_kt,
                    mask=n_mask[:, None] & d_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION) * scale_log2
        if CAUSAL:
            visible = (pos[None, :] <= q_pos[:, None]) & n_mask[None, :]
            qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + block[:, None] * stride_vb + row[:, None] * stride_vt,
                    mask=n_mask[:, None] & d_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


# The engine passes the prefill rows' slices of its step buffers, whose addresses move with the
# number of decode rows before them: no alignment specialization (one compiled variant).
@triton.jit(do_not_specialize_on_alignment=["block_tables_ptr", "seq_lens_ptr", "cu_seqlens_q_ptr"])
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, block_tables_ptr, cu_seqlens_q_ptr, seq_lens_ptr, scale_log2,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_bts,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    m_block = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    first_q_pos = seq_len - q_len + m_block * BLOCK_M  # absolute position of the tile's first query

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    md_mask = (offs_m < q_len)[:, None] & (offs_d < HEAD_DIM)[None, :]
    tokens = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + tokens[:, None] * stride_qt + head * stride_qh + offs_d[None, :] * stride_qd,
                mask=md_mask, other=0.0).to(DOT_DTYPE)
    q_pos = first_q_pos + tl.arange(0, BLOCK_M)

    kv_head = head // GROUP
    k_base = k_ptr + kv_head * stride_kh + offs_d[None, :] * stride_kd
    v_base = v_ptr + kv_head * stride_vh + offs_d[None, :] * stride_vd
    table = block_tables_ptr + seq.to(tl.int64) * stride_bts
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Keys [0, full_end) are visible to every query of the tile; [full_end, hi) need the mask.
    full_end = (first_q_pos + 1) // BLOCK_N * BLOCK_N
    hi = tl.minimum(seq_len, first_q_pos + BLOCK_M)
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, k_base, v_base, table, 0, full_end, q_pos, seq_len,
        stride_kb, stride_kt, stride_vb, stride_vt, scale_log2,
        HEAD_DIM, PAGE, BLOCK_N, BLOCK_D, DOT_DTYPE, DOT_PRECISION, False,
    )
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, k_base, v_base, table, full_end, hi, q_pos, seq_len,
        stride_kb, stride_kt, stride_vb, stride_vt, scale_log2,
        HEAD_DIM, PAGE, BLOCK_N, BLOCK_D, DOT_DTYPE, DOT_PRECISION, True,
    )
    out = acc / l_i[:, None]
    tl.store(out_ptr + tokens[:, None] * stride_ot + head * stride_oh + offs_d[None, :] * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=md_mask)


def _default_config(device: torch.device, head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages); K+V tiles of all stages fit in shared memory
    and the Q tile and accumulator in registers."""
    if device.type == "cpu":
        return 16, 16, 1, 1
    if head_dim > 128:
        return 64, 32, 8, 2
    if dtype == torch.float32:
        return 64, 64, 4, 2
    return 64, 64, 4, 3


class PagedPrefillLaunch:
    """:func:`paged_prefill_attention`'s launch for one shape, prepared once and run per call
    (the checks, the tile config, the grid and the integer arguments worked out here, as
    :class:`kernels.decode_attention.PagedDecodeLaunch` does for the layers of one engine step).

    Args:
        q, k_cache, v_cache, out: examples of what each call passes (shapes, strides, dtypes and
            device; not kept), as :func:`paged_prefill_attention` takes them.
        block_tables, cu_seqlens_q, seq_lens, scale, max_query_len: as
            :func:`paged_prefill_attention`; the same for every call.
        config: ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``, BLOCK_M and BLOCK_N powers of two
            >= 16; None picks the per-device default.

    Raises:
        ValueError, RuntimeError: as :func:`paged_prefill_attention`.
    """

    def __init__(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
        cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float, out: torch.Tensor,
        max_query_len: int | None = None, config: tuple[int, int, int, int] | None = None,
    ) -> None:
        device = check_device(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens)
        check_cache(k_cache, v_cache)
        total_tokens, num_q_heads, head_dim = q.shape
        _, page, num_kv_heads, cache_head_dim = k_cache.shape
        num_seqs = seq_lens.shape[0]
        if cache_head_dim != head_dim or num_q_heads % num_kv_heads or cu_seqlens_q.shape != (num_seqs + 1,):
            raise ValueError(
                f"q {tuple(q.shape)}, cu_seqlens_q {tuple(cu_seqlens_q.shape)}, seq_lens "
                f"{tuple(seq_lens.shape)} do not fit cache {tuple(k_cache.shape)}"
            )
        if out.shape != q.shape:
            raise ValueError(f"out {tuple(out.shape)} must have q's shape {tuple(q.shape)}")
        self.empty = total_tokens == 0 or num_seqs == 0
        if self.empty:
            return
        if max_query_len is None:
            max_query_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
        block_m, block_n, num_warps, num_stages = config or _default_config(device, head_dim, k_cache.dtype)
        dot_dtype, precision = dot_inputs(k_cache.dtype, q.dtype, device)
        self.tables = (block_tables, cu_seqlens_q, seq_lens, scale * _LOG2E)
        self.args = (*q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(), block_tables.stride(0))
        self.launch = KernelLaunch(_prefill_kernel, (cdiv(max_query_len, block_m), num_seqs, num_q_heads), dict(
            GROUP=num_q_heads // num_kv_heads, HEAD_DIM=head_dim, PAGE=page,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=next_power_of_2(head_dim),
            DOT_DTYPE=dot_dtype, DOT_PRECISION=precision, num_warps=num_warps, num_stages=num_stages,
        ))

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor) -> None:
        """Attend ``q`` over the caches into ``out``: tensors like the examples this was
        prepared with, unchecked."""
        if not self.empty:
            self.launch(q, k_cache, v_cache, out, *self.tables, *self.args)


def launch_paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    max_query_len: int | None = None,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """:func:`paged_prefill_attention` with its tile config exposed (tests and benchmarks):
    ``config`` as :class:`PagedPrefillLaunch` takes it."""
    if out is None:
        out = torch.empty_like(q)
    PagedPrefillLaunch(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, out,
                       max_query_len=max_query_len, config=config)(q, k_cache, v_cache, out)
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new query tokens over its whole paged context (Triton).

    FlashAttention-2 tiling with online softmax over PagedAttention blocks; fully masked KV
    tiles are skipped. The new tokens' K/V must already be in the cache: sequence ``s`` has
    ``q_len = cu_seqlens_q[s+1] - cu_seqlens_q[s]`` new tokens, the last ``q_len`` of its
    ``seq_lens[s]`` cached ones, and query ``j`` sees keys ``0 .. seq_lens[s] - q_len + j``.

    Args:
        q: ``[total_q_tokens, num_q_heads, head_dim]``, any strides.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, any strides,
            float32/float16/bfloat16 or float8_e4m3fn (upcast after each tile's load);
            ``num_q_heads % num_kv_heads == 0``.
        block_tables: ``[num_seqs, max_blocks_per_seq]`` int32.
        cu_seqlens_q: ``[num_seqs + 1]`` int32 prefix sums of query lengths (starts at 0).
        seq_lens: ``[num_seqs]`` int32, context length including the new tokens.
        scale: softmax scale.
        out: optional ``[total_q_tokens, num_q_heads, head_dim]`` output buffer (any strides).
        max_query_len: ``max(q_len)``, sizes the grid (a host sync computes it when None).
        max_seq_len: accepted for signature parity with the reference; the kernel reads each
            sequence's length on the device and needs no bound.

    Returns:
        ``[total_q_tokens, num_q_heads, head_dim]`` in q's dtype.

    Raises:
        ValueError: shapes that do not fit together.
        RuntimeError: CPU tensors without ``TRITON_INTERPRET=1``.
    """
    return launch_paged_prefill(
        q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale,
        out=out, max_query_len=max_query_len,
    )
