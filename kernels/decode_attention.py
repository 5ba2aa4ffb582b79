"""Paged decode attention: one new query token per sequence over its paged KV cache.

PagedAttention (Kwon et al., SOSP 2023) addressing, FlashAttention-2 online softmax (Dao,
2023) and Flash-Decoding's split-KV (Dao et al., 2023): the context of each (sequence, KV head)
is cut into ``num_splits`` contiguous slices, one program per slice computes a partial output
and its log-sum-exp, and a second kernel merges the slices. One program serves all query heads
of its KV head (GQA/MQA groups padded to 16 rows for ``tl.dot``), so K and V are read once.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels._launch import KernelLaunch, check_cache, check_device, dot_inputs, next_power_of_2, sm_count

__all__ = [
    "PagedDecodeLaunch", "launch_paged_decode", "launch_variants", "long_tail_splits", "num_kv_splits",
    "paged_decode_attention",
]

# Split heuristic: about one program per SM (each keeps two or three K/V tiles in flight), but no
# slice shorter than MIN_SPLIT_TOKENS tokens.
MIN_SPLIT_TOKENS = 128
MAX_SPLITS = 64
_LOG2E = 1.0 / math.log(2.0)


# Arguments that change with the split count are not value-specialized, so the compiled variants
# depend only on the constexprs (see launch_variants, which lists them for a warm-up).
@triton.jit(do_not_specialize=["stride_os", "stride_oh", "stride_osp", "stride_od", "stride_ls", "stride_lh",
                               "stride_lsp", "num_splits"])
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, lse_ptr, scale_log2,
    stride_qs, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_bts,
    stride_os, stride_oh, stride_osp, stride_od,
    stride_ls, stride_lh, stride_lsp, num_splits,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, STORE_LSE: tl.constexpr,
    KV_EVICTION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # Slice length depends only on this sequence's length: correct for any launch-time max_seq_len.
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + offs_h
    hd_mask = (offs_h < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(
        q_ptr + seq.to(tl.int64) * stride_qs + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=hd_mask, other=0.0,
    ).to(DOT_DTYPE)

    k_base = k_ptr + kv_head * stride_kh + offs_d[None, :] * stride_kd
    v_base = v_ptr + kv_head * stride_vh + offs_d[None, :] * stride_vd
    table = block_tables_ptr + seq.to(tl.int64) * stride_bts
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    # Physical block of each token of the next tile, loaded one tile ahead: the K/V loads then
    # depend on no load of their own iteration, so the software pipeliner can give them
    # num_stages - 1 buffers instead of one.
    next_block = tl.load(table + (start + offs_n) // PAGE, mask=start + offs_n < end, other=0)
    for tile in range(start, end, BLOCK_N):
        pos = tile + offs_n
        n_mask = pos < end
        block = next_block.to(tl.int64)
        after = pos + BLOCK_N
        next_block = tl.load(table + after // PAGE, mask=after < end, other=0)
        row = pos % PAGE
        nd_mask = n_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
        k = tl.load(k_base + block[:, None] * stride_kb + row[:, None] * stride_kt, mask=nd_mask, other=0.0,
                    eviction_policy=KV_EVICTION)
        qk = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION) * scale_log2
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + block[:, None] * stride_vb + row[:, None] * stride_vt, mask=nd_mask, other=0.0,
                    eviction_policy=KV_EVICTION)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        m_i = m_new

    # An empty slice (short sequence, many splits) stores output 0 and LSE -inf: weight 0 in the merge.
    nonempty = l_i > 0.0
    l_safe = tl.where(nonempty, l_i, 1.0)
    out = acc / l_safe[:, None]
    o_ptrs = out_ptr + seq.to(tl.int64) * stride_os + split * stride_osp + heads[:, None] * stride_oh
    tl.store(o_ptrs + offs_d[None, :] * stride_od, out.to(out_ptr.dtype.element_ty), mask=hd_mask)
    if STORE_LSE:
        lse = tl.where(nonempty, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))  # * ln 2
        l_ptrs = lse_ptr + seq.to(tl.int64) * stride_ls + split * stride_lsp + heads * stride_lh
        tl.store(l_ptrs, lse, mask=offs_h < GROUP)


@triton.jit(do_not_specialize=["stride_ps", "stride_ph", "stride_psp", "stride_pls", "stride_plh", "num_splits"])
def _decode_merge_kernel(
    part_ptr, part_lse_ptr, out_ptr, lse_ptr,
    stride_ps, stride_ph, stride_psp,
    stride_pls, stride_plh,
    stride_os, stride_oh, stride_od,
    stride_ls, stride_lh, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    STORE_LSE: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM
    part_lse = tl.load(part_lse_ptr + seq * stride_pls + head * stride_plh + offs_s, mask=s_mask,
                       other=float("-inf"))
    m = tl.max(part_lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # seq_len 0 (a padding slot): every slice is empty
    w = tl.exp(part_lse - m)
    part = tl.load(
        part_ptr + seq * stride_ps + head * stride_ph + offs_s[:, None] * stride_psp + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :], other=0.0,
    )
    total = tl.sum(w, 0)
    total_safe = tl.where(total > 0.0, total, 1.0)
    out = tl.sum(part * w[:, None], 0) / total_safe
    tl.store(out_ptr + seq * stride_os + head * stride_oh + offs_d * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=d_mask)
    if STORE_LSE:
        lse = tl.where(total > 0.0, m + tl.log(total_safe), float("-inf"))
        tl.store(lse_ptr + seq * stride_ls + head * stride_lh, lse)


def num_kv_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Slices per (sequence, KV head) for split-KV decode.

    Aims for about ``num_sms`` programs, so one long sequence and hundreds of short ones both fill
    the GPU and a batch that already fills it is not split, without slices under
    ``MIN_SPLIT_TOKENS`` tokens. ``max_seq_len`` is rounded up to a power of two first, so a
    captured CUDA graph serves a whole length bucket.
    """
    bucket = next_power_of_2(max(1, max_seq_len))
    wanted = round(num_sms / (num_seqs * num_kv_heads))
    return max(1, min(wanted, bucket // MIN_SPLIT_TOKENS, MAX_SPLITS))


def long_tail_splits(num_kv_heads: int, num_sms: int) -> int:
    """Slices per (sequence, KV head) for a batch whose longest context dwarfs the others.

    :func:`num_kv_splits` aims at ``num_sms`` programs for the whole batch, as if every context
    were as long as the longest: a batch of 16 sequences (8 KV heads) is not split, so a 3.5k-token
    context among 400-token ones is read by 8 programs while the other SMs wait. This count gives
    that one sequence about two programs per SM by itself. Measured inside CUDA graphs on an H200
    (Llama-3-8B's 32/8 heads of 128, one layer; docs/kernels.md, "Long tails"): 16 sequences of
    which one holds 3500 tokens, 64.9 µs unsplit against 25.7 at 8 slices; sixteen 400-token
    contexts, 11.3 against 13.6.
    """
    return max(1, min(round(num_sms / (2 * num_kv_heads)), MAX_SPLITS))


def launch_variants(
    num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device, max_num_seqs: int,
    max_seq_len: int,
) -> list[tuple[int, int]]:
    """One ``(num_seqs, max_seq_len)`` example per distinct compiled kernel variant that
    :func:`paged_decode_attention` launches for batches of up to ``max_num_seqs`` sequences with
    contexts of up to ``max_seq_len`` tokens: calling it once with each compiles everything a
    server will need (the variants differ in the split count's class and the tile config)."""
    num_sms = sm_count(device)
    examples: dict[tuple, tuple[int, int]] = {}
    bucket = 1
    while True:
        for num_seqs in range(1, max_num_seqs + 1):
            splits = num_kv_splits(num_seqs, num_kv_heads, bucket, num_sms)
            config = _default_config(device, head_dim, dtype, num_seqs * num_kv_heads * splits / num_sms)
            key = (splits == 1, next_power_of_2(splits), config)
            examples.setdefault(key, (num_seqs, bucket))
        if bucket >= max_seq_len:
            return list(examples.values())
        bucket *= 2


def _default_config(
    device: torch.device, head_dim: int, dtype: torch.dtype, programs_per_sm: float,
) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) for the split kernel; K+V tiles of all stages fit in
    shared memory. Measured on an H100 (docs/kernels.md): with under two programs per SM a
    third stage keeps enough bytes in flight; with more, two stages leave room for more
    resident programs. An fp8 cache takes tiles of twice the tokens, the same bytes: 128 seqs x
    2400 tokens, 8 KV heads of 128: 372 µs against 416 µs with the 16-bit tiles (bfloat16: 523 µs);
    the per-element upcast, not the bytes, then bounds it (1.7 TB/s of K+V against bfloat16's 2.4)."""
    if device.type == "cpu":
        return 32, 1, 1
    if head_dim > 128 or dtype == torch.float32:
        return 32, 4, 2
    if dtype.itemsize == 1:
        return 128, 4, 3
    return 64, 4, 3 if programs_per_sm < 2 else 2


class PagedDecodeLaunch:
    """:func:`paged_decode_attention`'s launches for one shape, prepared once and run per call.

    Everything a launch needs besides the query, the caches and the output (the checks, the
    split count, the tile config, the grids, the integer arguments, the split buffers) is worked
    out here, so a call only launches: what an engine step's layers need, each attending with
    the same shapes over its own layer's cache (an eager step is bound by its host time,
    docs/engine.md, "Launches").

    Args:
        q, k_cache, v_cache, out: examples of what each call passes (shapes, strides, dtypes and
            device; the tensors themselves are not kept), as :func:`paged_decode_attention` takes
            them.
        block_tables, seq_lens, scale, return_lse, max_seq_len, num_splits: as
            :func:`paged_decode_attention`; the same for every call.
        block_n, num_warps, num_stages, kv_eviction: the tuning knobs of :func:`launch_paged_decode`.

    Raises:
        ValueError, RuntimeError: as :func:`paged_decode_attention`.
    """

    def __init__(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
        seq_lens: torch.Tensor, scale: float, out: torch.Tensor, return_lse: bool = False,
        max_seq_len: int | None = None, num_splits: int | None = None, block_n: int | None = None,
        num_warps: int | None = None, num_stages: int | None = None, kv_eviction: str = "",
    ) -> None:
        device = check_device(q, k_cache, v_cache, block_tables, seq_lens)
        check_cache(k_cache, v_cache)
        num_seqs, num_q_heads, head_dim = q.shape
        _, page, num_kv_heads, cache_head_dim = k_cache.shape
        if cache_head_dim != head_dim or num_q_heads % num_kv_heads:
            raise ValueError(
                f"q {tuple(q.shape)} does not fit cache {tuple(k_cache.shape)}: head_dim must match and "
                "num_q_heads must be a multiple of num_kv_heads"
            )
        if out.shape != q.shape:
            raise ValueError(f"out {tuple(out.shape)} must have q's shape {tuple(q.shape)}")
        out_strides = out.stride()
        self.num_seqs = num_seqs
        # Without return_lse the kernels never store through lse; the output stands in as its pointer.
        self.lse = torch.empty(num_seqs, num_q_heads, dtype=torch.float32, device=device) if return_lse else None
        if num_seqs == 0:
            return
        if num_splits is None:
            if max_seq_len is None:
                max_seq_len = int(seq_lens.max())
            num_splits = num_kv_splits(num_seqs, num_kv_heads, max_seq_len, sm_count(device))
        programs_per_sm = num_seqs * num_kv_heads * num_splits / sm_count(device)
        default_n, default_warps, default_stages = _default_config(
            device, head_dim, k_cache.dtype, programs_per_sm)
        dot_dtype, precision = dot_inputs(k_cache.dtype, q.dtype, device)
        group = num_q_heads // num_kv_heads
        block_d = next_power_of_2(head_dim)
        self.split = KernelLaunch(_decode_split_kernel, (num_seqs, num_kv_heads, num_splits), dict(
            GROUP=group, HEAD_DIM=head_dim, PAGE=page,
            BLOCK_H=max(16, next_power_of_2(group)), BLOCK_D=block_d, BLOCK_N=block_n or default_n,
            DOT_DTYPE=dot_dtype, DOT_PRECISION=precision, STORE_LSE=return_lse or num_splits > 1,
            KV_EVICTION=kv_eviction, num_warps=num_warps or default_warps, num_stages=num_stages or default_stages,
        ))
        self.tables = (block_tables, seq_lens)
        cache_args = (scale * _LOG2E, *q.stride(), *k_cache.stride(), *v_cache.stride(), block_tables.stride(0))
        self.part = self.part_lse = None
        lse_strides = self.lse.stride() if return_lse else (0, 0)
        if num_splits == 1:
            self.split_args = (*cache_args, out_strides[0], out_strides[1], 0, out_strides[2],
                               lse_strides[0], lse_strides[1], 0, 1)
            return
        self.part = torch.empty(num_seqs, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=device)
        self.part_lse = torch.empty(num_seqs, num_q_heads, num_splits, dtype=torch.float32, device=device)
        self.split_args = (*cache_args, *self.part.stride(), *self.part_lse.stride(), num_splits)
        self.merge_args = (self.part.stride(0), self.part.stride(1), self.part.stride(2),
                           self.part_lse.stride(0), self.part_lse.stride(1), *out_strides, *lse_strides, num_splits)
        self.merge = KernelLaunch(_decode_merge_kernel, (num_seqs, num_q_heads), dict(
            HEAD_DIM=head_dim, BLOCK_S=next_power_of_2(num_splits), BLOCK_D=block_d,
            STORE_LSE=return_lse, num_warps=4 if device.type == "cuda" else 1))

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor) -> None:
        """Attend ``q`` over the caches into ``out`` (and :attr:`lse` when asked for): tensors
        like the examples this was prepared with, unchecked."""
        if self.num_seqs == 0:
            return
        lse = out if self.lse is None else self.lse
        if self.part is None:
            self.split(q, k_cache, v_cache, *self.tables, out, lse, *self.split_args)
            return
        self.split(q, k_cache, v_cache, *self.tables, self.part, self.part_lse, *self.split_args)
        self.merge(self.part, self.part_lse, out, lse, *self.merge_args)


def launch_paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    kv_eviction: str = "",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`paged_decode_attention` with its tuning knobs exposed (tests and benchmarks).

    ``num_splits`` overrides :func:`num_kv_splits`; ``block_n`` (tokens per tile, a power of two
    >= 16), ``num_warps`` and ``num_stages`` override the per-device defaults; ``kv_eviction``
    is the K/V loads' L2 eviction policy (``""`` or ``"evict_first"``: each byte is read once).
    """
    if out is None:
        out = torch.empty_like(q)
    launch = PagedDecodeLaunch(q, k_cache, v_cache, block_tables, seq_lens, scale, out, return_lse=return_lse,
                               max_seq_len=max_seq_len, num_splits=num_splits, block_n=block_n,
                               num_warps=num_warps, num_stages=num_stages, kv_eviction=kv_eviction)
    launch(q, k_cache, v_cache, out)
    return (out, launch.lse) if return_lse else out


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of one new query token per sequence over its paged context (Triton).

    Split-KV (Flash-Decoding) over PagedAttention blocks with FlashAttention-2 online softmax;
    CUDA-graph safe when ``max_seq_len`` is given: no host sync, and the launch shapes depend only
    on ``num_seqs`` and the power-of-two bucket of ``max_seq_len``.

    Args:
        q: ``[num_seqs, num_q_heads, head_dim]``, any strides.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, any strides,
            float32/float16/bfloat16 or float8_e4m3fn (upcast after each tile's load);
            ``num_q_heads % num_kv_heads == 0`` (MHA, GQA, MQA).
        block_tables: ``[num_seqs, max_blocks_per_seq]`` int32.
        seq_lens: ``[num_seqs]`` int32, tokens in the cache including the new one (>= 1; a
            padding slot of a CUDA-graph batch may hold 0 and gets output 0, LSE -inf).
        scale: softmax scale, usually ``head_dim ** -0.5``.
        out: optional ``[num_seqs, num_q_heads, head_dim]`` output buffer (any strides).
        return_lse: also return the natural-log log-sum-exp ``[num_seqs, num_q_heads]`` float32.
        max_seq_len: an upper bound of ``max(seq_lens)``; sizes the split grid (a host sync
            computes it when None). Results never depend on it.
        num_splits: slices per (sequence, KV head), e.g. :func:`long_tail_splits`; default
            :func:`num_kv_splits` of ``max_seq_len``. Results agree to rounding for any count.

    Returns:
        ``[num_seqs, num_q_heads, head_dim]`` in q's dtype (and the LSE if asked).

    Raises:
        ValueError: shapes or dtypes that do not fit together.
        RuntimeError: CPU tensors without ``TRITON_INTERPRET=1``.
    """
    return launch_paged_decode(
        q, k_cache, v_cache, block_tables, seq_lens, scale,
        out=out, return_lse=return_lse, max_seq_len=max_seq_len, num_splits=num_splits,
    )
