"""Triton paged decode attention against kernels.reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels
import kernels.reference as reference
import kernels.decode_attention as decode_attention
from kernels.decode_attention import launch_paged_decode, launch_variants, num_kv_splits
from tests.helpers.paged_inputs import (
    DEVICE, FP8, REL_TOL, blocks_for, gpu_test, layer_views, rel_err, shuffled_block_tables,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _decode_case(seq_lens, num_kv_heads, group, head_dim, block_size, dtype, seed, num_layers=2, layer=1,
                 kv_dtype=None):
    """Queries of ``dtype`` over a cache of ``kv_dtype`` (default: ``dtype``)."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = blocks_for(seq_lens, block_size)
    k_cache, v_cache = layer_views(num_blocks, num_layers, layer, block_size, num_kv_heads, head_dim,
                                   kv_dtype or dtype, gen)
    block_tables = shuffled_block_tables(seq_lens, block_size, num_blocks, gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    # q is a strided slice of a fused QKV-like buffer, as a model produces it.
    num_q_heads = num_kv_heads * group
    fused = torch.randn(len(seq_lens), num_q_heads + 2 * num_kv_heads, head_dim, generator=gen)
    q = fused.to(dtype=dtype, device=DEVICE)[:, :num_q_heads]
    return q, k_cache, v_cache, block_tables, lens


def _check(q, k_cache, v_cache, block_tables, lens, scale, **kwargs):
    out = torch.full_like(q, float("nan"))  # poison: every element must be written
    result, lse = launch_paged_decode(q, k_cache, v_cache, block_tables, lens, scale, out=out,
                                      return_lse=True, **kwargs)
    ref, ref_lse = reference.paged_decode_attention(q, k_cache, v_cache, block_tables, lens, scale,
                                                    return_lse=True)
    assert result is out and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < REL_TOL[q.dtype]
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:2]
    assert torch.allclose(lse, ref_lse, atol=1e-3, rtol=1e-4)


