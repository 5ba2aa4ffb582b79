"""Triton paged prefill attention against kernels.reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels
import kernels.reference as reference
from kernels.prefill_attention import launch_paged_prefill
from tests.helpers.paged_inputs import (
    DEVICE, FP8, REL_TOL, blocks_for, gpu_test, layer_views, rel_err, shuffled_block_tables,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _prefill_case(cached, q_lens, num_kv_heads, group, head_dim, block_size, dtype, seed, kv_dtype=None):
    """Sequences with ``cached[i]`` tokens already in the cache and ``q_lens[i]`` new ones;
    queries of ``dtype`` over a cache of ``kv_dtype`` (default: ``dtype``)."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(cached, q_lens)]
    num_blocks = blocks_for(seq_lens, block_size)
    k_cache, v_cache = layer_views(num_blocks, 3, 2, block_size, num_kv_heads, head_dim, kv_dtype or dtype, gen)
    block_tables = shuffled_block_tables(seq_lens, block_size, num_blocks, gen)
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32).to(DEVICE)
    num_q_heads = num_kv_heads * group
    fused = torch.randn(sum(q_lens), num_q_heads + 2 * num_kv_heads, head_dim, generator=gen)
    q = fused.to(dtype=dtype, device=DEVICE)[:, :num_q_heads]
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    return q, k_cache, v_cache, block_tables, cu, lens


def _check(q, k_cache, v_cache, block_tables, cu, lens, scale, **kwargs):
    out = torch.full_like(q, float("nan"))  # poison: every element must be written
    result = launch_paged_prefill(q, k_cache, v_cache, block_tables, cu, lens, scale, out=out, **kwargs)
    ref = reference.paged_prefill_attention(q, k_cache, v_cache, block_tables, cu, lens, scale)
    assert result is out and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < REL_TOL[q.dtype]


@settings(max_examples=30, deadline=None)
@given(
    chunks=st.lists(st.tuples(st.integers(0, 70), st.integers(1, 40)), min_size=1, max_size=3),
    num_kv_heads=st.integers(1, 2),
    group=st.sampled_from([1, 2, 3, 4, 8]),
    head_dim=st.sampled_from([64, 80, 96, 128, 256]),
    block_size=st.sampled_from([8, 16, 32, 64, 128]),
    dtype=st.sampled_from(DTYPES),
    fp8_cache=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_prefill_matches_reference(chunks, num_kv_heads, group, head_dim, block_size, dtype, fp8_cache, seed):
    cached, q_lens = [c for c, _ in chunks], [n for _, n in chunks]
    case = _prefill_case(cached, q_lens, num_kv_heads, group, head_dim, block_size, dtype, seed,
                         kv_dtype=FP8 if fp8_cache else None)
    _check(*case, head_dim ** -0.5, max_query_len=max(q_lens))


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_over_an_fp8_cache_matches_the_reference_on_its_values(dtype):
    """The kernel upcasts fp8 K/V exactly: the bound is the query dtype's, as for its own cache."""
    case = _prefill_case([0, 37], [20, 5], 2, 2, 64, 16, dtype, seed=4, kv_dtype=FP8)
    assert case[1].dtype == FP8
    _check(*case, 64 ** -0.5, max_query_len=20)


def test_public_entry_point_without_maxima():
    q, k_cache, v_cache, block_tables, cu, lens = _prefill_case([0, 9], [21, 1], 2, 2, 96, 8, torch.float32, 5)
    out = kernels.paged_prefill_attention(q, k_cache, v_cache, block_tables, cu, lens, 0.1)
    ref = reference.paged_prefill_attention(q, k_cache, v_cache, block_tables, cu, lens, 0.1)
    assert rel_err(out, ref) < REL_TOL[torch.float32]


@gpu_test
@pytest.mark.parametrize("kv_dtype", [None, FP8])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("cached,q_lens", [([0], [512]), ([2048, 0, 700], [512, 300, 1]), ([8192], [512])])
def test_prefill_realistic_sizes(dtype, kv_dtype, head_dim, cached, q_lens):
    case = _prefill_case(cached, q_lens, 8, 4, head_dim, 16, dtype, seed=len(q_lens), kv_dtype=kv_dtype)
    _check(*case, head_dim ** -0.5, max_query_len=max(q_lens))
