"""Settings of Tandem's servers: one base the gateway and the workers share, flags generated
from it the same way for every server.

Every field ``foo_bar`` is read from the environment variable ``TANDEM_FOO_BAR`` and can be
overridden by the flag ``--foo-bar`` (:func:`from_args`); flags win. Values are checked when
the settings are built; a bad one is refused naming its field. Each setting has one owner:
what the workers decide about their cache (block size, ``max_model_len``, KV dtype, the
block-hash seed) they publish in the registry and in ``GetStats``, and the gateway reads it
there instead of being told (docs/architecture.md, "Who owns what").
"""

from __future__ import annotations

import argparse
import os
import socket
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, TypeVar

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from engine.config import DTYPE_NAMES, KV_CACHE_DTYPES, QUANTIZATIONS, SUPPORTED_BLOCK_SIZES, EngineConfig

S = TypeVar("S", bound="TandemSettings")


@dataclass(frozen=True)
class RequestLimits:
    """Caps on one request's sampling parameters, checked by the gateway and by every worker
    itself (the same values: they come from the same ``TANDEM_MAX_*`` settings).

    Attributes:
        max_n: samples per request at most.
        max_logprobs: top log-probabilities per generated token at most.
        max_stop: stop strings per request at most.
        max_stop_len: characters per stop string at most.
        max_stop_token_ids: stop token ids per request at most.
    """

    max_n: int = 8
    max_logprobs: int = 20
    max_stop: int = 16
    max_stop_len: int = 256
    max_stop_token_ids: int = 64


