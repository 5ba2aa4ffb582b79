"""The C kernels of kernels/cpu_ops.py against their PyTorch references."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch

import kernels.reference as ref
from engine.runner.kv_cache import KVCache
from engine.loading.model_config import ModelConfig
from kernels.cpu_ops import load
from tests.helpers.paged_inputs import rel_err, shuffled_block_tables


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    built = load(tmp_path_factory.mktemp("kernels"))
    if built is None:
        pytest.skip("no C compiler on this machine")
    return built


def _inputs(seq_lens, num_q_heads, num_kv_heads, head_dim, block_size, generator):
    """A real block-major pool (engine.runner.kv_cache.KVCache, layer 1 of 3), random contents, and a
    decode step of one token per sequence (its slot the last position of its context)."""
    config = ModelConfig(vocab_size=8, intermediate_size=8, num_hidden_layers=3, num_attention_heads=num_q_heads,
                         num_key_value_heads=num_kv_heads, head_dim=head_dim, hidden_size=num_q_heads * head_dim)
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    cache = KVCache(config, num_blocks, block_size, torch.float32, "cpu")
    cache.tensor.copy_(torch.randn(cache.tensor.shape, generator=generator))
    tables = shuffled_block_tables(seq_lens, block_size, num_blocks, generator).cpu()  # CPU kernels, any host
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    last = lens.long() - 1
    slots = tables[torch.arange(len(seq_lens)), last // block_size].long() * block_size + last % block_size
    qkv = torch.randn(len(seq_lens), (num_q_heads + 2 * num_kv_heads) * head_dim, generator=generator)
    angles = torch.rand(len(seq_lens), 1, head_dim // 2, generator=generator) * 6.28
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)
    return config, cache, tables, lens, slots, qkv, cos_sin.chunk(2, dim=-1)


@pytest.mark.parametrize("seq_lens, num_q_heads, num_kv_heads, block_size", [
    ([1], 4, 4, 16),  # the first token: a context of itself
    ([37, 16, 5, 64], 9, 3, 16),  # SmolLM2's GQA, contexts ending inside and at block ends
    ([300, 2], 8, 1, 8),  # MQA, a long context over many blocks
    ([9, 0], 4, 2, 8),  # a padding row (a CUDA graph's): empty context, not written, zeros out
    ([1200, 900, 700], 9, 3, 16),  # enough context to split the heads over threads (three here)
])
def test_matches_the_reference(kernel, seq_lens, num_q_heads, num_kv_heads, block_size):
    threads = torch.get_num_threads()
    torch.set_num_threads(3)  # the kernel splits a large call over torch's thread count
    try:
        _compare(kernel, seq_lens, num_q_heads, num_kv_heads, block_size)
    finally:
        torch.set_num_threads(threads)


def test_scores_spread_past_the_range_of_exp(kernel):
    """Scores hundreds apart: the softmax's shifted exponentials underflow (clamped in the
    kernel's own exp) and the output still matches."""
    _compare(kernel, [300, 37], 9, 3, 16, scale=40.0)


def _compare(kernel, seq_lens, num_q_heads, num_kv_heads, block_size, scale=0.125):
    gen = torch.Generator().manual_seed(len(seq_lens))
    config, cache, tables, lens, slots, qkv, (cos, sin) = _inputs(seq_lens, num_q_heads, num_kv_heads, 64, block_size, gen)
    slots[-1] = -1 if len(seq_lens) > 1 else slots[-1]  # a token whose K/V is not written
    expected_cache = KVCache(config, cache.num_blocks, block_size, torch.float32, "cpu", tensor=cache.tensor.clone())
    expected = ref.rope_decode_attention(qkv, cos, sin, *expected_cache.layer(1), slots, tables, lens, num_q_heads, scale,
                                         torch.empty(len(seq_lens), num_q_heads * 64))
    out = kernel.rope_decode_attention(qkv, cos, sin, *cache.layer(1), slots, tables, lens, num_q_heads, scale,
                 torch.full((len(seq_lens), num_q_heads * 64), float("nan")))
    assert rel_err(out, expected) < 1e-5
    # the same K/V written at the same slots, nothing else touched (every layer, every block)
    assert torch.allclose(cache.tensor, expected_cache.tensor, rtol=0, atol=1e-5)


def test_refuses_tensors_it_cannot_read(kernel):
    gen = torch.Generator().manual_seed(0)
    _, cache, tables, lens, slots, qkv, (cos, sin) = _inputs([5], 2, 2, 8, 4, gen)
    with pytest.raises(ValueError, match="qkv"):
        kernel.rope_decode_attention(qkv.double(), cos, sin, *cache.layer(0), slots, tables, lens, 2, 1.0, torch.empty(1, 16))
    with pytest.raises(ValueError, match="block_tables"):
        kernel.rope_decode_attention(qkv, cos, sin, *cache.layer(0), slots, tables.long(), lens, 2, 1.0, torch.empty(1, 16))
    with pytest.raises(ValueError, match="shapes do not fit"):  # 3 query heads: qkv holds 2
        kernel.rope_decode_attention(qkv, cos, sin, *cache.layer(0), slots, tables, lens, 3, 1.0, torch.empty(1, 24))
    with pytest.raises(ValueError, match="exceeds its block table"):
        kernel.rope_decode_attention(qkv, cos, sin, *cache.layer(0), slots, tables, lens + 100, 2, 1.0,
                                     torch.empty(1, 16))


