"""oneDNN-packed linear layers for float32 inference on x86 CPUs.

Why not plain ``nn.Linear`` there: PyTorch's float32 ``linear`` goes to MKL's sgemm, which on
the AMD EPYC hosts Tandem's CPU path runs on is about 2-3x slower than oneDNN's kernels over
a weight reordered once into oneDNN's blocked layout, for the skinny matrices of a decode step
(measured on a 2-core EPYC: SmolLM2-135M's 30 layers of projections at 16 tokens, 46 ms with
MKL against 15 ms packed). The kernels are PyTorch's own (``torch.ops.mkldnn``, the ones
``torch.compile`` uses for frozen CPU linears); only the dispatch is ours.
"""

from __future__ import annotations

import torch
from torch import nn


def packed_linear_available(device: torch.device, dtype: torch.dtype) -> bool:
    """True where :class:`PackedLinear` applies: float32 on an x86 CPU with oneDNN built in."""
    return (
        device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise") and torch.backends.cpu.get_cpu_capability() != "DEFAULT"
    )


class PackedLinear(nn.Module):
    """``y = x @ W^T + b`` with ``W`` held in oneDNN's blocked layout.

    Args:
        weight: ``[out_features, in_features]`` float32.
        bias: ``[out_features]`` or ``None``.
        batch_hint: typical rows of ``x`` (tokens per step), to pick the packing.

    ``forward`` takes ``[num_tokens, in_features]`` and returns ``[num_tokens, out_features]``.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, batch_hint: int = 16) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def replace_module(model: nn.Module, name: str, module: nn.Module) -> None:
    """Put ``module`` at ``name`` (``model.layers.0.mlp.down_proj``) in ``model``, keeping the
    forward hooks of the module it replaces (tensor parallelism's all-reduce after a row-parallel
    projection, :func:`engine.parallel.tensor_parallel.parallelize`)."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    module._forward_hooks.update(getattr(parent, child)._forward_hooks)
    setattr(parent, child, module)


def pack_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` in ``model`` by a :class:`PackedLinear` with the same weights
    (and forward hooks).

    Returns:
        How many layers were packed.
    """
    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    for name, module in targets:
        replace_module(model, name, PackedLinear(module.weight, module.bias))
    return len(targets)