class TandemSettings(BaseSettings):
    """What every Tandem server is configured with (subclassed per server)."""

    model_config = SettingsConfigDict(env_prefix="TANDEM_", extra="ignore", protected_namespaces=(),
                                      populate_by_name=True)

    listen: str = Field("127.0.0.1:0", description="gRPC listen address host:port (port 0: any free port)")
    model: str = Field("", description="model: HF directory, .gguf file, ORG/NAME or preset; empty: SmolLM2-135M-Instruct")
    redis_url: str = Field("", description="Redis of the cluster state (redis://host:6379/0); empty: none")
    redis_key_prefix: str = Field("default", min_length=1, description="deployment name in Redis keys (tandem:{prefix}:...)")
    registry_ttl_s: float = Field(3.0, gt=0, description="seconds a worker's Redis entries outlive its last heartbeat")
    metrics_port: int = Field(0, ge=0, le=65535, description="Prometheus /metrics port, on the listen host; 0: off")
    health_port: int = Field(0, ge=0, le=65535, description="plaintext port of the gRPC health Check alone (plus "
                                                             "the name liveness), on the listen host, for probes "
                                                             "that speak no TLS (Kubernetes' grpc probes); 0: off")
    drain_timeout_s: float = Field(30.0, ge=0, description="on SIGTERM, seconds in-flight requests get before they are aborted")
    tls_dir: str = Field("", description="TLS directory of `tandem certs init` (ca.pem, {role}.pem, {role}-key.pem): "
                                         "the gateway serves TLS, workers require a cluster client certificate; "
                                         "empty: the server refuses to start unless insecure is set")
    insecure: bool = Field(False, description="without tls_dir, serve and dial plaintext (any caller that reaches a "
                                              "port is served): a deliberate choice, logged as a warning")
    redis_password: str = Field("", repr=False, description="Redis password (AUTH); empty: none")
    redis_tls_ca: str = Field("", description="CA file that verifies Redis's certificate (with a rediss:// URL)")
    reflection: bool = Field(False, description="serve gRPC reflection (lists the services; workers' are internal)")
    log_level: typing.Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="log level")
    max_n: int = Field(RequestLimits.max_n, ge=1, description="largest sampling.n")
    max_logprobs: int = Field(RequestLimits.max_logprobs, ge=0, description="largest sampling.logprobs")
    max_stop: int = Field(RequestLimits.max_stop, ge=0, description="stop strings per request at most")
    max_stop_len: int = Field(RequestLimits.max_stop_len, ge=1, description="characters per stop string at most")
    max_stop_token_ids: int = Field(RequestLimits.max_stop_token_ids, ge=0, description="stop token ids per request at most")
    # Liveness and failover (docs/deployment.md, "Failures"): keepalive on every channel, both
    # ends; the rest is read by the gateway, which drives the worker calls.
    keepalive_time_s: float = Field(5.0, gt=0, description="seconds between HTTP/2 keepalive pings on every gRPC "
                                                           "connection (client and server side)")
    keepalive_timeout_s: float = Field(5.0, gt=0, description="seconds a keepalive ping waits for its ack before "
                                                              "the connection (and every call on it) is failed")
    hop_timeout_s: float = Field(60.0, gt=0, description="seconds one worker call (Admit, Prefill) may take when "
                                                         "the client's deadline is later or unset")
    decode_stall_timeout_s: float = Field(15.0, gt=0, description="seconds a Decode stream may go without a "
                                                                  "message before its worker counts as failed")
    max_retries: int = Field(2, ge=0, description="tries on other workers after a worker failure before the "
                                                  "client has seen a token, and resumes of a greedy or seeded "
                                                  "stream on another decode worker after it")
    outlier_consecutive_failures: int = Field(2, ge=1, description="consecutive failed calls that eject a worker "
                                                                   "from routing")
    outlier_base_ejection_s: float = Field(5.0, gt=0, description="seconds of a worker's first ejection; each "
                                                                  "repeat doubles it")
    outlier_max_ejection_s: float = Field(60.0, gt=0, description="seconds an ejection lasts at most")
    health_probe_interval_s: float = Field(1.0, gt=0, description="seconds between the gateway's health probes "
                                                                  "of each worker")
    health_probe_timeout_s: float = Field(1.0, gt=0, description="seconds a health probe waits; no SERVING "
                                                                 "answer in time: not routed to until one comes")

    @field_validator("listen")
    @classmethod
    def _check_listen(cls, value: str) -> str:
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"must be host:port, got {value!r}")
        return value

    @field_validator("tls_dir")
    @classmethod
    def _check_tls_dir(cls, value: str) -> str:
        if value and not os.path.isfile(os.path.join(value, "ca.pem")):
            raise ValueError(f"{value} has no ca.pem (make one with `tandem certs init {value}`)")
        return value

    def check_transport_security(self) -> None:
        """Refuse plaintext nobody chose: without ``tls_dir``, ``insecure`` must be set.

        Raises:
            ValueError: neither is set (the message names both settings).
        """
        if not self.tls_dir and not self.insecure:
            cls = type(self)
            raise ValueError(f"no TLS: set {setting_name(cls, 'tls_dir')} (`tandem certs init DIR` makes one) or "
                             f"choose plaintext with {setting_name(cls, 'insecure')}")

    @field_validator("outlier_max_ejection_s")
    @classmethod
    def _check_max_ejection(cls, value: float, info) -> float:
        base = info.data.get("outlier_base_ejection_s")
        if base is not None and value < base:
            raise ValueError(f"must be >= outlier_base_ejection_s ({base}), got {value}")
        return value

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, value: object) -> object:
        return value.upper() if isinstance(value, str) else value

    @property
    def listen_host(self) -> str:
        """The host part of ``listen`` (brackets of an IPv6 literal removed)."""
        return self.listen.rpartition(":")[0].strip("[]")

    def limits(self) -> RequestLimits:
        """The request caps of these settings."""
        return RequestLimits(self.max_n, self.max_logprobs, self.max_stop, self.max_stop_len,
                             self.max_stop_token_ids)


