"""Tandem's kernels (paged attention, fused layer ops, sampling): Triton entry points; pure-PyTorch
references with the same signatures in :mod:`kernels.reference`.

The Triton modules load on first use of an entry point (module ``__getattr__``, which then
binds it here: the layers call the entry points through this package on every launch), so
``import kernels.reference`` works where Triton, an optional dependency, is not installed.
"""

from __future__ import annotations

import importlib

_ENTRY_POINTS = {
    "paged_decode_attention": "kernels.decode_attention",
    "paged_prefill_attention": "kernels.prefill_attention",
    "write_kv_cache": "kernels.cache_write",
    "rms_norm": "kernels.norm",
    "rotary_embedding": "kernels.rotary",
    "rotary_write_kv_cache": "kernels.rotary",
    "silu_and_mul": "kernels.activation",
    "sample_tokens": "kernels.sampling",
    "kv_digests": "kernels.kv_digest",
    "matmul": "kernels.matmul",
    # an engine step's launches, prepared once for all its layers
    "PagedDecodeLaunch": "kernels.decode_attention",
    "PagedPrefillLaunch": "kernels.prefill_attention",
    "RotaryWriteKVLaunch": "kernels.rotary",
}

__all__ = list(_ENTRY_POINTS)


def __getattr__(name: str):
    module = _ENTRY_POINTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kernels' has no attribute {name!r}")
    entry = globals()[name] = getattr(importlib.import_module(module), name)  # later calls skip this lookup
    return entry


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
