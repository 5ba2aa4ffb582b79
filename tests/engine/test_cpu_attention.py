"""The CPU attention backend (each step's cache indexing worked out once for all layers) computes
what the reference backend computes, layer after layer of one step, in float32 and bfloat16, over
caches of those dtypes and float8 e4m3."""

import dataclasses

import pytest
import torch

import kernels
import kernels.reference
from engine.runner.attention import AttentionMetadata, CpuPagedAttentionBackend, PagedAttentionBackend
from engine.layers.ops import cpu_kernels

BLOCK_SIZE, KV_HEADS, Q_HEADS, HEAD_DIM, NUM_BLOCKS, LAYERS = 4, 2, 6, 16, 24, 3
FP8 = torch.float8_e4m3fn


def _step() -> tuple[AttentionMetadata, int]:
    """Three decode sequences (contexts of 3, 9 and 14 tokens), then a 5-token prefill chunk of
    a sequence with 2 tokens cached; the second decode token's slot is -1 (not written)."""
    tables = torch.tensor([[5, 0, 0, 0, 0], [7, 2, 11, 0, 0], [1, 3, 4, 9, 0], [20, 21, 0, 0, 0]], dtype=torch.int32)
    seq_lens = torch.tensor([3, 9, 14, 7], dtype=torch.int32)
    slots = [5 * 4 + 2, -1, 9 * 4 + 1] + [20 * 4 + 2, 20 * 4 + 3, 21 * 4 + 0, 21 * 4 + 1, 21 * 4 + 2]
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots), block_tables=tables, seq_lens=seq_lens,
        query_start_loc=torch.tensor([0, 1, 2, 3, 8], dtype=torch.int32), num_decodes=3,
        max_query_len=5, max_seq_len=14, max_decode_seq_len=14)
    return metadata, len(slots)