class WorkerSettings(TandemSettings):
    """Settings of one prefill or decode worker process (engine and KV transfer included)."""

    advertise: str = Field("", description="address peers dial (registry, KV destination); empty: the listen "
                                           "address, a wildcard host replaced by this host's IP")
    worker_id: str = Field("", description="id in the registry; empty: {role}-{hostname}-{pid}")
    heartbeat_interval_s: float = Field(1.0, gt=0, description="seconds between heartbeats (< registry_ttl_s)")
    load_format: typing.Literal["auto", "dummy"] = Field("auto", description="auto, or dummy: random weights")
    block_size: int = Field(16, description=f"tokens per KV block, one of {SUPPORTED_BLOCK_SIZES}")
    num_blocks: int | None = Field(None, ge=1, description="KV blocks in the pool; unset: sized from memory")
    kv_cache_memory_bytes: int = Field(1 << 30, ge=1, description="KV cache bytes when not on CUDA")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="fraction of the GPU's memory to use")
    max_num_seqs: int = Field(256, ge=1, description="sequences in the running batch at most")
    max_num_batched_tokens: int = Field(2048, ge=1, description="tokens per engine step at most (prefill chunk size)")
    max_model_len: int | None = Field(None, ge=2, description="prompt + output tokens at most; unset: the model's")
    enable_prefix_caching: bool = Field(True, description="reuse cached KV blocks across requests")
    enforce_eager: bool = Field(False, description="CUDA: capture no CUDA graphs (less start-up, slower steps)")
    cuda_graph_batch_sizes: Annotated[list[int] | None, NoDecode] = Field(
        None, description="CUDA: decode batch sizes captured as graphs; unset: 1, 2, 4, then every multiple of 8 up to max_num_seqs")
    cuda_graph_token_sizes: Annotated[list[int] | None, NoDecode] = Field(
        None, description="CUDA: token counts at which the pieces between attentions of other steps (prompt chunks) "
                          "are captured as graphs; unset: 16, 32, 64, 128, then eight counts per doubling (144, "
                          "160, ..., 256, 288, ...) up to min(max_num_batched_tokens, 2048); empty: none")
    device: str = Field("auto", description="auto (CUDA when available), cpu or cuda[:N]; with tensor parallelism, "
                                            "rank 0's GPU (rank r runs on the GPU r after it)")
    tensor_parallel_size: int = Field(1, ge=1, description="ranks the model is sharded over (Megatron-LM tensor "
                                                           "parallelism), one process and one GPU each; it must "
                                                           "divide the model's attention and KV heads")
    dtype: typing.Literal["auto", *DTYPE_NAMES] = Field(
        "auto", description="model dtype (and the KV cache's, unless kv_cache_dtype says otherwise); auto: "
                            "bfloat16 on CUDA, float32 on CPU")
    kv_cache_dtype: typing.Literal[*KV_CACHE_DTYPES] = Field(
        "auto", description="KV cache dtype: auto (the model's dtype) or fp8_e4m3 (float8 e4m3, scale 1.0, "
                            "saturated to ±448: twice the blocks in the same memory; CUDA needs compute capability "
                            ">= 8.9); published, and a pool's workers must agree")
    quantization: typing.Literal[*QUANTIZATIONS] = Field(
        "auto", description="gguf: keep a GGUF model's Q4_0/Q4_1/Q8_0 weights quantized and compute with them "
                            "(CPU; the matmuls in bfloat16); none: dequantize (the HF-parity path); auto: gguf for a GGUF model "
                            "on the CPU")
    seed: int = Field(0, ge=0, description="seed of the engine's shared randomness")
    lease_s: float = Field(30.0, gt=0, le=600, description="decode: seconds a reservation lives with no transfer "
                                                           "stream open on it and no Decode claiming it (the "
                                                           "worker's own: no caller chooses it)")
    kv_transport: typing.Literal["auto", "nixl", "grpc"] = Field(
        "auto", description="how KV blocks move between workers: nixl (GPU-direct / shared memory / RDMA; a "
                            "startup error without NIXL), grpc (bytes in the stream), auto (NIXL where both peers "
                            "have it)")
    kv_verify_checksums: bool = Field(False, description="debug: check a CRC-32 of every block moved by NIXL "
                                                         "(copies each block to the host on both sides)")
    engine_hang_timeout_s: float = Field(60.0, gt=0, description="seconds one iteration of the engine core's loop "
                                                                 "(a step) may take before the engine is declared "
                                                                 "hung: the worker then fails its requests "
                                                                 "(UNAVAILABLE) and exits")
    stream_interval: int = Field(1, ge=1, description="decode: new tokens a stream message waits for (the last one "
                                                      "of a sample goes whatever it holds); more: fewer messages per "
                                                      "token for the worker's event loop, coarser streaming "
                                                      "(SGLang's stream_interval)")

    @field_validator("cuda_graph_batch_sizes", "cuda_graph_token_sizes", mode="before")
    @classmethod
    def _split_sizes(cls, value):
        """``"1,2,4"`` (an environment variable or a flag) → ``[1, 2, 4]``."""
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("block_size")
    @classmethod
    def _check_block_size(cls, value: int) -> int:
        if value not in SUPPORTED_BLOCK_SIZES:
            raise ValueError(f"must be one of {SUPPORTED_BLOCK_SIZES}, got {value}")
        return value

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            block_size=self.block_size, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens, max_model_len=self.max_model_len,
            num_blocks=self.num_blocks, kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            gpu_memory_utilization=self.gpu_memory_utilization,
            enable_prefix_caching=self.enable_prefix_caching, dtype=self.dtype, quantization=self.quantization,
            kv_cache_dtype=self.kv_cache_dtype, device=self.device,
            seed=self.seed, enforce_eager=self.enforce_eager, cuda_graph_batch_sizes=self.cuda_graph_batch_sizes,
            cuda_graph_token_sizes=self.cuda_graph_token_sizes, tensor_parallel_size=self.tensor_parallel_size,
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


