"""Pure-PyTorch references of Tandem's kernels: the CPU path and the Triton kernels' test oracle.

Same signatures as the Triton entry points in :mod:`kernels`. The attention functions gather a
sequence's blocks through its block table (PagedAttention, Kwon et al., SOSP 2023) into a
padded batch and run one masked ``scaled_dot_product_attention``: no Python loop over
sequences, and no host sync when the caller passes ``max_seq_len``/``max_query_len``.
Softmax runs in float32 whatever the cache dtype; an fp8 cache's K and V are upcast to float32
as they are gathered. The layer functions (``rms_norm``,
``rotary_embedding``, ``silu_and_mul``) are the unfused PyTorch formulas the CPU path has
always run, ``matmul`` is ``F.linear``; ``sample_tokens`` computes the sampling kernel's counter-based noise bit for bit
with int64 arithmetic. ``dequantize_int4`` gives the weights of int4 planes in float32 (the C
kernel's arithmetic, so equal to it bit for bit once rounded to bfloat16). ``kv_digests`` sums a
KV block's words with the digest kernel's integer arithmetic (bit for bit) and counts non-finite
elements with ``torch.isfinite``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["dequantize_int4", "digest_words", "kv_digests", "matmul", "pack_int4", "paged_decode_attention",
           "paged_prefill_attention", "rms_norm", "rope_decode_attention",
           "rotary_embedding", "rotary_write_kv_cache", "sample_tokens", "silu_and_mul", "to_cache_dtype",
           "write_kv_cache"]

# The largest finite float8 e4m3 value (e4m3fn has no infinity): what an fp8 cache saturates to.
FP8_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448.0


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` cast to a KV cache's ``dtype``; to float8 e4m3 saturating: clamped to
    ``±FP8_E4M3_MAX`` in float32 first (the scale is a fixed 1.0: ``engine.runner.kv_cache``), so an
    outlier is stored as ±448 rather than NaN, the same bits as the Triton write kernel's."""
    if dtype == torch.float8_e4m3fn:
        return x.float().clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(dtype)
    return x.to(dtype)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new tokens' K and V into the paged cache, in place.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``; cast by :func:`to_cache_dtype`.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, any strides,
            float32/float16/bfloat16 or float8_e4m3fn.
        slot_mapping: ``[num_tokens]`` int64; slot = block * block_size + offset; -1 skips the token.
    """
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = to_cache_dtype(key[keep], k_cache.dtype)
    v_cache[blocks, offsets] = to_cache_dtype(value[keep], v_cache.dtype)


def _gather_context(
    cache: torch.Tensor, block_tables: torch.Tensor, max_seq_len: int
) -> torch.Tensor:
    """Return ``[num_seqs, num_kv_heads, max_blocks * block_size, head_dim]`` float32 copies of
    each sequence's first ``cdiv(max_seq_len, block_size)`` blocks."""
    block_size = cache.shape[1]
    num_blocks = -(-max_seq_len // block_size)
    table = block_tables[:, :num_blocks].long()
    # One gather straight into [num_seqs, num_kv_heads, num_blocks, block_size, head_dim], a head's
    # [block_size, head_dim] tile of a block at a time (one contiguous span in Tandem's pool).
    heads = torch.arange(cache.shape[2], device=cache.device)
    ctx = cache.transpose(1, 2)[table[:, None, :], heads[None, :, None]]
    return ctx.flatten(2, 3).float()


def _max_or(value: int | None, tensor: torch.Tensor) -> int:
    return int(tensor.max()) if value is None else value


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
    """Attention of one new query token per sequence over its paged context.

    Args:
        q: ``[num_seqs, num_q_heads, head_dim]``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, any strides;
            ``num_q_heads % num_kv_heads == 0`` (MHA, GQA, MQA).
        block_tables: ``[num_seqs, max_blocks_per_seq]`` int32.
        seq_lens: ``[num_seqs]`` int32, tokens in the cache including the new one (>= 1).
        scale: softmax scale, usually ``head_dim ** -0.5``.
        out: optional ``[num_seqs, num_q_heads, head_dim]`` output buffer.
        return_lse: also return the natural-log log-sum-exp ``[num_seqs, num_q_heads]`` float32.
        max_seq_len: ``max(seq_lens)`` if the caller knows it (avoids a host sync).
        num_splits: the Triton kernel's slices per context; this reference attends over each
            context at once, so it only takes the argument of the same signature.

    Returns:
        ``[num_seqs, num_q_heads, head_dim]`` in q's dtype (and the LSE if asked).
    """
    num_seqs = q.shape[0]
    max_seq_len = _max_or(max_seq_len, seq_lens)
    k = _gather_context(k_cache, block_tables, max_seq_len)
    v = _gather_context(v_cache, block_tables, max_seq_len)
    positions = torch.arange(k.shape[2], device=q.device)
    valid = positions[None, :] < seq_lens[:, None].to(positions.dtype)  # [num_seqs, ctx]
    mask = valid[:, None, None, :]
    qf = q.float().unsqueeze(2)  # [num_seqs, H, 1, D]
    result = F.scaled_dot_product_attention(qf, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    result = result.squeeze(2).to(q.dtype)
    if out is not None:
        out.copy_(result)
        result = out
    if not return_lse:
        return result
    group = q.shape[1] // k.shape[1]
    scores = qf.squeeze(2).view(num_seqs, k.shape[1], group, -1) @ k.transpose(2, 3) * scale
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    return result, torch.logsumexp(scores, dim=-1).flatten(1, 2)


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
    """Causal attention of each sequence's new query tokens over its whole paged context.

    The new tokens' K/V must already be written to the cache. Sequence ``s`` has
    ``q_len = cu_seqlens_q[s+1] - cu_seqlens_q[s]`` new tokens, which are the last ``q_len`` of
    its ``seq_lens[s]`` cached tokens; query ``j`` sees keys ``0 .. seq_lens[s] - q_len + j``.
    This covers plain prefill, chunked prefill and prefill after a prefix-cache hit.

    Args:
        q: ``[total_q_tokens, num_q_heads, head_dim]``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, any strides.
        block_tables: ``[num_seqs, max_blocks_per_seq]`` int32.
        cu_seqlens_q: ``[num_seqs + 1]`` int32, prefix sums of query lengths (starts at 0).
        seq_lens: ``[num_seqs]`` int32, context length including the new tokens.
        scale: softmax scale.
        out: optional ``[total_q_tokens, num_q_heads, head_dim]`` output buffer.
        max_query_len, max_seq_len: the maxima if the caller knows them (avoids host syncs).

    Returns:
        ``[total_q_tokens, num_q_heads, head_dim]`` in q's dtype.
    """
    device = q.device
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    max_query_len = _max_or(max_query_len, q_lens)
    max_seq_len = _max_or(max_seq_len, seq_lens)
    k = _gather_context(k_cache, block_tables, max_seq_len)
    v = _gather_context(v_cache, block_tables, max_seq_len)

    rows = torch.arange(max_query_len, device=device)
    row_valid = rows[None, :] < q_lens[:, None]  # [num_seqs, max_q]
    token_index = (cu_seqlens_q[:-1, None] + rows[None, :]).clamp(max=q.shape[0] - 1).long()
    qp = q.float()[token_index].transpose(1, 2)  # [num_seqs, H, max_q, D]

    query_pos = (seq_lens - q_lens)[:, None] + rows[None, :]  # absolute position of each query
    key_pos = torch.arange(k.shape[2], device=device)
    mask = key_pos[None, None, :] <= query_pos[:, :, None]  # [num_seqs, max_q, ctx]
    mask = mask | ~row_valid[:, :, None]  # padding rows attend to all (discarded below)
    result = F.scaled_dot_product_attention(
        qp, k, v, attn_mask=mask[:, None], scale=scale, enable_gqa=True
    )
    result = result.transpose(1, 2)[row_valid].to(q.dtype)  # [total_q_tokens, H, D]
    if out is not None:
        out.copy_(result)
        return out
    return result


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``weight * x / sqrt(mean(x**2) + eps)`` over the last dimension (``F.rms_norm``, which
    reduces in float32).

    Args:
        x: ``[..., size]``.
        weight: ``[size]``.
        eps: added to the mean square.
        residual: optional, like ``x``: the norm is then taken of ``x + residual``, returned too.

    Returns:
        ``norm(x)``, or ``(norm(x + residual), x + residual)``.
    """
    if residual is None:
        return F.rms_norm(x, weight.shape, weight, eps)
    x = x + residual
    return F.rms_norm(x, weight.shape, weight, eps), x


def _rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rotary_embedding(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE of query and key heads, in their dtype (as HF Llama computes it).

    Args:
        q: ``[num_tokens, num_q_heads, head_dim]``.
        k: ``[num_tokens, num_kv_heads, head_dim]``.
        cos, sin: ``[num_tokens, 1, head_dim // 2]``.

    Returns:
        New ``(q, k)``: ``x * cat(cos, cos) + rotate_half(x) * cat(sin, sin)`` without the cats,
        both heads rotated in one pass (views of one tensor: half the ops of a decode step's RoPE).
    """
    rotated = _rotate_half(torch.cat([q, k], dim=1), cos, sin)
    return rotated.split([q.shape[1], k.shape[1]], dim=1)


def rotary_write_kv_cache(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """:func:`rotary_embedding` of ``q`` and ``k`` (``[num_tokens, heads, head_dim]``), then
    :func:`write_kv_cache` of the rotated ``k`` and ``v`` at ``slot_mapping`` (-1 skips);
    returns the rotated ``q``."""
    q, k = rotary_embedding(q, k, cos, sin)
    write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
    return q


def rope_decode_attention(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, num_q_heads: int,
    scale: float, out: torch.Tensor,
) -> torch.Tensor:
    """A decode layer's attention from its fused QKV projection: RoPE of the query and key
    heads, the new K/V written into the cache, then each token's attention over its sequence's
    cached context (every token is a decode token of its own sequence).

    Args:
        qkv: ``[num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim]``, q then k then v heads.
        cos, sin: ``[num_tokens, 1, head_dim // 2]`` (:class:`engine.layers.rotary.RotaryEmbedding`).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, any strides.
        slot_mapping: ``[num_tokens]`` int64 cache slot of each token's K/V (-1: not written).
        block_tables: ``[num_tokens, max_blocks_per_seq]`` int32.
        seq_lens: ``[num_tokens]`` int32 context length, the new token included.
        num_q_heads: query heads (a multiple of the cache's KV heads).
        scale: softmax scale.
        out: ``[num_tokens, num_q_heads * head_dim]``, written and returned.
    """
    num_tokens, (_, _, num_kv_heads, head_dim) = qkv.shape[0], k_cache.shape
    q, k, v = qkv.view(num_tokens, -1, head_dim).split([num_q_heads, num_kv_heads, num_kv_heads], dim=1)
    q, k = rotary_embedding(q, k, cos, sin)
    write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
    paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale,
                           out=out.view(num_tokens, num_q_heads, head_dim))
    return out


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x`` ``[M, K]`` @ ``weight^T`` (``[N, K]``) + ``bias`` (``[N]``) -> ``[M, N]`` in
    ``out_dtype`` (default x's), accumulated in float32."""
    out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return out.to(out_dtype or x.dtype)


def pack_int4(codes: torch.Tensor, group_size: int) -> torch.Tensor:
    """Int4 codes ``[..., rows, cols]`` (integers in ``[0, 16)``) as ``[..., rows, cols // 2]``
    uint8, two per byte: in each group of ``group_size`` columns, byte ``j`` holds column ``j``
    in its low nibble and column ``j + group_size // 2`` in its high one."""
    *lead, rows, cols = codes.shape
    groups = codes.to(torch.uint8).reshape(*lead, rows, cols // group_size, group_size)
    half = group_size // 2
    return (groups[..., :half] | (groups[..., half:] << 4)).reshape(*lead, rows, cols // 2).contiguous()


def dequantize_int4(nibbles: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """The weight ``[rows, cols]`` float32 that int4 planes sum to: ``sum_p (q_p - 8) * scale_p +
    zero_p``, summed over planes in order, each term rounded to float32.

    Args:
        nibbles: ``[planes, rows, cols // 2]`` uint8, :func:`pack_int4`'s layout.
        scales_and_zeros: ``[planes, cols // group_size, rows, 2]`` bfloat16 (PyTorch's int4
            layout of each plane's group scale and zero).
        group_size: columns per group, even.
    """
    planes, rows, half_cols = nibbles.shape
    half = group_size // 2
    grouped = nibbles.reshape(planes, rows, -1, half)
    codes = torch.cat([grouped & 15, grouped >> 4], dim=-1).float() - 8  # [planes, rows, groups, group_size]
    scale = scales_and_zeros[..., 0].float().transpose(1, 2)[..., None]  # [planes, rows, groups, 1]
    zero = scales_and_zeros[..., 1].float().transpose(1, 2)[..., None]
    terms = codes * scale + zero
    out = terms[0]
    for term in terms[1:]:
        out = out + term
    return out.reshape(rows, 2 * half_cols)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU: ``[..., 2 * d]`` (gate then up) -> ``silu(gate) * up`` ``[..., d]``, same dtype."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9
# MurmurHash3 fmix32's multipliers as int64 values congruent to them mod 2^32 and under 2^31 in
# magnitude: the product with a uint32 fits in int64, so its low 32 bits are exact.
_FMIX_C1 = 0x85EBCA6B - (1 << 32)
_FMIX_C2 = 0xC2B2AE35 - (1 << 32)


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finalizer on int64 tensors holding uint32 values."""
    h = h ^ (h >> 16)
    h = (h * _FMIX_C1) & _MASK32
    h = h ^ (h >> 13)
    h = (h * _FMIX_C2) & _MASK32
    return h ^ (h >> 16)


def gumbel_noise(
    vocab_size: int, rows: torch.Tensor, seeds: torch.Tensor, sample_indices: torch.Tensor,
    positions: torch.Tensor, step_seed: tuple[int, int],
) -> torch.Tensor:
    """``[len(rows), vocab_size]`` float32 Gumbel noise ``-log(-log u)`` of the sampling kernel
    (:mod:`kernels.sampling` documents the hash).

    Args:
        rows: ``[r]`` int64 row numbers in the batch (hashed instead of the sample index by
            unseeded rows).
        seeds, sample_indices, positions: ``[r]`` int64, those rows' values (seed -1: unseeded).
        step_seed: two ints in ``[0, 2^31)`` that unseeded rows use as their seed's words.
    """
    unseeded = seeds < 0
    seed_lo = torch.where(unseeded, step_seed[0], seeds & _MASK32)
    seed_hi = torch.where(unseeded, step_seed[1], (seeds >> 32) & _MASK32)
    index = torch.where(unseeded, rows, sample_indices) & _MASK32
    key1 = _fmix32(seed_lo ^ _GOLDEN)
    for word in (seed_hi, index, positions & _MASK32):
        key1 = _fmix32(key1 ^ word)
    key2 = _fmix32(key1 ^ _GOLDEN)
    key1, key2 = key1[:, None], key2[:, None]
    tokens = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)
    bits = _fmix32(((_fmix32(key1 ^ tokens) + key1) & _MASK32) ^ key2)
    u = ((bits >> 9) * 2 + 1).to(torch.float32) * (1.0 / 16777216.0)
    return -torch.log(-torch.log(u))


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    thresholds: torch.Tensor,
    seeds: torch.Tensor,
    sample_indices: torch.Tensor,
    positions: torch.Tensor,
    step_seed: tuple[int, int],
    random: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pick one token per row: the argmax for greedy rows, the Gumbel-max race
    ``argmax(logit / T + g)`` over tokens with ``logit >= threshold`` for random rows.

    Args:
        logits: ``[n, vocab]`` float32.
        temperature: ``[n]`` float32; rows with 0 take the argmax.
        thresholds: ``[n]`` float32 filter threshold on the raw logits (``-inf``: none).
        seeds: ``[n]`` int64 request seed in ``[0, 2^63)``, or -1 for an unseeded row.
        sample_indices: ``[n]`` int64, which of its request's samples each row is.
        positions: ``[n]`` int64 position of the token being sampled.
        step_seed: two ints in ``[0, 2^31)``: the seed words of unseeded rows.
        random: False when every row is greedy.

    Returns:
        ``(token_ids [n] int64, logprobs [n] float32, lse [n] float32)``: the tokens, their
        log-probabilities under the untempered distribution, each row's log-sum-exp.
    """
    lse = torch.logsumexp(logits, dim=-1)
    token_ids = logits.argmax(dim=-1)
    if random:
        rows = torch.nonzero(temperature > 0).squeeze(1)
        if rows.numel():
            sub = logits[rows]
            noise = gumbel_noise(logits.shape[1], rows, seeds[rows], sample_indices[rows], positions[rows],
                                 step_seed)
            keys = sub * (1.0 / temperature[rows])[:, None] + noise
            keys = keys.masked_fill(sub < thresholds[rows, None], float("-inf"))
            token_ids[rows] = keys.argmax(dim=-1)
    logprobs = logits.gather(-1, token_ids[:, None]).squeeze(-1) - lse
    return token_ids, logprobs, lse


# Per KV dtype: (bits of one element, the bits all set in NaN and infinity and only there): what
# the digest kernel counts as non-finite (float8_e4m3fn has no infinity; its NaN is S.1111.111).
NONFINITE_BITS = {
    torch.float32: (32, 0x7F800000), torch.float16: (16, 0x7C00), torch.bfloat16: (16, 0x7F80),
    torch.float8_e4m3fn: (8, 0x7F), torch.float8_e5m2: (8, 0x7C),
}
_DIGEST_GROUP = 16  # blocks summed at once (bounds the int64 temporaries)


def digest_words(blocks: torch.Tensor) -> torch.Tensor:
    """``blocks`` ``[num_blocks, num_heads, *rest]`` (``rest`` contiguous) as the 32-bit words
    each (block, head) span holds: ``[num_blocks, num_heads, words]`` int32, a view.

    Raises:
        ValueError: a dtype outside ``NONFINITE_BITS``, ``rest`` not contiguous, or a span or
            stride that is not a whole number of words.
    """
    if blocks.dtype not in NONFINITE_BITS:
        raise ValueError(f"KV digests read {sorted(map(str, NONFINITE_BITS))}, got {blocks.dtype}")
    if blocks.dim() < 3:
        raise ValueError(f"blocks must be [num_blocks, num_heads, ...], got {tuple(blocks.shape)}")
    spans = blocks.flatten(2)  # a view: raises if rest is not contiguous
    if spans.stride(2) != 1 or (spans.shape[2] * blocks.element_size()) % 4 \
            or any(s * blocks.element_size() % 4 for s in spans.stride()[:2]):
        raise ValueError(f"a KV head's span must be contiguous whole 32-bit words, got shape "
                         f"{tuple(blocks.shape)} strides {blocks.stride()} of {blocks.dtype}")
    return spans.view(torch.int32)


def kv_digests(blocks: torch.Tensor, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`kernels.kv_digest.kv_digests`: per (block ``block_ids[j]``, KV head),
    ``sum_i w_i * (2 i + 1) mod 2**64`` over the span's int32 words ``w_i`` (an int64) and the
    count of NaN or infinite elements (int32); ``[k, num_heads]`` each."""
    words = digest_words(blocks)
    k, num_heads, num_words = block_ids.shape[0], words.shape[1], words.shape[2]
    weights = torch.arange(num_words, dtype=torch.int64, device=blocks.device) * 2 + 1
    digests = torch.empty(k, num_heads, dtype=torch.int64, device=blocks.device)
    nonfinite = torch.empty(k, num_heads, dtype=torch.int32, device=blocks.device)
    for start in range(0, k, _DIGEST_GROUP):
        ids = block_ids[start:start + _DIGEST_GROUP]
        digests[start:start + len(ids)] = (words[ids].to(torch.int64) * weights).sum(-1)  # wraps mod 2**64
        values = blocks[ids].flatten(2).float()
        nonfinite[start:start + len(ids)] = (~torch.isfinite(values)).sum(-1, dtype=torch.int32)
    return digests, nonfinite
