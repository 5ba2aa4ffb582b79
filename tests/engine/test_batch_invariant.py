"""Batch-invariant engines (``EngineConfig.batch_invariant``): refused where they cannot hold,
and on the GPU in bfloat16 a greedy answer is the same bytes alone, in a batch, and verified
from drafts (where cuBLAS's kernel choice by row count flips near-ties:
tests/kernels/test_matmul.py shows it differ)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from tests.helpers.prompts import GROUNDED_CHATS

NGRAM = {"method": "ngram", "num_speculative_tokens": 8, "disable_by_batch_size": 1024}


def test_batch_invariance_is_refused_off_cuda_and_with_tensor_parallelism():
    with pytest.raises(ValueError, match="batch_invariant runs on CUDA only"):
        LLM(model="smollm2-135m", load_format="dummy", device="cpu", batch_invariant=True, num_blocks=16)
    with pytest.raises(ValueError, match="batch_invariant runs with tensor_parallel_size 1"):
        EngineConfig(batch_invariant=True, tensor_parallel_size=2)


def _answers(llm: LLM, prompts: list[str], params: SamplingParams, together: bool) -> list[list[int]]:
    if together:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    return [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_bf16_answers_are_the_same_alone_batched_and_speculated():
    """The real SmolLM2 in bfloat16, greedy: each chat's answer alone, among all the chats, and
    with n-gram speculation of 8 drafts (verifications of 9 rows a sequence), alone and
    together, token for token; the speculating engine accepts drafts and leaks no block."""
    config = dict(device="cuda", dtype="bfloat16", quantization="none", block_size=16, batch_invariant=True,
                  gpu_memory_utilization=0.2)
    plain, spec = LLM(**config), LLM(**config, speculative_config=NGRAM)
    params = SamplingParams(max_tokens=96, temperature=0)
    prompts = [plain.engine.tokenizer.apply_chat_template(chat) for chat in GROUNDED_CHATS]
    want = _answers(plain, prompts, params, together=False)
    free = spec.engine.num_free_blocks
    assert _answers(plain, prompts, params, together=True) == want
    assert _answers(spec, prompts, params, together=False) == want
    assert _answers(spec, prompts, params, together=True) == want
    assert spec.engine.stats().spec_decoding.num_accepted_tokens > 0
    assert spec.engine.num_free_blocks == free
