"""A GGUF file's weights read in place (``gguf.GGUFReader`` memory-maps it), under their HF names,
the quantized ones kept quantized.

Q4_0, Q4_1 and Q8_0 blocks (32 weights each, llama.cpp's ``ggml-common.h``) become a
:class:`engine.layers.quantized.GroupQuantized` without loss:

- Q4_0: fp16 ``d``, 16 bytes of nibbles; ``w = d * (q - 8)``;
- Q4_1: fp16 ``d`` and ``m``, 16 bytes of nibbles; ``w = d * q + m``;
- Q8_0: fp16 ``d``, 32 int8; ``w = d * q``;

the nibbles of a block holding weights ``j`` (low) and ``j + 16`` (high) in byte ``j``. Other
types (float, K-quants, i-quants) are dequantized to float32 with ``gguf.quants.dequantize``.

llama.cpp's converter permutes the rows of a Llama's q and k projections (its RoPE pairs
adjacent dimensions, HF's pairs halves); :func:`read_gguf` puts them back in HF's order, as
transformers' GGUF loader does.

``GGUFReader`` parses every metadata value, the tokenizer's vocabulary and merges included (3 s
of the 4.5 s a SmolLM2 load takes on 2 cores, in each worker): :func:`tensor_table` keeps what
a load needs (the architecture, head counts and each tensor's place in the file), written once
beside the converted config (:mod:`engine.loading.gguf`), and :func:`read_gguf` maps the tensors from
it without parsing the metadata again.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from engine.layers.quantized import GroupQuantized

GROUP_SIZE = 32
# GGUF name -> HF name, for the whole model and (after ``blk.N.``) per layer.
_MODEL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
# Architectures whose converter permutes q/k rows (llama.cpp's ``LlamaModel.permute``).
_PERMUTED_QK = {"llama"}
ARCHITECTURES = ("llama", "qwen2", "qwen3")


@dataclass
class GGUFWeights:
    """The weights of a GGUF file.

    Attributes:
        architecture: ``general.architecture`` (``"llama"``, ...).
        tensors: HF name -> :class:`GroupQuantized` (Q4_0, Q4_1, Q8_0) or float32 tensor.
        types: HF name -> the GGUF tensor type's name (``"Q4_1"``, ``"F32"``, ...).
    """

    architecture: str
    tensors: dict[str, GroupQuantized | torch.Tensor]
    types: dict[str, str]


def tensor_table(path: Path) -> dict[str, Any]:
    """What :func:`read_gguf` needs of GGUF file ``path``, as JSON-ready values: ``architecture``,
    ``heads`` (query and KV head counts) and ``tensors``, each ``{"name", "type", "offset",
    "shape", "dtype"}`` (its data's byte offset in the file, and shape and numpy dtype as
    ``GGUFReader`` gives them: ``[rows, row bytes]`` uint8 for block types)."""
    reader = GGUFReader(path)
    arch = _field(reader, "general.architecture")
    return {
        "architecture": arch,
        "heads": {"attn_q": _field(reader, f"{arch}.attention.head_count"),
                  "attn_k": _field(reader, f"{arch}.attention.head_count_kv")},
        "tensors": [{"name": t.name, "type": t.tensor_type.name, "offset": int(t.data_offset),
                     "shape": list(t.data.shape), "dtype": t.data.dtype.str} for t in reader.tensors],
    }


def read_gguf(path: Path, table: dict[str, Any] | None = None) -> GGUFWeights:
    """Read every tensor of GGUF file ``path`` under its HF name.

    Args:
        path: the file.
        table: its :func:`tensor_table` (default: read from the file, 3 s for SmolLM2).

    Raises:
        ValueError: an architecture other than :data:`ARCHITECTURES`, or a tensor name this
            module does not know (naming it).
    """
    table = table or tensor_table(path)
    arch, heads = table["architecture"], table["heads"]
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not one of {ARCHITECTURES}")
    data = np.memmap(path, mode="r")
    tensors, types = {}, {}
    for tensor in table["tensors"]:
        stem, _, leaf = tensor["name"].rpartition(".")
        prefix, _, kind = stem.rpartition(".")
        if prefix.startswith("blk.") and kind in _LAYER_NAMES:
            name = f"model.layers.{prefix.removeprefix('blk.')}.{_LAYER_NAMES[kind]}.{leaf}"
        elif not prefix and kind in _MODEL_NAMES:
            name = f"{_MODEL_NAMES[kind]}.{leaf}"
        else:
            raise ValueError(f"{path}: GGUF tensor {tensor['name']!r} has no place in a {arch} model")
        dtype, shape = np.dtype(tensor["dtype"]), tensor["shape"]
        size = int(np.prod(shape)) * dtype.itemsize
        values = data[tensor["offset"]:tensor["offset"] + size].view(dtype).reshape(shape)
        weight = decode(values, GGMLQuantizationType[tensor["type"]])
        if arch in _PERMUTED_QK and kind in heads and leaf == "weight":
            weight = _rows(weight, _unpermute_rows(weight.shape[0], heads[kind]))
        tensors[name], types[name] = weight, tensor["type"]
    return GGUFWeights(arch, tensors, types)


def decode(data: np.ndarray, qtype: GGMLQuantizationType) -> GroupQuantized | torch.Tensor:
    """One tensor's data (as ``GGUFReader`` gives it: ``[rows, row bytes]`` uint8 for block
    types, the values for float types) -> :class:`GroupQuantized` for Q4_0/Q4_1/Q8_0, else a
    float32 tensor ``[rows, cols]`` (or ``[size]`` for a vector)."""
    if qtype not in (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0):
        return torch.from_numpy(np.array(dequantize(data, qtype), dtype=np.float32))  # a copy: the map is read-only
    rows = data.shape[0]
    header = 4 if qtype == GGMLQuantizationType.Q4_1 else 2
    blocks = data.reshape(rows, -1, header + (GROUP_SIZE if qtype == GGMLQuantizationType.Q8_0 else GROUP_SIZE // 2))
    fp16 = lambda at: torch.from_numpy(np.ascontiguousarray(blocks[..., at:at + 2]).view(np.float16)[..., 0]).float()  # noqa: E731
    scale = fp16(0)
    payload = np.ascontiguousarray(blocks[..., header:])
    if qtype == GGMLQuantizationType.Q8_0:
        codes = torch.from_numpy(payload.view(np.int8)).reshape(rows, -1)
        return GroupQuantized(codes, scale, torch.zeros_like(scale), 8, GROUP_SIZE)
    codes = torch.from_numpy(np.concatenate([payload & 15, payload >> 4], axis=-1)).reshape(rows, -1)
    offset = fp16(2) if qtype == GGMLQuantizationType.Q4_1 else -8 * scale
    return GroupQuantized(codes, scale, offset, 4, GROUP_SIZE)


def _field(reader: GGUFReader, key: str):
    """A scalar or string metadata value of ``reader``."""
    field = reader.fields[key]
    value = field.parts[field.data[0]]
    return bytes(value).decode() if field.types[0].name == "STRING" else value.item()


def _unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's q/k permutation of a ``[rows, ...]`` weight of
    ``heads`` heads: within a head, GGUF row ``2 i + j`` is HF row ``i + j * head_dim / 2``."""
    half = rows // heads // 2
    return torch.arange(rows).view(heads, half, 2).transpose(1, 2).reshape(rows)


def _rows(weight: GroupQuantized | torch.Tensor, index: torch.Tensor) -> GroupQuantized | torch.Tensor:
    return weight.rows(index) if isinstance(weight, GroupQuantized) else weight[index]
