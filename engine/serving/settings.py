"""Worker settings: environment (``TANDEM_*``) and command-line flags, validated when built.

Every field ``foo_bar`` is read from ``TANDEM_FOO_BAR`` and can be overridden by the flag
``--foo-bar`` (see :func:`add_flags` / :func:`from_args`); flags win over the environment.
"""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Sequence

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from engine.config import SUPPORTED_BLOCK_SIZES, EngineConfig


class WorkerSettings(BaseSettings):
    """Settings of one prefill or decode worker process.

    Attributes:
        listen: gRPC listen address ``host:port`` (port 0: any free port).
        advertise: address other processes use to reach this worker (registered in Redis and
            used as the KV destination); empty: the listen address, with a wildcard host
            replaced by this host's IP.
        redis_url: Redis of the cluster state (``redis://host:6379/0``); empty: no registration.
        redis_key_prefix: deployment name in Redis keys (``tandem:{prefix}:...``).
        registry_ttl_s: seconds the worker's Redis entries outlive its last heartbeat.
        heartbeat_interval_s: seconds between heartbeats (< ``registry_ttl_s``).
        worker_id: id in the registry; empty: ``{role}-{hostname}-{pid}``.
        model: model path / hub id / preset; empty: the default SmolLM2-135M-Instruct.
        load_format: ``auto`` or ``dummy`` (random weights, no tokenizer).
        block_size: tokens per KV block (must match across the cluster).
        num_blocks: KV blocks in the pool; unset: sized from ``kv_cache_memory_bytes`` (CPU) or
            ``gpu_memory_utilization`` (CUDA).
        kv_cache_memory_bytes: KV cache bytes on CPU.
        gpu_memory_utilization: fraction of the GPU's memory to use.
        max_num_seqs, max_num_batched_tokens, max_model_len: scheduler limits (EngineConfig).
        device, dtype: ``auto`` or explicit (EngineConfig).
        seed: the engine's shared random seed.
        lease_s: default lease of a decode reservation and of a prefill worker's pinned blocks.
        drain_timeout_s: on SIGTERM, seconds to let in-flight requests finish before aborting them.
        metrics_port: Prometheus HTTP port; 0: no metrics endpoint.
        log_level: ``DEBUG``/``INFO``/``WARNING``/``ERROR``.
    """

    model_config = SettingsConfigDict(env_prefix="TANDEM_", extra="ignore", protected_namespaces=())

    listen: str = "127.0.0.1:0"
    advertise: str = ""
    redis_url: str = ""
    redis_key_prefix: str = "default"
    registry_ttl_s: float = Field(3.0, gt=0)
    heartbeat_interval_s: float = Field(1.0, gt=0)
    worker_id: str = ""
    model: str = ""
    load_format: str = "auto"
    block_size: int = 16
    num_blocks: int | None = Field(None, ge=1)
    kv_cache_memory_bytes: int = Field(1 << 30, ge=1)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    max_num_seqs: int = Field(256, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    max_model_len: int | None = Field(None, ge=1)
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 0
    lease_s: float = Field(30.0, gt=0)
    drain_timeout_s: float = Field(30.0, ge=0)
    metrics_port: int = Field(0, ge=0, le=65535)
    log_level: str = "INFO"

    @field_validator("listen")
    @classmethod
    def _check_listen(cls, value: str) -> str:
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"listen must be host:port, got {value!r}")
        return value

    @field_validator("block_size")
    @classmethod
    def _check_block_size(cls, value: int) -> int:
        if value not in SUPPORTED_BLOCK_SIZES:
            raise ValueError(f"block_size must be one of {SUPPORTED_BLOCK_SIZES}, got {value}")
        return value

    @field_validator("load_format")
    @classmethod
    def _check_load_format(cls, value: str) -> str:
        if value not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto or dummy, got {value!r}")
        return value

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            block_size=self.block_size, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens, max_model_len=self.max_model_len,
            num_blocks=self.num_blocks, kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            gpu_memory_utilization=self.gpu_memory_utilization, dtype=self.dtype, device=self.device,
            seed=self.seed,
        )

    def resolved_worker_id(self, role: str) -> str:
        return self.worker_id or f"{role}-{socket.gethostname()}-{os.getpid()}"


def advertised_address(listen_host: str, port: int, advertise: str = "") -> str:
    """The address peers dial: ``advertise`` if set, else the listen host (a wildcard host is
    replaced by this host's IP, e.g. a container's address on its network) and the bound port."""
    if advertise:
        return advertise
    host = listen_host.strip("[]")
    if host in ("0.0.0.0", "::", ""):
        try:
            host = socket.gethostbyname(socket.gethostname())
        except OSError:
            host = socket.gethostname()
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One ``--foo-bar`` flag per settings field (values are validated by the settings)."""
    for name, field in WorkerSettings.model_fields.items():
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, default=None, metavar="VALUE",
                            help=f"(env TANDEM_{name.upper()}, default {field.default!r})")


def from_args(argv: Sequence[str] | None, prog: str, description: str) -> WorkerSettings:
    """Parse flags into settings (flags override ``TANDEM_*`` environment variables).

    Raises:
        SystemExit: bad flags or a bad value (argparse's exit code 2, naming the field).
    """
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_flags(parser)
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if v is not None}
    try:
        return WorkerSettings(**overrides)
    except ValueError as exc:  # pydantic.ValidationError names the field
        parser.error(str(exc))
        raise  # unreachable
