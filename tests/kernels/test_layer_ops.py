"""Triton fused layer ops (RMSNorm with residual, RoPE, SiLU-and-mul) against kernels.reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels
import kernels.reference as reference
from paged_inputs import DEVICE, gpu_test

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
