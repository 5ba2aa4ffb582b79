"""A GGUF checkpoint's config and tokenizer, converted once into a cached HF directory.

transformers reads a GGUF file's metadata into an HF config and its vocabulary into a fast
tokenizer with the chat template (~6 s); we pay that once per file and keep the result as an
HF directory without weights (``config.json``, ``generation_config.json``, tokenizer files,
and the file's tensor table, :data:`TENSOR_TABLE`). The weights are read from the GGUF file
itself at every load (:mod:`engine.loading.gguf_tensors`), kept quantized or dequantized: no float32
copy is written.
:func:`engine.model_source.gguf_hf_dir` runs this module as a child process
(``python -m engine.loading.gguf PATH``) when the cache misses.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

from filelock import FileLock, Timeout

from engine.loading.gguf_tensors import tensor_table
from engine.model_source import TENSOR_TABLE, gguf_cache_dir

logger = logging.getLogger(__name__)


def convert(path: Path) -> Path:
    """Return the cached HF directory converted from GGUF file ``path``, converting it if needed.

    Converted once per machine: the processes that miss the cache at once (``make run`` starts
    three) take a file lock beside the target (``filelock``), one converts and the others wait
    and reuse its result. The conversion writes into a temporary directory renamed into place
    (the first rename wins, should a filesystem ignore the lock), so a directory under the
    final name is always complete.
    """
    target = gguf_cache_dir(path)
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(target.parent / f"{target.name}.lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        logger.info("waiting for another process converting %s", path)
        lock.acquire()
    try:
        if not (target / "config.json").is_file():  # else converted while we waited
            _convert_into(path, target)
    finally:
        lock.release()
    return target


def _convert_into(path: Path, target: Path) -> None:
    """Convert ``path`` into a temporary directory beside ``target`` and rename it to ``target``."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        logger.info("converting %s to an HF directory at %s (once)", path, target)
        _write_hf_dir(path, tmp)
        for file in (tmp, *tmp.iterdir()):  # mkdtemp makes the directory private to its creator
            file.chmod(0o755 if file.is_dir() else 0o644)
        os.rename(tmp, target)
    except OSError:
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_hf_dir(path: Path, out: Path) -> None:
    """Save ``path``'s HF config, generation config and tokenizer (read by transformers) into ``out``."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    hf_config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    config = hf_config.to_diff_dict()
    config.pop("quantization_config", None)  # how the weights are held is the loader's business
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / TENSOR_TABLE).write_text(json.dumps(tensor_table(path)))
    GenerationConfig.from_model_config(hf_config).save_pretrained(out)
    tokenizer.save_pretrained(out)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    print(convert(Path(sys.argv[1]).resolve()))
