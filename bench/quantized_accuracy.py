"""What computing a GGUF's weights quantized costs in accuracy: ``quantization="gguf"`` (Q4_1 /
Q8_0 weights kept as they are, matmuls in bfloat16) against ``"none"`` (the same file
dequantized to float32, the path that matches HF transformers token for token), on the real
SmolLM2-135M-Instruct Q4_1.

- Greedy agreement (:mod:`bench.agreement`): 64 chat prompts x 64 new tokens, EOS ignored; the
  share of positions with the same token, and |Δ log-prob| of the picked token until a
  sequence's first disagreement.
- Perplexity of ``bench/data/perplexity.txt`` (a text written for this project), every token
  scored by one forward pass over the whole text.

Both engines run in this one process. Prints the JSON record and writes it under
``bench/results/``. Usage: ``python bench/quantized_accuracy.py [--prompts 64] [--max-tokens 64]``
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.agreement import agreement, greedy_rows  # noqa: E402
from bench.common import machine, write_result  # noqa: E402
from bench.offline_cpu import TOPICS  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.attention import AttentionMetadata  # noqa: E402
from engine.kv_cache import KVCache  # noqa: E402
from engine.model_source import default_gguf_path  # noqa: E402

TEXT = Path(__file__).resolve().parent / "data" / "perplexity.txt"
ASKS = ["Explain {} in a short paragraph.", "Give three facts about {}.",
        "Write a question a student might ask about {}, then answer it.", "Describe {} to a ten-year-old."]


def chat_prompts(tokenizer, count: int) -> list[list[int]]:
    """``count`` (at most 64) different chat prompts as token ids: each topic of
    :data:`bench.offline_cpu.TOPICS` asked four ways."""
    asks = [ask.format(topic) for ask in ASKS for topic in TOPICS][:count]
    return [tokenizer.apply_chat_template([{"role": "user", "content": ask}]) for ask in asks]


@torch.inference_mode()
def perplexity(llm: LLM, token_ids: list[int]) -> float:
    """``exp`` of the mean negative log-likelihood of ``token_ids[1:]``, each given the tokens
    before it: one prefill of the whole text into a KV cache of its own (the engine's, and its
    prefix cache, are left alone)."""
    engine, block_size = llm.engine, 16
    n = len(token_ids)
    num_blocks = -(-n // block_size)
    cache = KVCache(engine.model_config, num_blocks, block_size, engine.dtype, "cpu")
    metadata = AttentionMetadata(
        slot_mapping=torch.arange(n), block_tables=torch.arange(num_blocks, dtype=torch.int32)[None],
        seq_lens=torch.tensor([n], dtype=torch.int32), query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        num_decodes=0, max_query_len=n, max_seq_len=n, max_decode_seq_len=0)
    ids = torch.tensor(token_ids)
    hidden = engine.model(ids, torch.arange(n), cache, metadata)
    logprobs = torch.log_softmax(engine.model.compute_logits(hidden[:-1]), dim=-1)
    return math.exp(-logprobs.gather(1, ids[1:, None]).mean().item())


def measure(num_prompts: int = 64, max_tokens: int = 64) -> dict[str, float]:
    """Agreement and perplexities of ``"gguf"`` against ``"none"`` (see the module docstring)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=5)
    runs = {}
    for quantization in ("none", "gguf"):
        llm = LLM(quantization=quantization)
        tokenizer = llm.get_tokenizer()
        text = tokenizer.encode(TEXT.read_text())
        rows = greedy_rows(llm.generate(chat_prompts(tokenizer, num_prompts), params, use_tqdm=False))
        runs[quantization] = (rows, perplexity(llm, text))
        del llm
    (dense, ppl_none), (quantized, ppl_gguf) = runs["none"], runs["gguf"]
    metrics = {f"greedy_{k}" if k == "agreement" else k: round(v, 4) for k, v in agreement(dense, quantized).items()}
    metrics.update(perplexity_none=round(ppl_none, 4), perplexity_gguf=round(ppl_gguf, 4),
                   perplexity_ratio=round(ppl_gguf / ppl_none, 4))
    return metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    metrics = measure(args.prompts, args.max_tokens)
    workload = {"prompts": args.prompts, "max_tokens": args.max_tokens, "greedy": True, "ignore_eos": True,
                "perplexity_text": str(TEXT.relative_to(TEXT.parents[2])), "reference": "quantization=none (float32)"}
    write_result("quantized_accuracy", metrics, workload, model=default_gguf_path().name, machine=machine())


if __name__ == "__main__":
    main()
