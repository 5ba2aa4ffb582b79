"""Fixtures of the worker tests: the engines the in-process workers (``tests/helpers/workers.py``) run."""

import pytest

from engine import EngineConfig, EngineCore


@pytest.fixture(scope="session")
def engines() -> tuple[EngineCore, EngineCore]:
    """(prefill, decode) engines on the real SmolLM2-135M-Instruct. The prefill engine's small
    token budget makes a long prompt take many steps (so a test can abort it mid-prefill)."""
    prefill = EngineCore(None, EngineConfig(num_blocks=96, block_size=16, max_num_batched_tokens=128))
    decode = EngineCore(None, EngineConfig(num_blocks=64, block_size=16))
    return prefill, decode
