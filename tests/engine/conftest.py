"""Fixtures of the engine tests: the real model through Hugging Face, as the oracle."""

import pytest

from tests.helpers.models import load_hf_smollm2


@pytest.fixture(scope="session")
def hf_model():
    """(model, tokenizer) of SmolLM2-135M-Instruct loaded by transformers from the GGUF, fp32."""
    return load_hf_smollm2()
