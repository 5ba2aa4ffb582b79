"""Which implementation of Tandem's kernels runs on a device: the Triton kernels on CUDA, their
PyTorch references (:mod:`kernels.reference`, the same signatures) everywhere else."""

from __future__ import annotations

from types import ModuleType

import torch

import kernels
import kernels.reference


def ops_for(device: torch.device) -> ModuleType:
    """``kernels`` (Triton, loaded on first use) on CUDA, ``kernels.reference`` elsewhere."""
    return kernels if device.type == "cuda" else kernels.reference