def env_name(settings_cls: type[TandemSettings], field: str) -> str:
    """The environment variable a field reads (its alias where it has one)."""
    alias = settings_cls.model_fields[field].validation_alias
    choices = getattr(alias, "choices", None)
    return str(choices[0]) if choices else f"TANDEM_{field.upper()}"


def setting_name(settings_cls: type[TandemSettings], field: str) -> str:
    """How a user sets ``field``: ``--foo-bar / TANDEM_FOO_BAR`` (for error messages)."""
    return f"--{field.replace('_', '-')} / {env_name(settings_cls, field)}"


def _flag_help(settings_cls: type[TandemSettings], name: str) -> str:
    field = settings_cls.model_fields[name]
    default = field.get_default(call_default_factory=True)
    shown = ",".join(default) if isinstance(default, list) else default
    return f"{field.description or name} (env {env_name(settings_cls, name)}; default {shown!r})"


class _OneLineErrors(argparse.ArgumentParser):
    """argparse, but an error is one line on stderr (no usage block), exit code 2."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (--help lists the flags)\n")


def build_parser(settings_cls: type[TandemSettings], prog: str, description: str) -> argparse.ArgumentParser:
    """An argument parser with one flag per settings field: ``--foo-bar VALUE``, and for a
    boolean field ``--foo-bar`` / ``--no-foo-bar``. Values are checked by the settings."""
    parser = _OneLineErrors(prog=prog, description=description)
    for name, field in settings_cls.model_fields.items():
        flag = f"--{name.replace('_', '-')}"
        if field.annotation is bool:
            parser.add_argument(flag, dest=name, default=None, action=argparse.BooleanOptionalAction,
                                help=_flag_help(settings_cls, name))
        else:
            parser.add_argument(flag, dest=name, default=None, metavar=name.upper(),
                                help=_flag_help(settings_cls, name))
    return parser


def from_args(settings_cls: type[S], argv: Sequence[str] | None, prog: str, description: str) -> S:
    """Parse flags into settings (flags override ``TANDEM_*`` environment variables).

    Raises:
        SystemExit: bad flags or a bad value: exit code 2 after one line on stderr naming the
            setting (argparse's convention).
    """
    parser = build_parser(settings_cls, prog, description)
    overrides = {k: v for k, v in vars(parser.parse_args(argv)).items() if v is not None}
    try:
        return settings_cls(**overrides)
    except ValidationError as exc:
        problems = "; ".join(
            f"{setting_name(settings_cls, str(e['loc'][0])) if e['loc'] else 'settings'}: "
            f"{e['msg'].removeprefix('Value error, ')}" for e in exc.errors())
        parser.error(problems)
        raise  # unreachable: parser.error exits


Addresses = Annotated[list[str], NoDecode]


def split_addresses(value: object) -> object:
    """``"host:port,host:port"`` (an environment variable or a flag) → a list of addresses."""
    if isinstance(value, str):
        return [a.strip() for a in value.split(",") if a.strip()]
    return value
