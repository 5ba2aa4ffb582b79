"""Build a model and fill its weights, from whatever :func:`engine.model_source.resolve_model`
finds (an HF directory, sharded or not; a GGUF file, read directly, quantized weights kept so
or dequantized; a hub repository; a preset or a config dict). ``load_format="dummy"`` gives
random weights of the real shapes (also for a directory or file).

Under tensor parallelism each rank builds its shard (:mod:`engine.parallel.tensor_parallel`) and reads
only its slice of each checkpoint tensor (safetensors' sliced reads). Random weights are drawn
per checkpoint tensor, whole, from a seed of its name, and then sliced the same way: a dummy
model computes the same function at every tensor-parallel size.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from engine.runner.attention import PagedAttentionBackend, get_attention_backend
from engine.runner.devices import DTYPES
from engine.parallel.distributed import TPGroup
from engine.loading.model_config import ModelConfig
from engine.model_source import ModelSource, merge_eos_token_ids, resolve_model
from engine.models.llama import FUSED_PARAMS, LlamaForCausalLM
from engine.loading.gguf_tensors import read_gguf
from engine.layers.quantized import GroupQuantized
from engine.loading.quantized_loader import load_gguf_quantized
from engine.parallel.tensor_parallel import checkpoint_rows, parallelize, shard_config, shard_dim
from engine.tokenizer import Tokenizer

LOAD_FORMATS = ("auto", "dummy")


@dataclass
class LoadedModel:
    """A ready model.

    Attributes:
        model: in eval mode, on the requested device and dtype (one rank's shard under tensor
            parallelism: ``model.config`` is the shard's architecture).
        config: the model's architecture; ``eos_token_id`` merges the config's, the generation
            config's and the tokenizer's end-of-sequence ids.
        model_id: stable name of the weights (block-hash seed, Redis namespace).
        tokenizer: the model's :class:`engine.tokenizer.Tokenizer`; ``None`` when the source
            has no tokenizer files (presets, config dicts).
        path: the HF directory the model was read from (``None`` for presets and dicts).
    """

    model: LlamaForCausalLM
    config: ModelConfig
    model_id: str
    tokenizer: Tokenizer | None
    path: Path | None


def load_model(
    model: str | dict[str, Any] | None = None,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
    attn_backend: PagedAttentionBackend | None = None,
    load_format: str = "auto",
    tp: TPGroup | None = None,
    quantization: str = "none",
) -> LoadedModel:
    """Resolve ``model``, build :class:`LlamaForCausalLM` on ``device`` and load its weights.

    Args:
        model: see :func:`engine.model_source.resolve_model`.
        dtype: parameter dtype, or its name (``"float32"``, ``"bfloat16"``, ``"float16"``).
        device: where the parameters live.
        attn_backend: defaults to :func:`engine.runner.attention.get_attention_backend` for ``device``.
        load_format: ``"auto"`` (read the checkpoint) or ``"dummy"`` (random normal weights,
            std 0.02, norms at 1).
        tp: this process's rank of a tensor-parallel engine (``None``: the whole model).
        quantization: ``"gguf"`` keeps a GGUF model's quantized weights quantized
            (:mod:`engine.loading.quantized_loader`); ``"none"`` reads the dequantized checkpoint.

    Raises:
        ValueError: unknown preset, missing path, unreachable hub repository or a checkpoint
            that does not fit the architecture (naming ``model``); bad ``dtype`` or
            ``load_format`` (naming them); unsupported architecture (from :class:`ModelConfig`);
            a tensor-parallel size that does not divide the heads (naming it).
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r} is not one of {LOAD_FORMATS}")
    dtype = _parse_dtype(dtype)
    device = torch.device(device)
    source = resolve_model(model)
    if source.path is None and load_format != "dummy":
        raise ValueError(f"model={model!r} has no weights; pass load_format='dummy' for random ones")
    config = ModelConfig.from_hf_dict(source.hf_config)
    with torch.device("meta"):  # no init cost: every parameter is overwritten below
        net = LlamaForCausalLM(shard_config(config, tp.world_size) if tp else config,
                               attn_backend or get_attention_backend(device))
    if tp is not None:
        parallelize(net, tp)
    net.to(dtype)
    net.materialize(device)
    if quantization == "gguf" and load_format != "dummy":
        load_gguf_quantized(net, source.gguf, model, source.gguf_tensor_table())
    else:
        slots = _checkpoint_slots(net, config, tp)
        tensors = (_random_tensors(slots, device) if load_format == "dummy"
                   else _gguf_tensors(source) if source.gguf is not None else _safetensors(source.path, model))
        _fill(slots, tensors, config.tie_word_embeddings, tp.rank if tp else 0, model)
    net.eval()
    tokenizer = source.tokenizer()
    config.eos_token_id = merge_eos_token_ids(config.eos_token_id, source.path, tokenizer)
    return LoadedModel(net, config, source.model_id, tokenizer, source.path)


def _parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype={dtype!r} is not one of {list(DTYPES)}")


@dataclass
class _Slot:
    """Where one checkpoint tensor goes.

    Attributes:
        target: the rows of our parameter it fills (a fused ``qkv_proj``/``gate_up_proj`` takes
            its HF projections as consecutive row blocks), this rank's slice only.
        shape: the checkpoint tensor's whole shape.
        dim: the dimension this rank's slice is cut along (``None``: it holds all of it).
    """

    target: torch.Tensor
    shape: tuple[int, ...]
    dim: int | None


