"""Triton KV cache write against kernels.reference."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels
import kernels.reference as reference
from paged_inputs import DEVICE, layer_views


@settings(max_examples=25, deadline=None)
@given(
    num_tokens=st.integers(1, 40),
    num_kv_heads=st.integers(1, 8),
    head_dim=st.sampled_from([64, 80, 96, 128, 256]),
    block_size=st.sampled_from([8, 16, 32, 64, 128]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    skip_fraction=st.floats(0.0, 0.5),
    seed=st.integers(0, 2**16),
)
def test_write_matches_reference(num_tokens, num_kv_heads, head_dim, block_size, dtype, skip_fraction, seed):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = num_tokens // block_size + 2
    k_cache, v_cache = layer_views(num_blocks, 2, 1, block_size, num_kv_heads, head_dim, dtype, gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.rand(num_tokens, generator=gen) < skip_fraction] = -1
    slot_mapping = slots.to(DEVICE)
    # key/value are strided slices of a fused QKV-like buffer.
    fused = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, generator=gen).to(dtype=dtype, device=DEVICE)
    key, value = fused[:, num_kv_heads:2 * num_kv_heads], fused[:, 2 * num_kv_heads:]
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    reference.write_kv_cache(key, value, expect_k, expect_v, slot_mapping)
    kernels.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)
    # The whole cache is compared: written slots exactly, and nothing else touched.
    assert torch.equal(k_cache, expect_k)
    assert torch.equal(v_cache, expect_v)


def test_write_casts_to_cache_dtype():
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = layer_views(4, 1, 0, 8, 2, 64, torch.float16, gen)
    key = torch.randn(5, 2, 64, generator=gen).to(DEVICE)
    value = torch.randn(5, 2, 64, generator=gen).to(DEVICE)
    slot_mapping = torch.tensor([3, -1, 17, 0, 30], device=DEVICE)
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    reference.write_kv_cache(key, value, expect_k, expect_v, slot_mapping)
    kernels.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)
    # float32 -> float16 rounding may differ by one unit in the last place under the interpreter.
    torch.testing.assert_close(k_cache, expect_k, rtol=1e-3, atol=0)
    torch.testing.assert_close(v_cache, expect_v, rtol=1e-3, atol=0)
