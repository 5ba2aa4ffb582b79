"""GGUF weights kept quantized: block decoding against the ``gguf`` package's own dequantizer,
the int4 matmul against a float32 matmul over the dequantized weight, and the real model's
quantized load against transformers' dequantized conversion."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

import kernels.reference
from engine import EngineConfig, EngineCore
from engine.block_hash import hash_seed
from engine.loading.gguf_tensors import decode, read_gguf, tensor_table
from engine.layers.ops import cpu_kernels
from engine.layers.quantized import (DENSE_MIN_ROWS, GroupQuantized, Int4Linear, QuantizedEmbedding,
                                     QuantizedLogitsHead, RowInt8Linear, prompt_chunks)
from engine.model_source import default_gguf_path, resolve_model
from engine.sampling_params import SamplingParams

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


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_long_prompt_chunks_take_a_dense_matmul_each_and_every_other_row_the_int4_kernel(qtype):
    if cpu_kernels() is None:
        pytest.skip("no C compiler on this machine: the int4 kernel runs every row")
    weight = decode(_quantized(qtype, rows=64, cols=256), qtype)
    bias = torch.randn(64)
    linear = Int4Linear(weight, bias)
    n = DENSE_MIN_ROWS
    # 3 decodes, a chunk of n tokens, a short chunk of 5, a chunk of n + 7
    x = torch.randn(3 + n + 5 + n + 7, 256, generator=torch.Generator().manual_seed(2))
    chunks = ((3, 3 + n), (3 + n, 8 + n), (8 + n, 15 + 2 * n))
    int4 = linear(x)
    with prompt_chunks(chunks):
        mixed = linear(x)
    planes = kernels.reference.dequantize_int4(linear.nibbles, linear.scales_and_zeros, weight.group_size).bfloat16()
    for start, end in (chunks[0], chunks[2]):  # the planes' weights rounded to bfloat16, a GEMM per chunk
        assert torch.equal(mixed[start:end], (x[start:end].bfloat16() @ planes.T).float() + bias)
        # a chunk's rows are its own: the same alone as beside the others
        with prompt_chunks(((0, end - start),)):
            assert torch.equal(linear(x[start:end]), mixed[start:end])
    for start, end in ((0, 3), chunks[1]):  # decodes and a chunk under DENSE_MIN_ROWS: the int4 kernel
        assert torch.equal(mixed[start:end], int4[start:end])
    assert not torch.equal(mixed[chunks[0][0]:chunks[0][1]], int4[chunks[0][0]:chunks[0][1]])  # (the paths differ)
    torch.testing.assert_close(mixed, x @ weight.dequantize().T + bias, rtol=0.02, atol=0.02 * int4.abs().max().item())
    with prompt_chunks(chunks):  # a logits head's rows are never a prompt chunk's
        assert torch.equal(Int4Linear(weight, bias, dense_prompt_chunks=False)(x), int4)


def test_quantized_embedding_returns_the_dequantized_rows():
    weight = decode(_quantized(GGMLQuantizationType.Q8_0, rows=20, cols=64), GGMLQuantizationType.Q8_0)
    ids = torch.tensor([3, 0, 19, 3])
    got = QuantizedEmbedding(weight)(ids)
    assert torch.equal(got, weight.dequantize()[ids])
    assert torch.equal(QuantizedEmbedding(weight, torch.bfloat16)(ids), weight.dequantize()[ids].bfloat16())


def test_the_logits_head_gives_each_rows_best_tokens_float32_logits():
    """bfloat16 logits tie and misorder near-equal tokens; the head's shortlist is recomputed in
    float32, so its best tokens' logits (and the argmax) are the float32 matmul's."""
    weight = decode(_quantized(GGMLQuantizationType.Q8_0, rows=4096, cols=64), GGMLQuantizationType.Q8_0)
    hidden = torch.randn(3, 64, generator=torch.Generator().manual_seed(2)) * 20
    expected = hidden @ weight.dequantize().T
    logits = QuantizedLogitsHead(weight, refine=16)(hidden)
    assert logits.dtype == torch.float32 and logits.shape == (3, 4096)
    best = expected.topk(8, dim=-1).indices
    torch.testing.assert_close(logits.gather(1, best), expected.gather(1, best), rtol=1e-5, atol=1e-4)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))
    coarse = Int4Linear(weight)(hidden)  # the bfloat16 grid alone: far coarser
    assert (coarse.gather(1, best) - expected.gather(1, best)).abs().max() > 1e-3


def test_the_row_int8_shortlist_matmul_errs_by_at_most_half_a_step_per_weight():
    gen = torch.Generator().manual_seed(5)
    weight, x = torch.randn(512, 64, generator=gen), torch.randn(3, 64, generator=gen)
    expected = x @ weight.T
    got = RowInt8Linear(weight)(x)
    half_step = weight.abs().amax(dim=1) / 127 / 2  # [512]
    bound = x.abs().sum(dim=1, keepdim=True) * half_step  # the weights' rounding, at worst
    bfloat16 = 2 ** -7 * (x.abs() @ weight.abs().T)  # the input's and the output's rounding
    assert ((got - expected).abs() <= bound + bfloat16).all()
    assert (got - expected).abs().max() > 0  # an approximation: what the exact recomputation is for


def test_fusing_weights_of_different_formats_is_refused():
    four = decode(_quantized(GGMLQuantizationType.Q4_1), GGMLQuantizationType.Q4_1)
    eight = decode(_quantized(GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
    with pytest.raises(ValueError, match="cannot fuse"):
        GroupQuantized.cat([four, eight])
    fused = GroupQuantized.cat([four, four.rows(slice(0, 5))])
    assert fused.shape == (53, 128) and torch.equal(fused.dequantize()[48:], four.dequantize()[:5])


@pytest.mark.slow
def test_the_real_gguf_reads_as_transformers_dequantizes_it(hf_model):
    """Every tensor of the shipped Q4_1 GGUF, decoded (q/k rows put back in HF's order), equals
    transformers' float32 model read from the same file, bit for bit; the projections stay
    quantized."""
    weights = read_gguf(default_gguf_path())
    assert weights.architecture == "llama"
    assert weights.types["model.layers.0.self_attn.q_proj.weight"] == "Q4_1"
    assert weights.types["model.embed_tokens.weight"] == "Q8_0"
    state = hf_model[0].state_dict()
    assert set(state) - {"lm_head.weight"} == set(weights.tensors)  # lm_head: tied to the embedding
    for name, tensor in weights.tensors.items():
        dense = tensor.dequantize() if isinstance(tensor, GroupQuantized) else tensor
        assert torch.equal(dense, state[name]), name


def test_an_unknown_quantization_or_gguf_without_a_gguf_model_is_refused_by_name():
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="awq")
    with pytest.raises(ValueError, match="quantization='gguf' needs a .gguf model"):
        EngineCore("smollm2-135m", EngineConfig(num_blocks=8, quantization="gguf"), load_format="dummy")


@pytest.mark.slow
def test_the_default_model_runs_quantized_on_the_cpu_and_its_kv_is_another_models():
    """On the CPU a GGUF loads quantized by default: the projections and the tied logits head
    are int4 layers holding about a seventh of the float32 bytes, and the prefix cache's seed
    differs from the dequantized model's (their KV differs)."""
    engine = EngineCore(None, EngineConfig(num_blocks=64))
    layers = dict(engine.model.named_modules())
    assert engine.quantization == "gguf" and engine.kv_cache_dtype == "float32"
    assert isinstance(layers["model.layers.0.self_attn.qkv_proj"], Int4Linear)
    assert isinstance(layers["model.layers.29.mlp.down_proj"], Int4Linear)
    assert isinstance(layers["lm_head"], QuantizedLogitsHead) and isinstance(layers["model.embed_tokens"], QuantizedEmbedding)
    assert not any(isinstance(m, torch.nn.Linear) for m in layers.values())
    int4_bytes = sum(t.numel() * t.element_size() for layer in layers.values() if isinstance(layer, Int4Linear)
                     for plane in layer.planes for t in plane)
    params = sum(layer.in_features * layer.out_features for layer in layers.values() if isinstance(layer, Int4Linear))
    assert int4_bytes < params * 4 / 5  # float32 would be params * 4
    assert engine.hash_seed != hash_seed(engine.model_id, 16, "float32")
    assert hash_seed(engine.model_id, 16, "float32") == hash_seed(engine.model_id, 16, "float32", "none")


def test_a_prefill_step_dequantizes_each_projection_once_and_decode_steps_none(monkeypatch):
    """The model runner marks a step's prompt rows: the prefill of a 100-token prompt runs every
    projection's dense matmul (one dequantization each), its decode steps the int4 kernel only."""
    kernels_built = cpu_kernels()
    if kernels_built is None:
        pytest.skip("no C compiler on this machine: the int4 kernel runs every row")
    engine = EngineCore(None, EngineConfig(num_blocks=64))
    projections = sum(isinstance(m, Int4Linear) and m.nibbles is not None for m in engine.model.modules())
    calls = []
    real = type(kernels_built).dequantize_int4
    monkeypatch.setattr(type(kernels_built), "dequantize_int4", lambda self, *a: calls.append(1) or real(self, *a))
    engine.add_request("r", list(range(1000, 1100)), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    counts = []
    while not any(out.finished for out in engine.step().outputs):
        counts.append(len(calls))
    assert projections == 4 * 30 and counts[0] == projections and len(calls) == projections


@pytest.mark.slow
def test_the_converted_directory_keeps_the_gguf_tensor_table_a_load_reads():
    source = resolve_model(None)
    assert source.gguf == default_gguf_path()
    assert source.gguf_tensor_table() == tensor_table(source.gguf)
    assert {"config.json", "tokenizer.json"} <= {p.name for p in source.path.iterdir()}
    assert not list(source.path.glob("*.safetensors"))  # the weights stay in the GGUF file
