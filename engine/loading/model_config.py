"""Architecture description of a Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass
class ModelConfig:
    """The shapes and options of one Llama-family model, in the field names of HF ``config.json``.

    ``attention_bias`` adds biases to the q/k/v projections (Qwen2); ``qk_norm`` applies an
    RMSNorm over ``head_dim`` to q and k before RoPE (Qwen3). ``rope_scaling`` is ``None`` or an
    HF rope-scaling dict (``{"rope_type": "llama3", "factor": 8.0, ...}``, ``"linear"``,
    ``"dynamic"`` is rejected). Sliding-window attention (Mistral v0.1) is not supported.

    Raises:
        ValueError: a field is out of range, naming the field.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type={self.model_type!r} is not one of {SUPPORTED_MODEL_TYPES}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if isinstance(self.eos_token_id, int):
            self.eos_token_id = [self.eos_token_id]
        self.eos_token_id = list(self.eos_token_id or [])

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Build from an HF ``config.json`` dict (transformers 4.x ``rope_theta``/``rope_scaling``
        or 5.x ``rope_parameters``).

        Raises:
            ValueError: unsupported ``model_type`` or sliding-window attention in use.
        """
        cfg = dict(cfg)
        rope = cfg.pop("rope_parameters", None) or {}
        scaling = cfg.get("rope_scaling") or None
        if rope:
            cfg.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
            if rope.get("rope_type", "default") != "default":
                scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        if scaling and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
            scaling = None
        if cfg.get("use_sliding_window") or (
            cfg.get("model_type") == "mistral" and cfg.get("sliding_window")
            and cfg["sliding_window"] < cfg.get("max_position_embeddings", 0)
        ):
            raise ValueError("sliding_window attention is not supported")
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in cfg.items() if k in names}
        kwargs["rope_scaling"] = scaling
        kwargs["qk_norm"] = cfg.get("model_type") == "qwen3"
        if cfg.get("model_type") == "qwen2":
            kwargs["attention_bias"] = True
        return cls(**kwargs)

    @property
    def num_queries_per_kv(self) -> int:
        """Query heads sharing one KV head (1 = MHA, > 1 = GQA/MQA)."""
        return self.num_attention_heads // self.num_key_value_heads
