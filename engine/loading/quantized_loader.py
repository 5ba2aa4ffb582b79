"""Fill a model from a GGUF file's weights, keeping its Q4_0/Q4_1/Q8_0 weights quantized
(``quantization="gguf"``, the CPU default for a quantized GGUF).

Every projection whose checkpoint tensors are group-quantized becomes an
:class:`engine.layers.quantized.Int4Linear` (a fused ``qkv_proj``/``gate_up_proj`` stacks its
parts' rows), a quantized embedding a :class:`QuantizedEmbedding`, a quantized logits head a
:class:`QuantizedLogitsHead` (with tied embeddings, over the embedding's quantized table). Tensors of other types (norms,
K-quants) are dequantized into the model's dense parameters.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.config import QUANTIZATIONS
from engine.loading.gguf_tensors import read_gguf
from engine.layers.linear import replace_module
from engine.layers.quantized import GroupQuantized, Int4Linear, QuantizedEmbedding, QuantizedLogitsHead
from engine.models.llama import FUSED_PARAMS, LlamaForCausalLM

logger = logging.getLogger(__name__)


def resolve_quantization(name: str, gguf: Path | None, device: torch.device, tensor_parallel_size: int = 1) -> str:
    """``"auto"`` -> ``"gguf"`` for a GGUF checkpoint (``gguf``, the file) in one CPU process,
    else ``"none"``.

    Raises:
        ValueError: naming ``quantization``, for an unknown name, or ``"gguf"`` without a GGUF
            checkpoint, off the CPU (the int4 kernel is PyTorch's CPU one) or sharded.
    """
    if name not in QUANTIZATIONS:
        raise ValueError(f"quantization={name!r} is not one of {QUANTIZATIONS}")
    runnable = gguf is not None and device.type == "cpu" and tensor_parallel_size == 1
    if name == "auto":
        return "gguf" if runnable else "none"
    if name == "gguf" and not runnable:
        raise ValueError(f"quantization='gguf' needs a .gguf model in one CPU process (model: {gguf or 'not GGUF'}, "
                         f"device: {device}, tensor_parallel_size: {tensor_parallel_size})")
    return name


@torch.no_grad()
def load_gguf_quantized(net: LlamaForCausalLM, path: Path, model: object,
                        table: dict[str, Any] | None = None) -> None:
    """Fill ``net`` (materialized, in its compute dtype) from GGUF file ``path`` (whose
    :func:`engine.loading.gguf_tensors.tensor_table` is ``table``, when known).

    Raises:
        ValueError: naming ``model``, for a tensor with no place in the model, a shape mismatch
            or a parameter left unloaded.
    """
    weights = read_gguf(path, table)
    dtype = net.model.norm.weight.dtype
    pending = dict(weights.tensors)
    counts = {"quantized": 0, "dense": 0}

    def take(name: str, shape: tuple[int, ...]) -> GroupQuantized | torch.Tensor:
        if name not in pending:
            raise ValueError(f"model={model!r}: GGUF checkpoint lacks {name!r}")
        tensor = pending.pop(name)
        if tuple(tensor.shape) != shape:
            raise ValueError(f"model={model!r}: {name!r} has shape {tuple(tensor.shape)}, expected {shape}")
        counts["quantized" if isinstance(tensor, GroupQuantized) else "dense"] += 1
        return tensor

    embed = net.model.embed_tokens
    embedding = take("model.embed_tokens.weight", tuple(embed.weight.shape))
    if isinstance(embedding, GroupQuantized):
        net.model.embed_tokens = QuantizedEmbedding(embedding, dtype)
        if net.lm_head is None:  # tied: the head computes with the embedding's quantized table
            net.lm_head = QuantizedLogitsHead(embedding)
    else:
        embed.weight.copy_(embedding)
    if isinstance(net.lm_head, nn.Linear) and isinstance(pending.get("lm_head.weight"), GroupQuantized):
        net.lm_head = QuantizedLogitsHead(take("lm_head.weight", (net.lm_head.out_features, net.lm_head.in_features)))
    for name, module in list(net.named_modules()):
        if isinstance(module, nn.Linear):
            replace_module(net, name, _load_linear(net, name, module, take, dtype))
    for name, param in net.named_parameters():
        if name in pending:
            param.copy_(take(name, tuple(param.shape)))
    if pending:
        raise ValueError(f"model={model!r}: GGUF tensors {sorted(pending)[:5]} have no place in the model")
    logger.info("%s: %d tensors kept quantized, %d dequantized", path.name, counts["quantized"], counts["dense"])


def _load_linear(net: LlamaForCausalLM, name: str, module: nn.Linear, take, dtype: torch.dtype) -> nn.Module:
    """The layer replacing ``module`` (named ``name``), built from its checkpoint tensors."""
    parent, _, proj = name.rpartition(".")
    parts = [(name, module.out_features)]
    if proj in FUSED_PARAMS:
        sizes = net.get_submodule(parent).shard_sizes()
        parts = [(f"{parent}.{hf}", rows) for hf, rows in zip(FUSED_PARAMS[proj], sizes)]
    weights = [take(f"{hf}.weight", (rows, module.in_features)) for hf, rows in parts]
    bias = None
    if module.bias is not None:
        bias = torch.cat([take(f"{hf}.bias", (rows,)) for hf, rows in parts])
    if all(isinstance(w, GroupQuantized) for w in weights):
        return _linear(GroupQuantized.cat(weights), bias, dtype)
    dense = [w.dequantize() if isinstance(w, GroupQuantized) else w for w in weights]
    return _linear(torch.cat(dense), bias, dtype)


def _linear(weight: GroupQuantized | torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> nn.Module:
    if isinstance(weight, GroupQuantized):
        return Int4Linear(weight, bias)
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=dtype)
    layer.weight.copy_(weight)
    if bias is not None:
        layer.bias.copy_(bias)
    return layer
