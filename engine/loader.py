"""Build a model and fill its weights, from whatever :func:`engine.model_source.resolve_model`
finds (an HF directory, sharded or not; a GGUF file through its converted directory; a hub
repository; a preset or a config dict). ``load_format="dummy"`` gives random weights of the
real shapes (also for a directory or file).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from engine.attention import PagedAttentionBackend, get_attention_backend
from engine.config import DTYPE_NAMES
from engine.model_config import ModelConfig
from engine.model_source import merge_eos_token_ids, resolve_model
from engine.models.llama import FUSED_PARAMS, LlamaForCausalLM
from engine.tokenizer import Tokenizer

LOAD_FORMATS = ("auto", "dummy")
DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}  # names from engine.config, a fixed list


@dataclass
class LoadedModel:
    """A ready model.

    Attributes:
        model: in eval mode, on the requested device and dtype.
        config: its architecture; ``eos_token_id`` merges the config's, the generation
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
) -> LoadedModel:
    """Resolve ``model``, build :class:`LlamaForCausalLM` on ``device`` and load its weights.

    Args:
        model: see :func:`engine.model_source.resolve_model`.
        dtype: parameter dtype, or its name (``"float32"``, ``"bfloat16"``, ``"float16"``).
        device: where the parameters live.
        attn_backend: defaults to :func:`engine.attention.get_attention_backend` for ``device``.
        load_format: ``"auto"`` (read the checkpoint) or ``"dummy"`` (random normal weights,
            std 0.02, norms at 1).

    Raises:
        ValueError: unknown preset, missing path, unreachable hub repository or a checkpoint
            that does not fit the architecture (naming ``model``); bad ``dtype`` or
            ``load_format`` (naming them); unsupported architecture (from :class:`ModelConfig`).
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
        net = LlamaForCausalLM(config, attn_backend or get_attention_backend(device))
    net.to(dtype)
    net.materialize(device)
    if load_format == "dummy":
        _init_dummy(net)
    else:
        _load_safetensors(net, source.path, model)
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


@torch.no_grad()
def _init_dummy(net: LlamaForCausalLM) -> None:
    """Random weights that keep activations and logits finite in any dtype: N(0, 0.02), norms 1."""
    generator = torch.Generator(next(net.parameters()).device).manual_seed(0)
    for name, param in net.named_parameters():
        if "norm" in name:
            param.fill_(1.0)
        else:
            param.normal_(0.0, 0.02, generator=generator)


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / shard for shard in shards]
    return sorted(path.glob("*.safetensors"))


def _checkpoint_slots(net: LlamaForCausalLM) -> dict[str, tuple[torch.Tensor, int, int]]:
    """Map every HF checkpoint name to ``(our parameter, first row, rows)``: a fused
    ``qkv_proj``/``gate_up_proj`` parameter takes its HF projections as consecutive row blocks."""
    slots = {}
    for name, param in net.named_parameters():
        module, leaf = name.rsplit(".", 1)
        parent, _, proj = module.rpartition(".")
        if proj not in FUSED_PARAMS:
            slots[name] = (param, 0, param.shape[0])
            continue
        offset = 0
        for hf_proj, rows in zip(FUSED_PARAMS[proj], net.get_submodule(parent).shard_sizes()):
            slots[f"{parent}.{hf_proj}.{leaf}"] = (param, offset, rows)
            offset += rows
    return slots


@torch.no_grad()
def _load_safetensors(net: LlamaForCausalLM, path: Path, model: Any) -> None:
    """Copy every tensor of ``path``'s safetensors files into ``net``, fusing q/k/v and gate/up.

    Raises:
        ValueError: naming ``model``, for no weight files, a tensor with no place in ``net``,
            a shape mismatch or a parameter left unloaded.
    """
    files = _weight_files(path)
    if not files:
        raise ValueError(f"model={model!r}: no *.safetensors files in {path}")
    slots = _checkpoint_slots(net)
    tied = net.lm_head is None
    pending = set(slots)
    for file in tqdm(files, desc="Loading safetensors", unit="file", disable=len(files) < 2):
        with safe_open(file, framework="pt", device="cpu") as shard:
            for name in tqdm(shard.keys(), desc=file.name, unit="tensor", leave=False):
                if name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"):
                    continue  # recomputed / shared with the embedding
                if name not in slots:
                    raise ValueError(f"model={model!r}: checkpoint tensor {name!r} has no place in the model")
                param, offset, rows = slots[name]
                target, tensor = param.narrow(0, offset, rows), shard.get_tensor(name)
                if target.shape != tensor.shape:
                    raise ValueError(
                        f"model={model!r}: {name!r} has shape {tuple(tensor.shape)}, "
                        f"expected {tuple(target.shape)}"
                    )
                target.copy_(tensor)
                pending.discard(name)
    if pending:
        raise ValueError(f"model={model!r}: checkpoint lacks {sorted(pending)[:5]} ({len(pending)} in all)")
