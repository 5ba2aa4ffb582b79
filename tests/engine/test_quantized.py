"""GGUF weights kept quantized: block decoding against the ``gguf`` package's own dequantizer,
the int4 matmul against a float32 matmul over the dequantized weight, and the real model's
quantized load against transformers' dequantized conversion."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from engine.gguf_tensors import decode, read_gguf
from engine.layers.quantized import GroupQuantized, Int4Linear, QuantizedEmbedding
from engine.model_source import default_gguf_path, resolve_model

BLOCK_TYPES = [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0]


def _quantized(qtype: GGMLQuantizationType, rows: int = 48, cols: int = 128, seed: int = 0) -> np.ndarray:
    """A ``[rows, cols]`` random weight quantized by the ``gguf`` package: ``[rows, row bytes]`` uint8."""
    weight = np.random.default_rng(seed).normal(0, 0.05, (rows, cols)).astype(np.float32)
    weight[0] += 0.3  # a row with every weight positive: Q4_1's minimum is not -8 d there
    return quantize(weight, qtype)


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_decoded_blocks_dequantize_exactly_as_the_gguf_package_does(qtype):
    data = _quantized(qtype)
    weight = decode(data, qtype)
    assert isinstance(weight, GroupQuantized) and weight.shape == (48, 128)
    assert torch.equal(weight.dequantize(), torch.from_numpy(dequantize(data, qtype)))


def test_float_tensors_come_back_dense():
    data = np.arange(12, dtype=np.float32).reshape(3, 4)
    weight = decode(data, GGMLQuantizationType.F32)
    assert torch.equal(weight, torch.from_numpy(data))


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_int4_planes_sum_to_the_weight(qtype):
    weight = decode(_quantized(qtype), qtype)
    total = sum(((q.float() - 8) * s.repeat_interleave(32, 1) + z.repeat_interleave(32, 1))
                for q, s, z in weight.int4_planes())
    assert all(q.min() >= 0 and q.max() <= 15 for q, _, _ in weight.int4_planes())
    assert len(weight.int4_planes()) == weight.bits // 4
    torch.testing.assert_close(total, weight.dequantize(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("num_tokens", [1, 5])
def test_int4_linear_matches_a_float32_matmul_of_the_dequantized_weight(qtype, num_tokens):
    weight = decode(_quantized(qtype, rows=64, cols=256), qtype)
    bias = torch.randn(64)
    x = torch.randn(num_tokens, 256, generator=torch.Generator().manual_seed(1))
    expected = x @ weight.dequantize().T + bias
    got = Int4Linear(weight, bias)(x)
    assert got.dtype == torch.float32 and got.shape == (num_tokens, 64)
    # the matmul runs in bfloat16 (input, scales, output): ~3 significant digits
    torch.testing.assert_close(got, expected, rtol=0.02, atol=0.02 * expected.abs().max().item())
    assert Int4Linear(weight, bias)(x.bfloat16()).dtype == torch.bfloat16


def test_quantized_embedding_returns_the_dequantized_rows():
    weight = decode(_quantized(GGMLQuantizationType.Q8_0, rows=20, cols=64), GGMLQuantizationType.Q8_0)
    ids = torch.tensor([3, 0, 19, 3])
    got = QuantizedEmbedding(weight)(ids)
    assert torch.equal(got, weight.dequantize()[ids])
    assert torch.equal(QuantizedEmbedding(weight, torch.bfloat16)(ids), weight.dequantize()[ids].bfloat16())


def test_fusing_weights_of_different_formats_is_refused():
    four = decode(_quantized(GGMLQuantizationType.Q4_1), GGMLQuantizationType.Q4_1)
    eight = decode(_quantized(GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
    with pytest.raises(ValueError, match="cannot fuse"):
        GroupQuantized.cat([four, eight])
    fused = GroupQuantized.cat([four, four.rows(slice(0, 5))])
    assert fused.shape == (53, 128) and torch.equal(fused.dequantize()[48:], four.dequantize()[:5])


@pytest.mark.slow
def test_the_real_gguf_reads_as_transformers_converts_it():
    """Every tensor of the shipped Q4_1 GGUF, decoded (q/k rows put back in HF's order), equals
    transformers' float32 conversion bit for bit; the projections stay quantized."""
    from safetensors import safe_open

    weights = read_gguf(default_gguf_path())
    assert weights.architecture == "llama"
    assert weights.types["model.layers.0.self_attn.q_proj.weight"] == "Q4_1"
    assert weights.types["model.embed_tokens.weight"] == "Q8_0"
    with safe_open(resolve_model(None).path / "model.safetensors", framework="pt") as converted:
        assert set(converted.keys()) == set(weights.tensors)
        for name, tensor in weights.tensors.items():
            dense = tensor.dequantize() if isinstance(tensor, GroupQuantized) else tensor
            assert torch.equal(dense, converted.get_tensor(name)), name