def _checkpoint_slots(net: LlamaForCausalLM, config: ModelConfig, tp: TPGroup | None) -> dict[str, _Slot]:
    """Map every HF checkpoint name to its :class:`_Slot` in ``net`` (built for ``config``, one
    rank's shard of it under ``tp``)."""
    slots = {}
    for name, param in net.named_parameters():
        module, leaf = name.rsplit(".", 1)
        parent, _, proj = module.rpartition(".")
        parts = [(name, param)]
        if proj in FUSED_PARAMS:
            offsets = list(itertools.accumulate(net.get_submodule(parent).shard_sizes(), initial=0))
            parts = [(f"{parent}.{hf_proj}.{leaf}", param[start:end])
                     for hf_proj, start, end in zip(FUSED_PARAMS[proj], offsets, offsets[1:])]
        dim = shard_dim(name) if tp is not None else None
        for hf_name, target in parts:
            shape = list(target.shape)
            if dim is not None:
                shape[dim] = checkpoint_rows(name, shape[dim], config, tp.world_size)
            slots[hf_name] = _Slot(target, tuple(shape), dim)
    return slots


class _RandomTensor:
    """A checkpoint tensor of random weights, drawn on ``device`` from a seed of its name:
    N(0, 0.02), or ones for a norm's weight. Read like a safetensors slice."""

    def __init__(self, name: str, shape: tuple[int, ...], device: torch.device) -> None:
        self.name, self.shape, self.device = name, shape, device

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        if "norm" in self.name:
            return torch.ones(self.shape, device=self.device)[index]
        seed = int.from_bytes(hashlib.blake2b(self.name.encode(), digest_size=8).digest(), "little") >> 1
        generator = torch.Generator(self.device).manual_seed(seed)
        return torch.randn(self.shape, generator=generator, device=self.device).mul_(0.02)[index]


def _random_tensors(slots: dict[str, _Slot], device: torch.device) -> Iterator[tuple[str, _RandomTensor]]:
    for name, slot in slots.items():
        yield name, _RandomTensor(name, slot.shape, device)


class _DenseTensor:
    """A checkpoint tensor in memory, read like a safetensors slice."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        return self.tensor[index]


def _gguf_tensors(source: ModelSource) -> Iterator[tuple[str, _DenseTensor]]:
    """Every tensor of ``source``'s GGUF file under its HF name, dequantized to float32 (one at a time)."""
    for name, tensor in read_gguf(source.gguf, source.gguf_tensor_table()).tensors.items():
        yield name, _DenseTensor(tensor.dequantize() if isinstance(tensor, GroupQuantized) else tensor)


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / shard for shard in shards]
    return sorted(path.glob("*.safetensors"))


def _safetensors(path: Path, model: Any) -> Iterator[tuple[str, Any]]:
    """Every tensor of ``path``'s safetensors files, as ``(name, slice)`` (read lazily, in part).

    Raises:
        ValueError: no weight files (naming ``model``).
    """
    files = _weight_files(path)
    if not files:
        raise ValueError(f"model={model!r}: no *.safetensors files in {path}")
    for file in tqdm(files, desc="Loading safetensors", unit="file", disable=len(files) < 2):
        with safe_open(file, framework="pt", device="cpu") as shard:
            for name in tqdm(shard.keys(), desc=file.name, unit="tensor", leave=False):
                yield name, shard.get_slice(name)


@torch.no_grad()
def _fill(slots: dict[str, _Slot], tensors: Iterator[tuple[str, Any]], tied: bool, rank: int, model: Any) -> None:
    """Copy this rank's slice of every checkpoint tensor into its slot.

    Raises:
        ValueError: naming ``model``, for a tensor with no place in the model, a shape mismatch
            or a parameter left unloaded.
    """
    pending = set(slots)
    for name, tensor in tensors:
        if name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"):
            continue  # recomputed / shared with the embedding
        if name not in slots:
            raise ValueError(f"model={model!r}: checkpoint tensor {name!r} has no place in the model")
        slot = slots[name]
        if tuple(tensor.get_shape()) != slot.shape:
            raise ValueError(f"model={model!r}: {name!r} has shape {tuple(tensor.get_shape())}, expected {slot.shape}")
        index = [slice(None)] * len(slot.shape)
        rows = slot.target.shape[slot.dim] if slot.dim is not None else 0
        if slot.dim is not None:  # this rank's rows; past the checkpoint's end (vocabulary padding): zeros
            start = rank * rows
            index[slot.dim] = slice(start, max(start, min(start + rows, slot.shape[slot.dim])))
        part = tensor[tuple(index)]
        if slot.dim is None:
            slot.target.copy_(part)
        else:
            got = part.shape[slot.dim]
            slot.target.narrow(slot.dim, 0, got).copy_(part)
            slot.target.narrow(slot.dim, got, rows - got).zero_()
        pending.discard(name)
    if pending:
        raise ValueError(f"model={model!r}: checkpoint lacks {sorted(pending)[:5]} ({len(pending)} in all)")
