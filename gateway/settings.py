"""Gateway configuration: ``TANDEM_*`` environment variables, overridable by CLI flags.

Every field reads the environment variable ``TANDEM_<FIELD>`` (e.g. ``TANDEM_REDIS_URL``,
``TANDEM_MAX_TOKENS_CAP``); the listen address also reads ``TANDEM_GATEWAY_ADDR``. Values are
checked when built and a bad one raises ``pydantic.ValidationError`` naming the field.

The cluster keys (``redis_key_prefix``, ``block_size``, ``registry_ttl_s``) and the block-hash seed
(model id, block size, ``kv_dtype``) must equal the workers' or prefix-aware routing silently
finds nothing: the same ``TANDEM_*`` variables configure both sides.
"""

from __future__ import annotations

from pydantic import AliasChoices, Field, field_validator
from typing import Annotated

from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

KV_DTYPES = ("auto", "float32", "bfloat16", "float16")


class GatewaySettings(BaseSettings):
    """Everything the gateway process needs; see the module docstring for the environment."""

    model_config = SettingsConfigDict(env_prefix="TANDEM_", extra="ignore", populate_by_name=True)

    listen: str = Field("127.0.0.1:50051", validation_alias=AliasChoices("TANDEM_GATEWAY_ADDR"),
                        description="host:port the public gRPC API binds to")
    model: str | None = Field(None, description="model (as engine.loader.resolve_model); None: SmolLM2-135M-Instruct")
    max_model_len: int | None = Field(None, ge=2, description="None: the model's max_position_embeddings")
    kv_dtype: str = Field("auto", validation_alias=AliasChoices("TANDEM_KV_DTYPE", "TANDEM_DTYPE"),
                          description="the workers' KV cache dtype (block-hash seed); read from TANDEM_KV_DTYPE "
                                      "or else the workers' TANDEM_DTYPE; auto: as the workers decide it")
    device: str = Field("auto", description="the workers' TANDEM_DEVICE, only to resolve kv_dtype=auto")

    # Cluster state.
    redis_url: str | None = Field(None, description="None: no Redis, use static_prefill/static_decode")
    redis_key_prefix: str = "default"
    block_size: int = Field(16, ge=1)
    registry_ttl_s: float = Field(3.0, gt=0)
    refresh_interval_s: float = Field(0.5, gt=0, description="ClusterView.refresh period")
    static_prefill: Annotated[list[str], NoDecode] = Field(default_factory=list, description="prefill addresses when redis_url is None")
    static_decode: Annotated[list[str], NoDecode] = Field(default_factory=list, description="decode addresses when redis_url is None")

    # Input caps (INVALID_ARGUMENT beyond them).
    max_tokens_cap: int = Field(4096, ge=1, description="largest max_tokens; also the value of max_tokens=0 "
                                                        "when the context has more room")
    max_n: int = Field(8, ge=1)
    max_logprobs: int = Field(20, ge=0)
    max_stop: int = Field(16, ge=0, description="stop strings per request")
    max_stop_len: int = Field(256, ge=1, description="characters per stop string")
    max_stop_token_ids: int = Field(64, ge=0)
    max_request_bytes: int = Field(4 << 20, ge=1024, description="larger requests: INVALID_ARGUMENT "
                                                                 "(gRPC itself refuses > 2x with RESOURCE_EXHAUSTED)")

    # Behaviour.
    admit_wait_s: float = Field(5.0, ge=0, description="how long a request waits for decode capacity "
                                                       "before RESOURCE_EXHAUSTED")
    lease_ms: int = Field(0, ge=0, description="decode reservation lease; 0: the worker's default")
    drain_timeout_s: float = Field(30.0, ge=0, description="SIGTERM: in-flight requests get this long")
    metrics_port: int = Field(9400, ge=0, le=65535, description="Prometheus /metrics port; 0: off")
    log_level: str = "INFO"

    @field_validator("model", "redis_url", mode="before")
    @classmethod
    def _empty_is_none(cls, value: object) -> object:
        return None if value == "" else value  # the workers' convention: empty means default / none

    @field_validator("kv_dtype")
    @classmethod
    def _check_kv_dtype(cls, value: str) -> str:
        if value not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {value!r}")
        return value

    @field_validator("static_prefill", "static_decode", mode="before")
    @classmethod
    def _split_addresses(cls, value: object) -> object:
        if isinstance(value, str):  # from the environment: "host:port,host:port"
            return [a.strip() for a in value.split(",") if a.strip()]
        return value

    @field_validator("listen")
    @classmethod
    def _check_listen(cls, value: str) -> str:
        host, _, port = value.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"listen must be host:port, got {value!r}")
        return value

    def resolved_kv_dtype(self) -> str:
        """The KV dtype name the workers use: ``auto`` follows the engine's rule (CUDA: bfloat16)."""
        if self.kv_dtype != "auto":
            return self.kv_dtype
        if self.device.startswith("cpu"):
            return "float32"
        if self.device.startswith("cuda"):
            return "bfloat16"
        import torch

        return "bfloat16" if torch.cuda.is_available() else "float32"
