"""Triton KV cache write against kernels.reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels
import kernels.reference as reference
from tests.helpers.paged_inputs import DEVICE, FP8, layer_views


def _interpretable(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """``x``, rounded to fp8 values first for an fp8 cache under the CPU interpreter: Triton 3.9's
    interpreter rounds float32 to fp8 without carrying a mantissa overflow into the exponent
    (1.97 becomes 1.0, not 2.0), so only a GPU checks the write's rounding against torch's;
    values fp8 already holds, and the saturation, are checked everywhere."""
    if cache_dtype == FP8 and DEVICE.type == "cpu":
        return x.to(FP8).float()
    return x


@settings(max_examples=25, deadline=None)
@given(
    num_tokens=st.integers(1, 40),
    num_kv_heads=st.integers(1, 8),
    head_dim=st.sampled_from([64, 80, 96, 128, 256]),
    block_size=st.sampled_from([8, 16, 32, 64, 128]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, FP8]),
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
    source = torch.float32 if dtype == FP8 else dtype  # an fp8 cache's K/V come from the model's dtype
    fused = _interpretable(torch.randn(num_tokens, 3 * num_kv_heads, head_dim, generator=gen), dtype)
    fused = fused.to(dtype=source, device=DEVICE)
    key, value = fused[:, num_kv_heads:2 * num_kv_heads], fused[:, 2 * num_kv_heads:]
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    reference.write_kv_cache(key, value, expect_k, expect_v, slot_mapping)
    kernels.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)
    # The whole cache is compared: written slots exactly, and nothing else touched.
    assert torch.equal(k_cache.view(torch.uint8), expect_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), expect_v.view(torch.uint8))


@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16])
def test_fp8_write_saturates_outliers_at_448_instead_of_nan(source):
    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache = layer_views(2, 1, 0, 8, 1, 64, FP8, gen)
    key = _interpretable(torch.randn(3, 1, 64, generator=gen) * 300, FP8).to(dtype=source, device=DEVICE)
    key[0, 0, :2] = torch.tensor([1e4, -3e4])
    value = -key
    slot_mapping = torch.tensor([0, 9, 5], device=DEVICE)
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    reference.write_kv_cache(key, value, expect_k, expect_v, slot_mapping)
    kernels.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)
    assert torch.equal(k_cache.view(torch.uint8), expect_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), expect_v.view(torch.uint8))
    written = k_cache[0, 0, 0].float()
    assert written[:2].tolist() == [448.0, -448.0] and torch.isfinite(k_cache.float()).all()
    assert v_cache[0, 0, 0, :2].float().tolist() == [-448.0, 448.0]


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