@pytest.mark.parametrize("dtype,kv_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                            (torch.float32, FP8), (torch.bfloat16, FP8)])
def test_the_cpu_backend_equals_the_reference_over_the_layers_of_a_step(dtype, kv_dtype):
    metadata, num_tokens = _step()
    generator = torch.Generator().manual_seed(0)
    pool = torch.randn(NUM_BLOCKS, KV_HEADS, LAYERS, 2, BLOCK_SIZE, HEAD_DIM, generator=generator).to(kv_dtype)
    pools, before = [pool, pool.clone()], pool.clone()
    fast, reference = CpuPagedAttentionBackend(), PagedAttentionBackend(kernels.reference)
    for layer in range(LAYERS):  # one step: the fast backend's plan, made at layer 0, serves them all
        q = torch.randn(num_tokens, Q_HEADS, HEAD_DIM, generator=generator).to(dtype)
        k, v = (torch.randn(num_tokens, KV_HEADS, HEAD_DIM, generator=generator).to(dtype) for _ in range(2))
        k[0, 0, 0], v[-1, 1, 1] = 1e4, -1e4  # saturated to ±448 in an fp8 cache
        outs = []
        for backend, pool in zip((fast, reference), pools):
            k_cache, v_cache = (pool[:, :, layer, i].transpose(1, 2) for i in (0, 1))  # [blocks, bs, heads, dim]
            outs.append(backend.forward(q, k, v, k_cache, v_cache, metadata, HEAD_DIM ** -0.5))
        # the same K/V written at the same slots (-1 skipped), compared as bytes (fp8 has no ==)
        assert torch.equal(pools[0].view(torch.uint8), pools[1].view(torch.uint8))
        assert torch.equal(outs[0], outs[1]) and torch.isfinite(outs[0]).all()
    assert torch.isfinite(pools[0].float()).all()
    changed = pools[0].view(torch.uint8) != before.view(torch.uint8)
    written = changed.any(dim=(1, 2, 3, 5)).nonzero().tolist()  # [block, offset] pairs
    assert written == [[5, 2], [9, 1], [20, 2], [20, 3], [21, 0], [21, 1], [21, 2]]


def test_a_new_step_gets_a_new_plan():
    metadata, num_tokens = _step()
    backend = CpuPagedAttentionBackend()
    pool = torch.zeros(NUM_BLOCKS, KV_HEADS, LAYERS, 2, BLOCK_SIZE, HEAD_DIM)
    k_cache, v_cache = (pool[:, :, 0, i].transpose(1, 2) for i in (0, 1))
    q = torch.randn(num_tokens, Q_HEADS, HEAD_DIM)
    kv = torch.ones(num_tokens, KV_HEADS, HEAD_DIM)
    backend.forward(q, kv, kv, k_cache, v_cache, metadata, 1.0)
    moved = dataclasses.replace(metadata, slot_mapping=metadata.slot_mapping + 4)
    backend.forward(q, 2 * kv, 2 * kv, k_cache, v_cache, moved, 1.0)
    assert k_cache[5, 2].eq(1).all() and k_cache[6, 2].eq(2).all()  # slot 22 from step 1, slot 26 from step 2


def test_a_decode_only_step_runs_rope_and_attention_in_one_c_call():
    kernels_built = cpu_kernels()
    if kernels_built is None:
        pytest.skip("no C compiler on this machine")
    full, _ = _step()
    decodes = AttentionMetadata(  # the three decode sequences of _step, without the prefill chunk
        slot_mapping=full.slot_mapping[:3], block_tables=full.block_tables[:3], seq_lens=full.seq_lens[:3],
        query_start_loc=full.query_start_loc[:4], num_decodes=3, max_query_len=0, max_seq_len=14,
        max_decode_seq_len=14)
    generator = torch.Generator().manual_seed(1)
    pool = torch.randn(NUM_BLOCKS, KV_HEADS, LAYERS, 2, BLOCK_SIZE, HEAD_DIM, generator=generator)
    pools = [pool, pool.clone()]
    qkv = torch.randn(3, (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=generator)
    angles = torch.rand(3, 1, HEAD_DIM // 2, generator=generator)
    rope = (angles.cos(), angles.sin())
    fused = CpuPagedAttentionBackend(kernels_built)
    k_cache, v_cache = (pools[0][:, :, 1, i].transpose(1, 2) for i in (0, 1))
    out = fused.rope_attention(qkv, rope, k_cache, v_cache, decodes, Q_HEADS, HEAD_DIM ** -0.5)
    # what the model does without it: RoPE, then the reference backend
    q, k, v = qkv.view(3, -1, HEAD_DIM).split([Q_HEADS, KV_HEADS, KV_HEADS], dim=1)
    q, k = kernels.reference.rotary_embedding(q, k, *rope)
    k_cache, v_cache = (pools[1][:, :, 1, i].transpose(1, 2) for i in (0, 1))
    expected = PagedAttentionBackend(kernels.reference).forward(q, k, v, k_cache, v_cache, decodes, HEAD_DIM ** -0.5)
    assert torch.allclose(out, expected.view(3, -1), rtol=1e-5, atol=1e-5)
    assert torch.allclose(pools[0], pools[1], rtol=0, atol=1e-6)
    # no fused call for a bfloat16 cache or without the C kernels
    assert fused.rope_attention(qkv, rope, k_cache.bfloat16(), v_cache.bfloat16(), decodes, Q_HEADS, 1.0) is None
    assert CpuPagedAttentionBackend().rope_attention(qkv, rope, k_cache, v_cache, decodes, Q_HEADS, 1.0) is None


def test_decode_rows_get_the_same_result_with_or_without_prefill_chunks_beside_them():
    """A decode token's attention does not depend on its batch: in a step with a prefill chunk
    its row is the C call's, bit for bit; the chunk's rows are the reference backend's."""
    kernels_built = cpu_kernels()
    if kernels_built is None:
        pytest.skip("no C compiler on this machine")
    full, num_tokens = _step()
    decodes = AttentionMetadata(
        slot_mapping=full.slot_mapping[:3], block_tables=full.block_tables[:3], seq_lens=full.seq_lens[:3],
        query_start_loc=full.query_start_loc[:4], num_decodes=3, max_query_len=0, max_seq_len=14,
        max_decode_seq_len=14)
    generator = torch.Generator().manual_seed(2)
    pool = torch.randn(NUM_BLOCKS, KV_HEADS, LAYERS, 2, BLOCK_SIZE, HEAD_DIM, generator=generator)
    pools = [pool, pool.clone(), pool.clone()]
    qkv = torch.randn(num_tokens, (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=generator)
    angles = torch.rand(num_tokens, 1, HEAD_DIM // 2, generator=generator)
    rope = (angles.cos(), angles.sin())
    backend = CpuPagedAttentionBackend(kernels_built)
    views = [tuple(p[:, :, 0, i].transpose(1, 2) for i in (0, 1)) for p in pools]
    mixed = backend.rope_attention(qkv, rope, *views[0], full, Q_HEADS, HEAD_DIM ** -0.5)
    alone = backend.rope_attention(qkv[:3], (rope[0][:3], rope[1][:3]), *views[1], decodes, Q_HEADS,
                                          HEAD_DIM ** -0.5)
    assert torch.equal(mixed[:3], alone)
    q, k, v = qkv.view(num_tokens, -1, HEAD_DIM).split([Q_HEADS, KV_HEADS, KV_HEADS], dim=1)
    q, k = kernels.reference.rotary_embedding(q, k, *rope)
    expected = PagedAttentionBackend(kernels.reference).forward(q, k, v, *views[2], full, HEAD_DIM ** -0.5)
    assert torch.equal(mixed[3:], expected[3:].reshape(num_tokens - 3, -1))
    assert torch.allclose(pools[0], pools[2], rtol=0, atol=1e-6)  # every token's K/V written, nothing else


@pytest.mark.parametrize("ops", [kernels.reference, kernels], ids=["reference", "triton"])
@pytest.mark.parametrize("kv_dtype", [torch.float32, FP8])
def test_rope_attention_from_the_fused_projection_equals_rope_then_forward(ops, kv_dtype):
    """The backend's one call (RoPE fused with the KV write, then attention) over a step of
    decodes and a prefill chunk gives the output and cache bytes of RoPE, then :meth:`forward`."""
    metadata, num_tokens = _step()
    generator = torch.Generator().manual_seed(3)
    qkv = torch.randn(num_tokens, (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=generator)
    angles = torch.rand(num_tokens, 1, HEAD_DIM // 2, generator=generator) * 50
    rope = angles.cos(), angles.sin()
    pool = torch.randn(NUM_BLOCKS, BLOCK_SIZE, 2, KV_HEADS, HEAD_DIM, generator=generator).to(kv_dtype)
    pools, before = [pool, pool.clone()], pool.clone()
    backend = PagedAttentionBackend(ops)
    fused = backend.rope_attention(qkv, rope, pools[0][:, :, 0], pools[0][:, :, 1], metadata, Q_HEADS, 0.25)
    q, k, v = qkv.view(num_tokens, -1, HEAD_DIM).split([Q_HEADS, KV_HEADS, KV_HEADS], dim=1)
    q, k = ops.rotary_embedding(q, k, *rope)
    unfused = backend.forward(q, k, v, pools[1][:, :, 0], pools[1][:, :, 1], metadata, 0.25)
    assert fused.shape == (num_tokens, Q_HEADS * HEAD_DIM)
    assert torch.equal(fused, unfused.view(num_tokens, -1)) and torch.isfinite(fused).all()
    assert torch.equal(pools[0].view(torch.uint8), pools[1].view(torch.uint8))
    changed = (pools[0].view(torch.uint8) != before.view(torch.uint8)).any(dim=(2, 3, 4)).nonzero().tolist()
    assert changed == [[5, 2], [9, 1], [20, 2], [20, 3], [21, 0], [21, 1], [21, 2]]  # the slots, -1 skipped
