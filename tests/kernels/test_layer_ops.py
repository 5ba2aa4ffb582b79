"""Triton fused layer ops (RMSNorm with residual, RoPE, SiLU-and-mul) against kernels.reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels
import kernels.reference as reference
from tests.helpers.paged_inputs import DEVICE, FP8, gpu_test, layer_views

# float32 rounds the same few ops in another order; half precision rounds once where the
# reference rounds after every op.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3),
       torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
DTYPES = list(TOL)


def _randn(*shape, gen, dtype, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=DEVICE)


@settings(max_examples=15, deadline=None)
@given(num_tokens=st.integers(1, 9), size=st.sampled_from([64, 96, 576, 1000]), dtype=st.sampled_from(DTYPES),
       with_residual=st.booleans(), seed=st.integers(0, 2**16))
def test_rms_norm_matches_reference(num_tokens, size, dtype, with_residual, seed):
    gen = torch.Generator().manual_seed(seed)
    # x is a strided view (rows of a wider buffer), as a fused projection's slice would be.
    x = _randn(num_tokens, size + 32, gen=gen, dtype=dtype)[:, :size]
    weight = _randn(size, gen=gen, dtype=dtype, scale=0.3) + 1
    residual = _randn(num_tokens, size, gen=gen, dtype=dtype) if with_residual else None
    out = kernels.rms_norm(x, weight, 1e-5, residual)
    ref = reference.rms_norm(x, weight, 1e-5, residual)
    if with_residual:
        torch.testing.assert_close(out[1], ref[1], **TOL[dtype])  # x + residual: one rounding in both
        out, ref = out[0], ref[0]
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out, ref, **TOL[dtype])


@settings(max_examples=15, deadline=None)
@given(num_tokens=st.integers(1, 9), num_kv_heads=st.integers(1, 3), group=st.sampled_from([1, 3, 4]),
       head_dim=st.sampled_from([16, 64, 80, 128]), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_rotary_matches_reference(num_tokens, num_kv_heads, group, head_dim, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    num_q_heads = num_kv_heads * group
    qkv = _randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, gen=gen, dtype=dtype)
    q = qkv[:, : num_q_heads * head_dim].view(num_tokens, num_q_heads, head_dim)
    k = qkv[:, num_q_heads * head_dim: (num_q_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    angles = torch.rand(num_tokens, 1, head_dim // 2, generator=gen) * 100
    cos, sin = angles.cos().to(dtype=dtype, device=DEVICE), angles.sin().to(dtype=dtype, device=DEVICE)
    before = qkv.clone()
    out_q, out_k = kernels.rotary_embedding(q, k, cos, sin)
    ref_q, ref_k = reference.rotary_embedding(q, k, cos, sin)
    assert torch.equal(qkv, before)  # inputs untouched
    torch.testing.assert_close(out_q, ref_q, **TOL[dtype])
    torch.testing.assert_close(out_k, ref_k, **TOL[dtype])


@settings(max_examples=10, deadline=None)
@given(num_tokens=st.integers(1, 9), d=st.sampled_from([16, 100, 1536]), dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**16))
def test_silu_and_mul_matches_reference(num_tokens, d, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = _randn(num_tokens, 2 * d, gen=gen, dtype=dtype, scale=3.0)
    torch.testing.assert_close(kernels.silu_and_mul(x), reference.silu_and_mul(x), **TOL[dtype])


def test_shape_errors_name_the_inputs():
    x = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="weight"):
        kernels.rms_norm(x, torch.ones(4, device=DEVICE), 1e-5)
    with pytest.raises(ValueError, match="2 \\* d"):
        kernels.silu_and_mul(torch.zeros(2, 7, device=DEVICE))


@gpu_test
@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_ops_at_llama_8b_sizes(dtype):
    gen = torch.Generator().manual_seed(0)
    x, residual = _randn(300, 4096, gen=gen, dtype=dtype), _randn(300, 4096, gen=gen, dtype=dtype)
    weight = _randn(4096, gen=gen, dtype=dtype, scale=0.1) + 1
    for out, ref in zip(kernels.rms_norm(x, weight, 1e-5, residual), reference.rms_norm(x, weight, 1e-5, residual)):
        torch.testing.assert_close(out, ref, **TOL[dtype])
    qkv = _randn(300, 48 * 128, gen=gen, dtype=dtype)
    q, k = qkv[:, :4096].view(300, 32, 128), qkv[:, 4096:5120].view(300, 8, 128)
    angles = torch.rand(300, 1, 64, generator=gen) * 1000
    cos, sin = angles.cos().to(dtype=dtype, device=DEVICE), angles.sin().to(dtype=dtype, device=DEVICE)
    for out, ref in zip(kernels.rotary_embedding(q, k, cos, sin), reference.rotary_embedding(q, k, cos, sin)):
        torch.testing.assert_close(out, ref, **TOL[dtype])
    gate_up = _randn(300, 2 * 14336, gen=gen, dtype=dtype)
    torch.testing.assert_close(kernels.silu_and_mul(gate_up), reference.silu_and_mul(gate_up), **TOL[dtype])


@settings(max_examples=15, deadline=None)
@given(num_tokens=st.integers(1, 9), num_kv_heads=st.integers(1, 3), group=st.sampled_from([1, 4]),
       head_dim=st.sampled_from([16, 80, 128]), dtype=st.sampled_from(DTYPES), fp8_cache=st.booleans(),
       seed=st.integers(0, 2**16))
def test_rotary_write_kv_cache_is_rotary_then_write(num_tokens, num_kv_heads, group, head_dim, dtype, fp8_cache, seed):
    gen = torch.Generator().manual_seed(seed)
    num_q_heads = num_kv_heads * group
    qkv = _randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, gen=gen, dtype=dtype)
    q, k, v = qkv.view(num_tokens, -1, head_dim).split([num_q_heads, num_kv_heads, num_kv_heads], dim=1)
    if fp8_cache:  # outliers, saturated at ±448 in the cache: |cos - sin| or |cos + sin| is >= 1
        k[0, 0, 0] = k[0, 0, head_dim // 2] = v[-1, 0, 1] = 1e4
    angles = torch.rand(num_tokens, 1, head_dim // 2, generator=gen) * 100
    cos, sin = angles.cos().to(dtype=dtype, device=DEVICE), angles.sin().to(dtype=dtype, device=DEVICE)
    cache_dtype = FP8 if fp8_cache else dtype
    caches = [layer_views(num_tokens + 3, 2, 1, 4, num_kv_heads, head_dim, cache_dtype,
                          torch.Generator().manual_seed(seed)) for _ in range(3)]
    slot_mapping = torch.randperm((num_tokens + 3) * 4, generator=gen)[:num_tokens]
    slot_mapping[torch.rand(num_tokens, generator=gen) < 0.3] = -1
    slot_mapping = slot_mapping.to(DEVICE)
    before = qkv.clone()
    out_q = kernels.rotary_write_kv_cache(q, k, v, cos, sin, *caches[0], slot_mapping)
    assert torch.equal(qkv, before)  # inputs untouched
    # the same bits as the two unfused kernels, and close to the reference's
    rot_q, rot_k = kernels.rotary_embedding(q, k, cos, sin)
    kernels.write_kv_cache(rot_k, v, *caches[1], slot_mapping)
    assert torch.equal(out_q, rot_q)
    for fused, unfused in zip(caches[0], caches[1]):
        assert torch.equal(fused.view(torch.uint8), unfused.view(torch.uint8)) and torch.isfinite(fused.float()).all()
    ref_q = reference.rotary_write_kv_cache(q, k, v, cos, sin, *caches[2], slot_mapping)
    torch.testing.assert_close(out_q, ref_q, **TOL[dtype])
    if not fp8_cache:
        for fused, ref in zip(caches[0], caches[2]):
            torch.testing.assert_close(fused, ref, **TOL[dtype])


def test_rotary_write_kv_cache_names_misfits():
    q, k = torch.zeros(2, 4, 16, device=DEVICE), torch.zeros(2, 2, 16, device=DEVICE)
    cos = torch.zeros(2, 1, 8, device=DEVICE)
    k_cache, v_cache = torch.zeros(3, 4, 2, 16, device=DEVICE), torch.zeros(3, 4, 2, 16, device=DEVICE)
    slots = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="slot_mapping"):
        kernels.rotary_write_kv_cache(q, k, k[:, :1], cos, cos, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="cos"):
        kernels.rotary_write_kv_cache(q, k, k, cos[:, :, :4], cos, k_cache, v_cache, slots)
