"""Pure-PyTorch paged attention and KV-cache write: Tandem's CPU path and the kernels' test oracle.

Same signatures as the Triton entry points in :mod:`kernels`. Every function gathers a
sequence's blocks through its block table (PagedAttention, Kwon et al., SOSP 2023) into a
padded batch and runs one masked ``scaled_dot_product_attention``: no Python loop over
sequences, and no host sync when the caller passes ``max_seq_len``/``max_query_len``.
Softmax runs in float32 whatever the cache dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["paged_decode_attention", "paged_prefill_attention", "write_kv_cache"]


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new tokens' K and V into the paged cache, in place.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, any strides.
        slot_mapping: ``[num_tokens]`` int64; slot = block * block_size + offset; -1 skips the token.
    """
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = key[keep].to(k_cache.dtype)
    v_cache[blocks, offsets] = value[keep].to(v_cache.dtype)


def _gather_context(
    cache: torch.Tensor, block_tables: torch.Tensor, max_seq_len: int
) -> torch.Tensor:
    """Return ``[num_seqs, num_kv_heads, max_blocks * block_size, head_dim]`` float32 copies of
    each sequence's first ``cdiv(max_seq_len, block_size)`` blocks."""
    block_size = cache.shape[1]
    num_blocks = -(-max_seq_len // block_size)
    table = block_tables[:, :num_blocks].long()
    ctx = cache[table]  # [num_seqs, num_blocks, block_size, num_kv_heads, head_dim]
    ctx = ctx.flatten(1, 2).transpose(1, 2)
    return ctx.float()


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
