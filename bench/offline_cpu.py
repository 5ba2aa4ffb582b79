"""Offline throughput on the CPU: Tandem's ``LLM.generate`` against transformers' ``generate``.

The real SmolLM2-135M-Instruct in float32, 16 different chat prompts, 64 new tokens each,
greedy, EOS ignored. transformers runs once as one left-padded batch and once one prompt at a
time; all three run in this one process, after a warm-up each, so their ratio holds on a busy
machine. Prints the JSON record and writes it under ``bench/results/offline_cpu/``.

Usage: ``python -m bench.offline_cpu [--max-tokens 64]``
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from bench.common import machine, write_result
from engine import LLM, SamplingParams
from engine.model_source import default_gguf_path

TOPICS = [
    "the water cycle", "how vaccines work", "the French revolution", "black holes",
    "photosynthesis", "the rules of chess", "how a CPU cache works", "the history of tea",
    "plate tectonics", "why cats purr", "the stock market", "the Roman aqueducts",
    "how airplanes fly", "the immune system", "the origins of jazz", "recycling plastics",
]


def chat_prompts(tokenizer) -> list[list[int]]:
    """16 chat prompts of different lengths, as token ids."""
    prompts = []
    for i, topic in enumerate(TOPICS):
        detail = " Use simple words and give one example." * (i % 4)
        messages = [{"role": "user", "content": f"Explain {topic} in a short paragraph.{detail}"}]
        prompts.append(tokenizer.apply_chat_template(messages))
    return prompts


def hf_generate(model, batch: list[list[int]], pad_id: int, max_new_tokens: int) -> list[list[int]]:
    """Greedy ``generate`` of a left-padded batch; returns the new tokens of each row."""
    from transformers import GenerationConfig

    width = max(len(p) for p in batch)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                              pad_token_id=pad_id)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    return out[:, width:].tolist()


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    new_tokens = args.max_tokens

    llm = LLM(dtype="float32", device="cpu", quantization="none")
    prompts = chat_prompts(llm.get_tokenizer())
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts[:4], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    outs, tandem_s = timed(lambda: llm.generate(prompts, params, use_tqdm=False))
    tandem_tokens = [o.outputs[0].token_ids for o in outs]

    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(str(default_gguf_path()))
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    pad_id = llm.get_tokenizer().pad_token_id or 0
    hf_generate(model, prompts[:4], pad_id, 4)
    _, batched_s = timed(lambda: hf_generate(model, prompts, pad_id, new_tokens))
    sequential, sequential_s = timed(lambda: [hf_generate(model, [p], pad_id, new_tokens)[0] for p in prompts])

    total = len(prompts) * new_tokens
    matches = sum(a == b for a, b in zip(tandem_tokens, sequential))
    metrics = {
        "tandem_tok_s": round(total / tandem_s, 2),
        "hf_batched_tok_s": round(total / batched_s, 2),
        "hf_sequential_tok_s": round(total / sequential_s, 2),
        "speedup_vs_hf_batched": round(batched_s / tandem_s, 3),
        "speedup_vs_hf_sequential": round(sequential_s / tandem_s, 3),
        "tandem_outputs_equal_hf_sequential": matches / len(prompts),
    }
    workload = {"prompts": len(prompts), "new_tokens": new_tokens, "greedy": True, "ignore_eos": True,
                "dtype": "float32", "prompt_tokens": [len(p) for p in prompts],
                "torch_threads": torch.get_num_threads()}
    write_result("offline_cpu", metrics, workload, model="SmolLM2-135M-Instruct (GGUF Q4_1, dequantized)",
                 machine=machine())


if __name__ == "__main__":
    main()
