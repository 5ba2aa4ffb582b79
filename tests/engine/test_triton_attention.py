"""The CUDA attention backend, whose step's launches are prepared at its first layer and run by
every layer, computes what the reference backend computes, layer after layer and step after
step (on the CPU under ``TRITON_INTERPRET=1``; on a GPU on the device)."""

import dataclasses

import pytest
import torch

import kernels
import kernels.reference
from engine.runner.attention import AttentionMetadata, PagedAttentionBackend, TritonPagedAttentionBackend

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BLOCK_SIZE, KV_HEADS, Q_HEADS, HEAD_DIM, NUM_BLOCKS, LAYERS = 4, 2, 6, 16, 24, 3


def _mixed_step() -> AttentionMetadata:
    """Three decode sequences (contexts of 3, 9 and 14 tokens, the second's slot -1), then a
    5-token prefill chunk of a sequence with 2 tokens cached."""
    slots = [5 * 4 + 2, -1, 9 * 4 + 1] + [20 * 4 + 2, 20 * 4 + 3, 21 * 4 + 0, 21 * 4 + 1, 21 * 4 + 2]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=DEVICE),
        block_tables=torch.tensor([[5, 0, 0, 0, 0], [7, 2, 11, 0, 0], [1, 3, 4, 9, 0], [20, 21, 0, 0, 0]],
                                  dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor([3, 9, 14, 7], dtype=torch.int32, device=DEVICE),
        query_start_loc=torch.tensor([0, 1, 2, 3, 8], dtype=torch.int32, device=DEVICE), num_decodes=3,
        max_query_len=5, max_seq_len=14, max_decode_seq_len=14)


def _decode_step() -> AttentionMetadata:
    """The mixed step's three decode sequences alone, one token further on."""
    md = _mixed_step()
    return AttentionMetadata(
        slot_mapping=torch.tensor([5 * 4 + 3, 2 * 4 + 1, 9 * 4 + 2], device=DEVICE), block_tables=md.block_tables[:3],
        seq_lens=md.seq_lens[:3] + 1, query_start_loc=md.query_start_loc[:4], num_decodes=3, max_query_len=0,
        max_seq_len=15, max_decode_seq_len=15)


def _prefill_step() -> AttentionMetadata:
    """The mixed step's prefill sequence alone, its next 3-token chunk."""
    md = _mixed_step()
    return AttentionMetadata(
        slot_mapping=torch.tensor([21 * 4 + 3, 0 * 4 + 0, 0 * 4 + 1], device=DEVICE),
        block_tables=torch.tensor([[20, 21, 0, 0, 0]], dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor([10], dtype=torch.int32, device=DEVICE), query_start_loc=md.query_start_loc[:2] * 3,
        num_decodes=0, max_query_len=3, max_seq_len=10, max_decode_seq_len=0)


def _layer_caches(pool: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``layer``'s strided ``[blocks, block_size, heads, dim]`` K and V views of a block-major pool."""
    return pool[:, layer, 0], pool[:, layer, 1]


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_prepared_launches_compute_what_the_kernels_compute_over_layers_and_steps(kv_dtype):
    """Three steps (mixed, decode only, prefill only) of three layers each through one backend:
    each layer's output and cache bytes are, bit for bit, those of the same kernels called
    through their entry points one layer at a time (the base backend, itself tested against
    the reference)."""
    generator = torch.Generator().manual_seed(0)
    pool = torch.randn(NUM_BLOCKS, LAYERS, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=generator)
    before = pool.to(DEVICE, kv_dtype)
    pools = [before.clone(), before.clone()]
    dtype = torch.float32 if kv_dtype == torch.float8_e4m3fn else kv_dtype
    prepared, unprepared = TritonPagedAttentionBackend(kernels), PagedAttentionBackend(kernels)
    for metadata in (_mixed_step(), _decode_step(), _prefill_step()):
        num_tokens = metadata.slot_mapping.shape[0]
        angles = torch.rand(num_tokens, 1, HEAD_DIM // 2, generator=generator).to(DEVICE) * 50
        rope = angles.cos(), angles.sin()
        for layer in range(LAYERS):
            qkv = torch.randn(num_tokens, (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=generator).to(DEVICE, dtype)
            outs = [backend.rope_attention(qkv, rope, *_layer_caches(caches, layer), metadata, Q_HEADS, 0.25).clone()
                    for backend, caches in zip((prepared, unprepared), pools)]
            assert outs[0].shape == (num_tokens, Q_HEADS * HEAD_DIM) and torch.isfinite(outs[0]).all()
            assert torch.equal(outs[0], outs[1])
            assert torch.equal(pools[0].view(torch.uint8), pools[1].view(torch.uint8))
    assert not torch.equal(pools[0].view(torch.uint8), before.view(torch.uint8))


def test_the_backend_writes_into_the_given_output_buffer_and_reprepares_on_a_new_path():
    """``metadata.attn_out`` receives every layer's output (what the piecewise graphs read), and
    :meth:`forward` (RoPE applied by the caller, as for q/k-normed models) after the fused path in
    the same step still attends with launches prepared for its own query."""
    generator = torch.Generator().manual_seed(1)
    pool = torch.randn(NUM_BLOCKS, LAYERS, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=generator).to(DEVICE)
    metadata = _mixed_step()
    num_tokens = metadata.slot_mapping.shape[0]
    buffer = torch.full((num_tokens + 4, Q_HEADS * HEAD_DIM), float("nan"), device=DEVICE)
    with_buffer = dataclasses.replace(metadata, attn_out=buffer[:num_tokens])
    backend, reference = TritonPagedAttentionBackend(kernels), PagedAttentionBackend(kernels.reference)
    angles = torch.rand(num_tokens, 1, HEAD_DIM // 2, generator=generator).to(DEVICE)
    rope = angles.cos(), angles.sin()
    for layer in range(LAYERS):
        qkv = torch.randn(num_tokens, (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=generator).to(DEVICE)
        out = backend.rope_attention(qkv, rope, *_layer_caches(pool, layer), with_buffer, Q_HEADS, 0.25)
        assert out.data_ptr() == buffer.data_ptr()
        expected = reference.attend(
            kernels.reference.rotary_embedding(qkv.view(num_tokens, -1, HEAD_DIM)[:, :Q_HEADS],
                                               qkv.view(num_tokens, -1, HEAD_DIM)[:, Q_HEADS:Q_HEADS + KV_HEADS],
                                               *rope)[0],
            *_layer_caches(pool, layer), metadata, 0.25)
        torch.testing.assert_close(buffer[:num_tokens], expected.view(num_tokens, -1), rtol=1e-5, atol=1e-5)
    assert buffer[num_tokens:].isnan().all()  # nothing past the step's rows
    q, k, v = (torch.randn(num_tokens, heads, HEAD_DIM, generator=generator).to(DEVICE)
               for heads in (Q_HEADS, KV_HEADS, KV_HEADS))
    caches = [_layer_caches(pool.clone(), 0) for _ in range(2)]
    out = backend.forward(q, k, v, *caches[0], with_buffer, 0.25)
    torch.testing.assert_close(out, reference.forward(q, k, v, *caches[1], metadata, 0.25), rtol=1e-5, atol=1e-5)
