"""Our Llama-family model gives HF transformers' logits, through the paged KV cache.

Each case builds a tiny random HF model, saves it as safetensors, loads it with our loader
and compares logits for one prefill, a chunked prefill, and prefill + decode steps mixed
with another sequence's prefill (decode tokens first, as the model runner orders them).
"""

from __future__ import annotations

import pytest
import torch
import transformers

from engine.layers.linear import BatchInvariantLinear, PackedLinear, packed_linear_available, replace_linears
from engine.layers.rotary import RotaryEmbedding
from engine.loading.loader import load_model
from engine.loading.model_config import ModelConfig
from tests.helpers.models import (
    ATOL, LLAMA3_ROPE, TINY, PagedRunner, hf_logits, make_hf_model, tokens,
)
from tests.helpers.paged_inputs import DEVICE

CASES = {
    "llama-gqa-untied": (transformers.LlamaConfig, dict(tie_word_embeddings=False)),
    "llama3-rope-tied": (transformers.LlamaConfig, dict(tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE)),
    "llama-linear-rope-mha": (transformers.LlamaConfig, dict(
        num_key_value_heads=4, rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 500.0})),
    "mistral": (transformers.MistralConfig, dict(sliding_window=None)),
    "qwen2-bias-tied": (transformers.Qwen2Config, dict(tie_word_embeddings=True)),
    "qwen3-qknorm-mqa": (transformers.Qwen3Config, dict(num_key_value_heads=1)),
}


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    """``(hf_model, our_model)`` with the same weights, loaded through safetensors."""
    hf = make_hf_model(*CASES[request.param])
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, load_model(str(path)).model


def test_prefill_two_sequences_match_hf(pair):
    hf, ours = pair
    a, b = tokens(11, 1), tokens(6, 2)
    out_a, out_b = PagedRunner(ours).step([(0, a), (1, b)])
    torch.testing.assert_close(out_a, hf_logits(hf, a), atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(out_b, hf_logits(hf, b), atol=ATOL, rtol=ATOL)


def test_chunked_prefill_matches_hf(pair):
    hf, ours = pair
    prompt = tokens(13, 3)
    runner = PagedRunner(ours)
    (first,) = runner.step([(0, prompt[:6])])
    (second,) = runner.step([(0, prompt[6:])])
    torch.testing.assert_close(torch.cat([first, second]), hf_logits(hf, prompt), atol=ATOL, rtol=ATOL)


def test_decode_steps_match_hf(pair):
    """Sequence 0 prefills then decodes; sequence 1's prefill joins the batch mid-way."""
    hf, ours = pair
    seq0, seq1 = tokens(9, 4), tokens(7, 5)
    runner = PagedRunner(ours)
    logits0 = runner.step([(0, seq0[:5])])
    logits1 = []
    for i in range(5, 9):
        step = [(0, [seq0[i]])] + ([(1, seq1[:5])] if i == 6 else [(1, [seq1[i - 2]])] if i > 6 else [])
        out = runner.step(step)
        logits0.append(out[0])
        logits1 += out[1:]
    torch.testing.assert_close(torch.cat(logits0), hf_logits(hf, seq0), atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(torch.cat(logits1), hf_logits(hf, seq1), atol=ATOL, rtol=ATOL)


def test_weights_move_logits(pair):
    """Guard against a vacuous match: the test logits are far larger than the tolerance."""
    hf, _ = pair
    assert hf_logits(hf, tokens(8, 6)).std() > 100 * ATOL


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_close_to_float32(tmp_path, dtype):
    hf = make_hf_model(transformers.LlamaConfig, dict(rope_parameters=LLAMA3_ROPE))
    hf.save_pretrained(tmp_path)
    prompt = tokens(10, 7)
    (out,) = PagedRunner(load_model(str(tmp_path), dtype=dtype).model).step([(0, prompt)])
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, hf_logits(hf, prompt), atol=0.15, rtol=0.05)


def test_rope_table_matches_hf():
    config = transformers.LlamaConfig(**{**TINY, "rope_parameters": LLAMA3_ROPE})
    hf_rope = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
    positions = torch.arange(TINY["max_position_embeddings"])
    hf_cos, hf_sin = hf_rope(torch.zeros(1, dtype=torch.float32), positions[None])
    ours = ModelConfig.from_hf_dict(config.to_diff_dict())
    cos, sin = RotaryEmbedding(16, 128, ours.rope_theta, ours.rope_scaling)(positions, torch.float32)
    torch.testing.assert_close(torch.cat([cos, cos], -1).squeeze(1), hf_cos[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(torch.cat([sin, sin], -1).squeeze(1), hf_sin[0], atol=1e-6, rtol=0)


def test_unknown_rope_scaling_rejected():
    with pytest.raises(ValueError, match="rope_scaling"):
        RotaryEmbedding(16, 128, 10000.0, {"rope_type": "yarn", "factor": 4.0})


@pytest.mark.skipif(not packed_linear_available(torch.device("cpu"), torch.float32), reason="needs oneDNN")
def test_packed_linears_compute_the_same_and_keep_forward_hooks():
    # Tensor parallelism's all-reduce is a forward hook on o_proj / down_proj; packing replaces them.
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    net[2].register_forward_hook(lambda _module, _args, output: output * 10)
    x = torch.randn(3, 8)
    with torch.no_grad():
        expected = net(x)
        assert replace_linears(net, PackedLinear) == 2
        assert isinstance(net[0], PackedLinear) and isinstance(net[2], PackedLinear)
        torch.testing.assert_close(net(x), expected)
        torch.testing.assert_close(net[2](torch.zeros(1, 16)), 10 * net[2].bias.unsqueeze(0))


def test_batch_invariant_linears_compute_the_same_and_keep_forward_hooks():
    """The Triton matmul's layers (under the interpreter on the CPU) in place of ``nn.Linear``,
    an input with a row stride of its own included (a fused projection's slice)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4, bias=False)).to(DEVICE)
    net[2].register_forward_hook(lambda _module, _args, output: output * 10)
    x = torch.randn(3, 12, device=DEVICE)[:, 2:10]
    with torch.no_grad():
        expected = net(x)
        assert replace_linears(net, BatchInvariantLinear) == 2
        assert isinstance(net[0], BatchInvariantLinear) and isinstance(net[2], BatchInvariantLinear)
        torch.testing.assert_close(net(x), expected, rtol=1e-5, atol=1e-5)
