"""Attention over the paged KV cache: per-step metadata and the backend that runs it.

The model runner orders each step's batch with decode sequences (one new token each) first
and prefill chunks after them, so one backend call per layer splits cleanly into a decode
part (``paged_decode_attention``) and a prefill part (``paged_prefill_attention``).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

import kernels.reference
from engine.layers.ops import ops_for


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
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    num_decodes: int
    max_query_len: int
    max_seq_len: int
    max_decode_seq_len: int


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
        ops, md = self.ops, metadata
        ops.write_kv_cache(key, value, k_cache, v_cache, md.slot_mapping)
        out = torch.empty_like(query)
        nd = md.num_decodes
        if nd:
            ops.paged_decode_attention(
                query[:nd], k_cache, v_cache, md.block_tables[:nd], md.seq_lens[:nd], scale,
                out=out[:nd], max_seq_len=md.max_decode_seq_len,
            )
        if md.max_query_len:
            ops.paged_prefill_attention(
                query[nd:], k_cache, v_cache, md.block_tables[nd:],
                md.query_start_loc[nd:] - nd, md.seq_lens[nd:], scale,
                out=out[nd:], max_query_len=md.max_query_len, max_seq_len=md.max_seq_len,
            )
        return out


def get_attention_backend(device: torch.device) -> PagedAttentionBackend:
    """Return the Triton backend on CUDA, the PyTorch reference backend elsewhere."""
    return PagedAttentionBackend(ops_for(device))