def test_builds_once_per_machine(tmp_path):
    first = load(tmp_path)
    if first is None:
        pytest.skip("no C compiler on this machine")
    built = list(tmp_path.glob("*.so"))
    mtime = built[0].stat().st_mtime_ns
    assert load(tmp_path) is not None
    assert list(tmp_path.glob("*.so")) == built and built[0].stat().st_mtime_ns == mtime


@pytest.mark.slow
def test_processes_starting_together_build_it_once(tmp_path):
    """``make run`` starts three processes that all need the kernels at once: one compiles, the
    others wait on the lock and load its library."""
    script = ("import sys; from pathlib import Path; from kernels.cpu_ops import load; "
              "sys.exit(0 if load(Path(sys.argv[1])) is not None else 3)")
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path)]) for _ in range(3)]
    codes = [p.wait(timeout=120) for p in procs]
    if codes == [3, 3, 3]:
        pytest.skip("no C compiler on this machine")
    assert codes == [0, 0, 0]
    assert len(list(tmp_path.glob("*.so"))) == 1 and not list(tmp_path.glob("tmp*"))


def test_without_a_compiler_the_caller_keeps_pytorch(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CC", "no-such-compiler")
    with caplog.at_level(logging.WARNING, logger="kernels.cpu_ops"):
        assert load(tmp_path) is None
    assert "no-such-compiler" in caplog.text


@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_the_reference(kernel, with_residual):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 2 * 576, generator=gen)[:, :576]  # rows apart: a strided view
    residual = torch.randn(5, 576, generator=gen) if with_residual else None
    weight = torch.rand(576, generator=gen) + 0.5
    expected = ref.rms_norm(x, weight, 1e-5, residual)
    got = kernel.rms_norm(x, weight, 1e-5, residual)
    if with_residual:
        assert rel_err(got[0], expected[0]) < 1e-6 and torch.equal(got[1], expected[1])
    else:
        assert rel_err(got, expected) < 1e-6


def test_rms_norm_leaves_other_dtypes_and_misfits_to_the_reference(kernel):
    x, weight = torch.randn(3, 8, dtype=torch.bfloat16), torch.ones(8, dtype=torch.bfloat16)
    assert torch.equal(kernel.rms_norm(x, weight, 1e-6), ref.rms_norm(x, weight, 1e-6))
    with pytest.raises(RuntimeError):  # a weight of another size: the reference's error, not a stray read
        kernel.rms_norm(torch.randn(3, 8), torch.ones(4), 1e-6)


def test_silu_and_mul_matches_the_reference(kernel):
    x = torch.randn(4, 2 * 1536, generator=torch.Generator().manual_seed(4)) * 4
    assert rel_err(kernel.silu_and_mul(x[1:]), ref.silu_and_mul(x[1:])) < 1e-6
    x[:, :4] = torch.tensor([-100.0, -90.0, 90.0, 100.0])  # gates past the range of the kernel's exp
    assert rel_err(kernel.silu_and_mul(x), ref.silu_and_mul(x)) < 1e-6
    half = x.bfloat16()
    assert torch.equal(kernel.silu_and_mul(half), ref.silu_and_mul(half))


@pytest.mark.parametrize("planes, rows, cols, group_size", [
    (1, 96, 64, 32),  # one plane (4-bit codes), two groups a row
    (2, 40, 128, 64),  # two planes (8-bit codes), wider groups
    (3, 16, 96, 32),  # three planes (12-bit codes)
    (1, 1536, 576, 32),  # a SmolLM2 projection
])
def test_dequantize_int4_equals_the_reference_rounded_to_bfloat16(kernel, planes, rows, cols, group_size):
    generator = torch.Generator().manual_seed(planes * rows)
    codes = torch.randint(0, 16, (planes, rows, cols), generator=generator)
    nibbles = ref.pack_int4(codes, group_size)
    scales_and_zeros = torch.randn(planes, cols // group_size, rows, 2, generator=generator).bfloat16()
    out = kernel.dequantize_int4(nibbles, scales_and_zeros, group_size, torch.empty(rows, cols, dtype=torch.bfloat16))
    expected = ref.dequantize_int4(nibbles, scales_and_zeros, group_size)
    assert torch.equal(out, expected.bfloat16())
    # the reference reads the codes where pack_int4 put them: each weight from its own code
    scale, zero = (scales_and_zeros[..., i].float().transpose(1, 2).repeat_interleave(group_size, dim=2)
                   for i in (0, 1))
    assert torch.allclose(expected, ((codes - 8) * scale + zero).sum(0), rtol=0, atol=1e-5)


def test_dequantize_int4_refuses_a_layout_it_does_not_read(kernel):
    nibbles = torch.zeros(1, 8, 16, dtype=torch.uint8)
    bf16 = torch.bfloat16
    with pytest.raises(ValueError, match="group_size"):
        kernel.dequantize_int4(nibbles, torch.zeros(1, 2, 8, 2, dtype=bf16), 16, torch.empty(8, 32, dtype=bf16))
    with pytest.raises(ValueError, match="scales_and_zeros"):
        kernel.dequantize_int4(nibbles, torch.zeros(1, 1, 8, 2), 32, torch.empty(8, 32, dtype=bf16))
    with pytest.raises(ValueError, match="out"):
        kernel.dequantize_int4(nibbles, torch.zeros(1, 1, 8, 2, dtype=bf16), 32, torch.empty(8, 16, dtype=bf16))
