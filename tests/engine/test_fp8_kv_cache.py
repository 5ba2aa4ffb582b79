"""An engine whose KV cache is float8 e4m3 (``kv_cache_dtype="fp8_e4m3"``), on a tiny random Llama,
on the CPU (the reference path) and on a CUDA GPU (the Triton kernels, CUDA graphs)."""

import math

import pytest
import torch

from engine import EngineConfig, EngineCore, SamplingParams
from engine.runner.devices import check_kv_cache_dtype
from tests.helpers.engine import prefill_then_decode, run_until_finished
from tests.helpers.models import save_tiny_llama, tokens

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=1)


CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=CUDA)])
def device(request) -> str:
    return request.param


def _engine(model: str, kv_cache_dtype: str, device: str, **config) -> EngineCore:
    """A bfloat16 engine of ``model`` on ``device`` with a 1 MiB KV budget (on CUDA, whose budget
    is a share of the GPU's memory, 256 blocks) unless ``config`` says otherwise."""
    settings = dict(device=device, dtype="bfloat16", kv_cache_memory_bytes=1 << 20, kv_cache_dtype=kv_cache_dtype,
                    **({"num_blocks": 256} if device == "cuda" else {}))
    return EngineCore(model, EngineConfig(**{**settings, **config}))


def test_fp8_cache_holds_twice_the_blocks_of_bfloat16_in_the_same_memory_and_names_itself(tiny_llama):
    bf16, fp8 = _engine(tiny_llama, "auto", "cpu"), _engine(tiny_llama, "fp8_e4m3", "cpu")
    assert fp8.num_blocks == 2 * bf16.num_blocks
    assert fp8.kv_cache.tensor.dtype == torch.float8_e4m3fn
    assert fp8.kv_cache.tensor.nbytes == bf16.kv_cache.tensor.nbytes == 1 << 20
    # published and in the hash seed: the two never share a pool or a prefix cache's blocks
    assert (bf16.kv_cache_dtype, fp8.kv_cache_dtype) == ("bfloat16", "fp8_e4m3")
    assert fp8.hash_seed != bf16.hash_seed


def test_fp8_cache_gives_finite_outputs_that_follow_the_bfloat16_cache(tiny_llama, device):
    outputs = {}
    for kv_cache_dtype in ("auto", "fp8_e4m3"):
        engine = _engine(tiny_llama, kv_cache_dtype, device)
        for i in range(3):
            engine.add_request(f"r{i}", tokens(40, seed=i), GREEDY)
        finished = {}
        while engine.has_unfinished_requests:
            finished.update({out.request_id: out for out in engine.step().outputs if out.finished})
        outputs[kv_cache_dtype] = [finished[f"r{i}"].outputs[0] for i in range(3)]
        written = engine.kv_cache.tensor.float()
        assert torch.isfinite(written).all() and written.abs().max() > 0
    for fp8, bf16 in zip(outputs["fp8_e4m3"], outputs["auto"]):
        logprobs = [top[token] for token, top in zip(fp8.token_ids, fp8.logprobs)]
        assert len(fp8.token_ids) == 16 and all(math.isfinite(lp) for lp in logprobs)
        # the first token comes from the prompt's prefill over fp8 K/V, the rest from decodes
        assert fp8.token_ids[0] == bf16.token_ids[0]
        assert abs(logprobs[0] - bf16.logprobs[0][bf16.token_ids[0]]) < 0.1


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(max_tokens=12, temperature=0.8, seed=3, n=2)])
def test_fp8_prefill_then_decode_equals_one_engine(tiny_llama, device, params):
    """fp8 blocks copied byte for byte from a prefill engine decode as the engine's own do."""
    prefill, decode = (_engine(tiny_llama, "fp8_e4m3", device, num_blocks=32) for _ in range(2))
    prompt = tokens(37, seed=9)
    split = prefill_then_decode(prefill, decode, "split", prompt, params)
    prefill.add_request("whole", prompt, params)
    whole = run_until_finished(prefill, "whole")
    assert [c.token_ids for c in split.outputs] == [c.token_ids for c in whole.outputs]
    assert decode.kv_cache.tensor.dtype == torch.float8_e4m3fn


def test_a_float8_cache_is_refused_on_a_gpu_older_than_ada(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))  # an A100
    with pytest.raises(ValueError, match="kv_cache_dtype: a float8 KV cache needs .* 8.9 .* is 8.0"):
        check_kv_cache_dtype(torch.float8_e4m3fn, torch.device("cuda", 0))
    check_kv_cache_dtype(torch.bfloat16, torch.device("cuda", 0))  # a 16-bit cache runs anywhere
    check_kv_cache_dtype(torch.float8_e4m3fn, torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # an H100
    check_kv_cache_dtype(torch.float8_e4m3fn, torch.device("cuda", 0))
