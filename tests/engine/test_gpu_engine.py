"""The engine on CUDA through the Triton attention backend (skipped without a GPU)."""

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.conftest import CHATS, PLAIN_PROMPTS, hf_greedy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_fp32_greedy_matches_hf_on_gpu(hf_model):
    model, tokenizer = hf_model
    model = model.to("cuda")
    llm = LLM(device="cuda", dtype="float32", block_size=16)
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in PLAIN_PROMPTS]
    prompts += [tokenizer.encode(tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True),
                                 add_special_tokens=False) for c in CHATS]
    free = llm.engine.num_free_blocks
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True), use_tqdm=False)
    assert llm.engine.num_free_blocks == free
    for prompt, out in zip(prompts, outs):
        with torch.device("cuda"):
            expected = hf_greedy(model, prompt, 32)
        assert out.outputs[0].token_ids == expected


def test_bf16_llama3_8b_shapes_run_with_memory_budget():
    llm = LLM(model="llama-3-8b", load_format="dummy", device="cuda", dtype="bfloat16",
              gpu_memory_utilization=0.85, max_model_len=8192)
    engine = llm.engine
    assert engine.num_blocks > 1000
    free = engine.num_free_blocks
    prompts = [[(7 * i + j) % 128000 for j in range(100 + 50 * i)] for i in range(8)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 16 for o in outs)
    assert engine.num_free_blocks == free
