"""What a cheaper way of computing costs in accuracy, measured against the exact one on the real
model: greedy agreement (:mod:`bench.agreement`) over chat prompts, and perplexity of
``bench/data/perplexity.txt`` (a text written for this project). Shared by
``bench/quantized_accuracy.py`` (weights) and ``bench/fp8_kv_accuracy.py`` (the KV cache)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path

import torch

from bench.agreement import agreement, greedy_rows
from bench.common import machine, write_result
from bench.offline_cpu import TOPICS
from engine import LLM, SamplingParams
from engine.runner.attention import AttentionMetadata
from engine.runner.kv_cache import KVCache
from engine.model_source import default_gguf_path

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
    before it: one prefill of the whole text into a KV cache of its own, of the engine's KV
    cache dtype (the engine's cache, and its prefix cache, are left alone)."""
    engine, block_size = llm.engine, 16
    n = len(token_ids)
    num_blocks = -(-n // block_size)
    cache = KVCache(engine.model_config, num_blocks, block_size, engine.kv_cache.tensor.dtype, "cpu")
    metadata = AttentionMetadata(
        slot_mapping=torch.arange(n), block_tables=torch.arange(num_blocks, dtype=torch.int32)[None],
        seq_lens=torch.tensor([n], dtype=torch.int32), query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        num_decodes=0, max_query_len=n, max_seq_len=n, max_decode_seq_len=0)
    ids = torch.tensor(token_ids)
    hidden = engine.model(ids, torch.arange(n), cache, metadata)
    logprobs = torch.log_softmax(engine.model.compute_logits(hidden[:-1]), dim=-1)
    return math.exp(-logprobs.gather(1, ids[1:, None]).mean().item())


def evaluate(llm: LLM, num_prompts: int, max_tokens: int) -> tuple[list, float]:
    """``llm``'s greedy rows (:func:`bench.agreement.greedy_rows`) over ``num_prompts`` chat
    prompts x ``max_tokens`` new tokens (EOS ignored, top-5 log-probs), and its perplexity."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=5)
    tokenizer = llm.get_tokenizer()
    rows = greedy_rows(llm.generate(chat_prompts(tokenizer, num_prompts), params, use_tqdm=False))
    return rows, perplexity(llm, tokenizer.encode(TEXT.read_text()))


def compare(reference: tuple[list, float], candidate: tuple[list, float], names: tuple[str, str]) -> dict[str, float]:
    """The metrics of ``candidate`` against ``reference`` (each :func:`evaluate`'s result):
    ``greedy_agreement``, ``max_logprob_diff``, ``mean_logprob_diff``, ``disagreements_in_top5``
    (:func:`bench.agreement.agreement`), ``perplexity_{name}`` of each (``names``: reference's,
    candidate's) and ``perplexity_ratio`` (candidate / reference), rounded to 4 places."""
    (rows_ref, ppl_ref), (rows, ppl) = reference, candidate
    metrics = {f"greedy_{k}" if k == "agreement" else k: v for k, v in agreement(rows_ref, rows).items()}
    metrics.update({f"perplexity_{names[0]}": ppl_ref, f"perplexity_{names[1]}": ppl,
                    "perplexity_ratio": ppl / ppl_ref})
    return {name: round(value, 4) for name, value in metrics.items()}


def main(benchmark: str, description: str, measure: Callable[[int, int], dict[str, float]], workload: dict) -> None:
    """An accuracy benchmark's command line (``--prompts``, ``--max-tokens``): ``measure(prompts,
    max_tokens)`` on the default GGUF model, its record written as ``benchmark`` with ``workload``
    (what the run compares) beside the common keys."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    metrics = measure(args.prompts, args.max_tokens)
    workload = {"prompts": args.prompts, "max_tokens": args.max_tokens, "greedy": True, "ignore_eos": True,
                "perplexity_text": str(TEXT.relative_to(TEXT.parents[2])), **workload}
    write_result(benchmark, metrics, workload, model=default_gguf_path().name, machine=machine())
