"""Tandem's shared runtime: model, paged KV cache, prefix cache, scheduler, sampler, offline API.

The public names load lazily, so ``import engine.block_hash`` (the gateway's need) does not
pull in the model code.
"""

import importlib

_EXPORTS = {
    "LLM": "engine.llm",
    "EngineCore": "engine.core.engine_core",
    "EngineConfig": "engine.config",
    "SamplingParams": "engine.sampling_params",
    "RequestOutput": "engine.outputs",
    "CompletionOutput": "engine.outputs",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
