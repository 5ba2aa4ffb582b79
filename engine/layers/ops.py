"""Which implementation of Tandem's kernels runs on a device: the Triton kernels on CUDA; on the
CPU their PyTorch references (:mod:`kernels.reference`, the same signatures) with the C kernels of
:mod:`kernels.cpu_ops` in place of those it has, where a C compiler built them."""

from __future__ import annotations

import functools
from types import ModuleType, SimpleNamespace

import torch

import kernels
import kernels.reference
from engine.model_source import cache_root
from kernels.cpu_ops import CpuKernels, load


@functools.cache
def cpu_kernels() -> CpuKernels | None:
    """The C kernels, built once per machine under ``<cache root>/kernels``; ``None`` without a
    C compiler (the CPU then runs the references only). Their norm and SwiGLU stand in for the
    references in :func:`ops_for`; their decode attention is the CPU attention backend's."""
    return load(cache_root() / "kernels")


@functools.cache
def _cpu_ops() -> ModuleType | SimpleNamespace:
    built = cpu_kernels()
    if built is None:
        return kernels.reference
    return SimpleNamespace(**{name: getattr(kernels.reference, name) for name in kernels.reference.__all__}
                           | {"rms_norm": built.rms_norm, "silu_and_mul": built.silu_and_mul})


def ops_for(device: torch.device) -> ModuleType | SimpleNamespace:
    """``kernels`` (Triton, loaded on first use) on CUDA; elsewhere ``kernels.reference``'s
    functions, the C ones of :mod:`kernels.cpu_ops` among them where they were built."""
    return kernels if device.type == "cuda" else _cpu_ops()
