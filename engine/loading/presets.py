"""Named architectures without weights, for ``load_format="dummy"`` (benchmarks, memory sizing).

Each preset is the ``config.json`` of the real model, so a dummy model has the real shapes,
FLOPs and KV-cache footprint.
"""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    # meta-llama/Meta-Llama-3-8B-Instruct: 8.0 B parameters, GQA 32/8, 128K vocabulary.
    "llama-3-8b": {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128009],
    },
    # HuggingFaceTB/SmolLM2-135M-Instruct: 135 M parameters, GQA 9/3, tied embeddings.
    "smollm2-135m": {
        "model_type": "llama",
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": [2],
    },
}
