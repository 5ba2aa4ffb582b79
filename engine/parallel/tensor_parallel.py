"""Megatron-LM tensor parallelism applied to a plain Llama-family model.

Each of ``T`` ranks holds ``1/T`` of every projection (Shoeybi et al. 2019, "Megatron-LM",
section 3): q/k/v and gate/up are column-parallel (their output features split), o_proj and
down_proj row-parallel (their input features split) and followed by one all-reduce each, so a
decoder layer costs two all-reduces and no other communication. The heads go with the
projections: rank ``r`` holds query heads ``[r Hq/T, (r+1) Hq/T)`` and KV heads
``[r Hkv/T, (r+1) Hkv/T)``, so its KV cache holds its own heads only, under the same block ids
as every other rank. The embedding and the logits head are split over the vocabulary
(vocab-parallel): a token's embedding comes from the rank holding its row (the others add
zeros, one all-reduce), and each rank's logits for its vocabulary slice are gathered for
sampling.

As gpt-fast's ``tp.py`` does it, the model code is untouched: the model is built from a shard's
config (:func:`shard_config`), the all-reduces are forward hooks on its row-parallel
projections and the vocabulary-parallel layers replace its embedding and head (:func:`parallelize`),
and the loader reads each rank's slice of the checkpoint (:func:`shard_dim`).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from engine.core.block_pool import cdiv
from engine.parallel.distributed import TPGroup
from engine.loading.model_config import ModelConfig
from engine.models.llama import LlamaForCausalLM

# Parameter (module) name -> the checkpoint dimension its rank slices are cut along.
_SHARD_DIMS = {"qkv_proj": 0, "gate_up_proj": 0, "embed_tokens": 0, "lm_head": 0, "o_proj": 1, "down_proj": 1}
_VOCAB_PARALLEL = ("embed_tokens", "lm_head")


def shard_config(config: ModelConfig, world_size: int) -> ModelConfig:
    """The architecture one rank of ``world_size`` holds: ``1/world_size`` of the attention heads,
    the KV heads and the MLP's intermediate features (the vocabulary is split by
    :func:`parallelize`; ``vocab_size`` stays the model's).

    Raises:
        ValueError: ``world_size`` does not divide the head counts or the intermediate size
            (naming ``tensor_parallel_size``).
    """
    counts = {"num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
              "intermediate_size": config.intermediate_size}
    bad = [f"{name}={value}" for name, value in counts.items() if value % world_size]
    if bad:
        raise ValueError(f"tensor_parallel_size={world_size} must divide the model's {' and '.join(bad)}")
    return dataclasses.replace(config, head_dim=config.head_dim, eos_token_id=list(config.eos_token_id),
                               **{name: value // world_size for name, value in counts.items()})


def vocab_per_rank(vocab_size: int, world_size: int) -> int:
    """Rows of the embedding and the logits head each rank holds (the last rank's tail past
    ``vocab_size`` is zero padding)."""
    return cdiv(vocab_size, world_size)


def shard_dim(name: str) -> int | None:
    """The dimension along which our parameter ``name`` (``model.layers.0.self_attn.qkv_proj.weight``)
    is split over the ranks; ``None``: every rank holds all of it."""
    parts = name.split(".")
    return _SHARD_DIMS.get(parts[-2]) if len(parts) >= 2 else None


def checkpoint_rows(name: str, local: int, config: ModelConfig, world_size: int) -> int:
    """The checkpoint's size along :func:`shard_dim` of our parameter ``name``, of which one rank
    holds ``local`` rows: the model's vocabulary for the vocabulary-parallel ones, else ``local * world_size``."""
    return config.vocab_size if name.split(".")[-2] in _VOCAB_PARALLEL else local * world_size


class VocabParallelEmbedding(nn.Module):
    """The rank's slice ``[vocab_per_rank, hidden_size]`` of the embedding, all-reduced.

    ``forward`` takes ``[T]`` int64 token ids and returns ``[T, hidden_size]``: the rows this rank
    holds, zeros for the others, summed over the ranks.
    """

    def __init__(self, vocab_size: int, hidden_size: int, group: TPGroup) -> None:
        super().__init__()
        self.group = group
        self.num_rows = vocab_per_rank(vocab_size, group.world_size)
        self.first_row = group.rank * self.num_rows
        self.weight = nn.Parameter(torch.empty(self.num_rows, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.first_row
        outside = (local < 0) | (local >= self.num_rows)
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.group.all_reduce(hidden.masked_fill_(outside.unsqueeze(-1), 0))


class ParallelLMHead(nn.Module):
    """The rank's slice of the logits head, its logits gathered over the ranks.

    Args:
        vocab_size, hidden_size: the model's.
        tied: the embedding whose weight the head shares (a model with tied embeddings), or
            ``None`` for a weight of its own (``[vocab_per_rank, hidden_size]``). The embedding is
            held as a submodule: a parameter shared by two modules would be split in two when
            the model moves to its device.

    ``forward`` takes ``[n, hidden_size]`` and returns the ``[n, vocab_size]`` logits in the
    weight's dtype, the same on every rank.
    """

    def __init__(self, vocab_size: int, hidden_size: int, group: TPGroup,
                 tied: VocabParallelEmbedding | None = None) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.group = group
        self.tied = tied
        if tied is None:
            self.weight = nn.Parameter(torch.empty(vocab_per_rank(vocab_size, group.world_size), hidden_size))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.weight if self.tied is None else self.tied.weight
        return self.group.all_gather(F.linear(hidden, weight))[:, :self.vocab_size]


def parallelize(net: LlamaForCausalLM, group: TPGroup) -> None:
    """Make ``net``, built on the meta device from :func:`shard_config`, one rank's shard:
    vocabulary-parallel embedding and head (the head tied to the embedding when the model ties
    them), and an all-reduce after every row-parallel projection (``o_proj``, ``down_proj``).
    Load the weights afterwards."""
    config = net.config
    with torch.device("meta"):
        embedding = VocabParallelEmbedding(config.vocab_size, config.hidden_size, group)
        net.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, group,
                                     embedding if config.tie_word_embeddings else None)
    net.model.embed_tokens = embedding
    for layer in net.model.layers:
        for projection in (layer.self_attn.o_proj, layer.mlp.down_proj):
            projection.register_forward_hook(lambda _module, _args, output: group.all_reduce(output))
