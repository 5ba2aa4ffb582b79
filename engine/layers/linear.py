"""Linear layers in place of ``nn.Linear``: oneDNN-packed ones for float32 inference on x86
CPUs, and batch-invariant ones on CUDA (:class:`BatchInvariantLinear`).

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

import kernels  # (its Triton entry points load on first use: only CUDA engines build BatchInvariantLinear)


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


class BatchInvariantLinear(nn.Module):
    """``y = x @ W^T + b`` through :func:`kernels.matmul`: each row's result the same whatever
    else shares the step (a decode step and a verification of drafts round alike), where
    cuBLAS chooses its kernel by the row count.

    Args:
        weight: ``[out_features, in_features]`` float32, float16 or bfloat16, on CUDA.
        bias: ``[out_features]`` or ``None``.

    ``forward`` takes ``[num_tokens, in_features]`` and returns ``[num_tokens, out_features]``
    in the weight's dtype.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight.detach()
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.matmul(x if x.stride(-1) == 1 else x.contiguous(), self.weight, self.bias)


def replace_linears(model: nn.Module, layer: type[PackedLinear] | type[BatchInvariantLinear]) -> int:
    """Replace every ``nn.Linear`` in ``model`` by ``layer(weight, bias)`` over the same weights
    (keeping its forward hooks).

    Returns:
        How many layers were replaced.
    """
    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    for name, module in targets:
        replace_module(model, name, layer(module.weight, module.bias))
    return len(targets)
