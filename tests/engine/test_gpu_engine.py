"""The engine on CUDA through the Triton attention backend (skipped without a GPU).

The device machine has no model files, so the oracle is a random-weight model of SmolLM2's
shapes built and saved here (the real HF-directory loading path), run by transformers on the
same GPU.
"""

import pytest
import torch

from engine import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SMOLLM2_SHAPES = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
    rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
)


@pytest.fixture(scope="module")
def smollm2_random_dir(tmp_path_factory):
    """An HF directory with random SmolLM2-shaped weights (std 0.05: logits far from ties)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SMOLLM2_SHAPES)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.05)
    path = tmp_path_factory.mktemp("smollm2-random")
    model.save_pretrained(path)
    return path, model


def test_fp32_greedy_matches_hf_on_gpu(smollm2_random_dir):
    path, hf = smollm2_random_dir
    hf = hf.to("cuda").eval()
    llm = LLM(model=str(path), device="cuda", dtype="float32", block_size=16, gpu_memory_utilization=0.3)
    prompts = [[(97 * i + 13 * j) % 49152 for j in range(20 + 37 * i)] for i in range(6)]
    free = llm.engine.num_free_blocks
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True), use_tqdm=False)
    assert llm.engine.num_free_blocks == free
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
    hf.generation_config.eos_token_id = None
    for prompt, out in zip(prompts, outs):
        with torch.inference_mode():
            ids = torch.tensor([prompt], device="cuda")  # token 0 is also the pad id: pass the mask
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist()


def test_bf16_llama3_8b_shapes_run_with_memory_budget():
    llm = LLM(model="llama-3-8b", load_format="dummy", device="cuda", dtype="bfloat16",
              gpu_memory_utilization=0.85, max_model_len=8192)
    engine = llm.engine
    assert engine.num_blocks > 1000
    free = engine.num_free_blocks
    prompts = [[(7 * i + j) % 128000 for j in range(100 + 50 * i)] for i in range(8)]
    params = SamplingParams(max_tokens=16, temperature=0.7, top_p=0.9, seed=1, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 16 for o in outs)
    assert engine.num_free_blocks == free