@settings(max_examples=40, deadline=None)
@given(
    seq_lens=st.lists(st.integers(1, 200), min_size=1, max_size=3),
    num_kv_heads=st.integers(1, 2),
    group=st.integers(1, 16),
    head_dim=st.sampled_from([64, 80, 96, 128, 256]),
    block_size=st.sampled_from([8, 16, 32, 64, 128]),
    dtype=st.sampled_from(DTYPES),
    num_splits=st.sampled_from([None, 1, 2, 5]),
    fp8_cache=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_decode_matches_reference(seq_lens, num_kv_heads, group, head_dim, block_size, dtype, num_splits, fp8_cache,
                                  seed):
    case = _decode_case(seq_lens, num_kv_heads, group, head_dim, block_size, dtype, seed,
                        kv_dtype=FP8 if fp8_cache else None)
    _check(*case, head_dim ** -0.5, num_splits=num_splits, max_seq_len=max(seq_lens))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_over_an_fp8_cache_matches_the_reference_on_its_values(dtype, num_splits):
    """The kernel upcasts fp8 K/V exactly: the bound is the query dtype's, as for its own cache."""
    case = _decode_case([1, 70, 33], 2, 4, 64, 16, dtype, seed=11, kv_dtype=FP8)
    assert case[1].dtype == FP8
    _check(*case, 64 ** -0.5, num_splits=num_splits)


def test_public_entry_point_without_lse_or_max_seq_len():
    q, k_cache, v_cache, block_tables, lens = _decode_case([1, 33, 17], 2, 4, 80, 16, torch.float32, seed=7)
    out = kernels.paged_decode_attention(q, k_cache, v_cache, block_tables, lens, 0.1)
    ref = reference.paged_decode_attention(q, k_cache, v_cache, block_tables, lens, 0.1)
    assert rel_err(out, ref) < REL_TOL[torch.float32]


@pytest.mark.parametrize("num_splits", [1, 3])
def test_padding_slots_with_no_tokens_give_zeros(num_splits):
    q, k_cache, v_cache, block_tables, _ = _decode_case([9, 1, 40], 2, 4, 64, 8, torch.float32, seed=2)
    lens = torch.tensor([0, 1, 40], dtype=torch.int32, device=DEVICE)
    out, lse = launch_paged_decode(q, k_cache, v_cache, block_tables, lens, 0.1, return_lse=True,
                                   num_splits=num_splits)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.isneginf(lse[0]).all()
    ref = reference.paged_decode_attention(q[1:], k_cache, v_cache, block_tables[1:], lens[1:], 0.1)
    assert rel_err(out[1:], ref) < REL_TOL[torch.float32]


def test_split_count_fills_the_gpu():
    assert num_kv_splits(1, 8, 8192, num_sms=132) >= 16  # one long sequence is split
    assert num_kv_splits(256, 8, 4096, num_sms=132) == 1  # a full batch needs no split
    assert num_kv_splits(4, 8, 100, num_sms=132) == 1  # short contexts are not split
    # One launch shape per power-of-two bucket of max_seq_len (CUDA graphs).
    assert num_kv_splits(2, 8, 1100, num_sms=132) == num_kv_splits(2, 8, 2048, num_sms=132)


def test_launch_variants_cover_every_configuration(monkeypatch):
    """A warm-up that calls the kernel once per example compiles every variant an H100 server
    with batches up to 256 and contexts up to 8192 can launch."""
    monkeypatch.setattr(decode_attention, "sm_count", lambda device: 132)
    cuda = torch.device("cuda")

    def variant(num_seqs, max_seq_len):
        splits = num_kv_splits(num_seqs, 8, max_seq_len, 132)
        config = decode_attention._default_config(cuda, 128, torch.bfloat16, num_seqs * 8 * splits / 132)
        return splits == 1, 1 << (splits - 1).bit_length(), config

    examples = launch_variants(8, 128, torch.bfloat16, cuda, 256, 8192)
    needed = {variant(n, length) for n in range(1, 257) for length in range(1, 8193, 97)}
    assert {variant(*e) for e in examples} == needed
    assert len(examples) == len(needed) < 20


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    if DEVICE.type == "cuda":
        pytest.skip("checks the CPU guard")
    q, k_cache, v_cache, block_tables, lens = _decode_case([5], 1, 1, 64, 8, torch.float32, seed=1)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        kernels.paged_decode_attention(q, k_cache, v_cache, block_tables, lens, 0.1)


@gpu_test
@pytest.mark.parametrize("kv_dtype", [None, FP8])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_seqs,max_len", [(1, 8192), (16, 2048), (64, 1024), (256, 300)])
def test_decode_realistic_sizes(dtype, kv_dtype, num_seqs, max_len):
    gen = torch.Generator().manual_seed(num_seqs)
    seq_lens = torch.randint(1, max_len + 1, (num_seqs,), generator=gen).tolist()
    seq_lens[0] = max_len
    case = _decode_case(seq_lens, 8, 4, 128, 16, dtype, seed=num_seqs, num_layers=4, layer=2, kv_dtype=kv_dtype)
    _check(*case, 128 ** -0.5, max_seq_len=max_len)


@gpu_test
def test_decode_cuda_graph_replay_with_new_lengths():
    gen = torch.Generator().manual_seed(3)
    q, k_cache, v_cache, block_tables, lens = _decode_case([4000, 1, 2500, 333], 8, 4, 128, 16,
                                                           torch.bfloat16, seed=3)
    out = torch.empty_like(q)
    kwargs = dict(out=out, max_seq_len=4096)
    kernels.paged_decode_attention(q, k_cache, v_cache, block_tables, lens, 0.1, **kwargs)  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernels.paged_decode_attention(q, k_cache, v_cache, block_tables, lens, 0.1, **kwargs)
    for _ in range(3):
        lens.copy_(torch.randint(1, 4001, (4,), generator=gen, dtype=torch.int32))
        q.copy_(torch.randn(q.shape, generator=gen))
        out.fill_(float("nan"))
        graph.replay()
        ref = reference.paged_decode_attention(q, k_cache, v_cache, block_tables, lens, 0.1)
        assert rel_err(out, ref) < REL_TOL[torch.bfloat16]
