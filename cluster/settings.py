"""Settings of Tandem's servers: one class per process, holding exactly what that process reads.

``GatewaySettings`` (``gateway/settings.py``), ``WorkerSettings`` (a prefill worker) and
``DecodeWorkerSettings`` (``decode_worker/settings.py``) share :class:`ServerSettings`. Each
setting is declared once: the engine's in :class:`engine.config.EngineConfig`, nested whole as
``WorkerSettings.engine`` (handed to the engine as it is); the request caps in
:class:`RequestLimits`, nested as ``ServerSettings.limits``.

Names: a setting ``foo_bar`` is the environment variable ``TANDEM_FOO_BAR``, the flag
``--foo-bar`` (a boolean: ``--foo-bar`` / ``--no-foo-bar``) and the keyword ``foo_bar=``,
whether it is a field of the class or of a nested model. Nested fields keep these flat names
rather than pydantic-settings' nested ones (``TANDEM_ENGINE__BLOCK_SIZE``,
``--engine.block-size``): operators, compose files, Kubernetes manifests and tests already use
them, and a process has one namespace of settings (:func:`settings_fields` refuses a name two
nested models share). One name differs: the gateway's ``listen`` is ``TANDEM_GATEWAY_ADDR``.

Sources, the first that has a setting wins: flags (:func:`from_args`: pydantic-settings' CLI
source, its flags named as above), keywords, the environment (pydantic-settings' source for the
class's own fields, :class:`_NestedEnvironment` for the nested models'), the default. Values
are checked when the settings are built; a bad one is refused naming its setting.

Each setting has one owner: what the workers decide about their cache (block size,
``max_model_len``, KV dtype, the block-hash seed) they publish in the registry and in
``GetStats``, and the gateway reads it there instead of being told (docs/architecture.md, "Who
owns what").
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import typing
from collections.abc import Sequence
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator
from pydantic.dataclasses import dataclass
from pydantic_settings import (
    BaseSettings, CliSettingsSource, EnvSettingsSource, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict,
)

from engine.config import EngineConfig

S = TypeVar("S", bound="ServerSettings")


@dataclass(frozen=True)
class RequestLimits:
    """Caps on one request's sampling parameters, checked by the gateway and by every worker
    itself (the same values: they come from the same settings)."""

    max_n: int = Field(8, ge=1, description="largest sampling.n")
    max_logprobs: int = Field(20, ge=0, description="largest sampling.logprobs")
    max_stop: int = Field(16, ge=0, description="stop strings per request at most")
    max_stop_len: int = Field(256, ge=1, description="characters per stop string at most")
    max_stop_token_ids: int = Field(64, ge=0, description="stop token ids per request at most")
    max_logit_bias: int = Field(300, ge=0, description="sampling.logit_bias entries per request at most")
    max_bad_words: int = Field(64, ge=0, description="bad words' token sequences per request at most (a word "
                                                     "counts once or twice: with and without a leading space)")
    max_structured_output_bytes: int = Field(65536, ge=1, description="UTF-8 bytes of a structured output's "
                                                                      "schema, regex, grammar or choices at most")


def _nested_model(annotation: object) -> bool:
    return dataclasses.is_dataclass(annotation) or (isinstance(annotation, type) and issubclass(annotation, BaseModel))


def settings_fields(settings_cls: type[BaseSettings]) -> dict[str, tuple[str, ...]]:
    """Every setting of ``settings_cls`` by name, with its path: ``("listen",)`` for a field of
    the class, ``("engine", "block_size")`` for a field of a nested model.

    Raises:
        TypeError: two settings have one name (a nested field shadows another setting).
    """
    fields: dict[str, tuple[str, ...]] = {}
    for name, field in settings_cls.model_fields.items():
        inner = field.annotation
        paths = [(name, sub) for sub in inner.__pydantic_fields__] if _nested_model(inner) else [(name,)]
        for path in paths:
            if path[-1] in fields:
                raise TypeError(f"{settings_cls.__name__}: {'.'.join(path)} and {'.'.join(fields[path[-1]])} "
                                f"are both named {path[-1]}")
            fields[path[-1]] = path
    return fields


def env_name(settings_cls: type[BaseSettings], name: str) -> str:
    """The environment variable setting ``name`` is read from (its alias where it has one)."""
    path = settings_fields(settings_cls)[name]
    alias = settings_cls.model_fields[name].validation_alias if len(path) == 1 else None
    return str(alias) if alias else f"TANDEM_{name.upper()}"


def setting_name(settings_cls: type[BaseSettings], name: str) -> str:
    """How a user sets ``name``: ``--foo-bar / TANDEM_FOO_BAR`` (for error messages)."""
    return f"--{name.replace('_', '-')} / {env_name(settings_cls, name)}"


def _setting_at(settings_cls: type[BaseSettings], loc: Sequence[str | int]) -> str | None:
    """The setting a validation error's ``loc`` (or an argparse ``dest``, split at dots)
    points at: a field given by its alias is named by the field; a nested model's field by its
    own name; ``None`` for a nested model as a whole."""
    aliases = {str(f.validation_alias): name for name, f in settings_cls.model_fields.items() if f.validation_alias}
    fields = settings_fields(settings_cls)
    head = aliases.get(str(loc[0]), str(loc[0])) if loc else ""
    if head in fields:
        return head
    return str(loc[1]) if len(loc) > 1 and str(loc[1]) in fields else None


class _NestedEnvironment(EnvSettingsSource):
    """The nested models' fields from the environment by their flat names:
    ``TANDEM_BLOCK_SIZE`` → ``{"engine": {"block_size": "..."}}`` (module docstring)."""

    def __call__(self) -> dict[str, Any]:
        values: dict[str, dict[str, str | None]] = {}
        for name, path in settings_fields(self.settings_cls).items():
            key = env_name(self.settings_cls, name)
            key = key if self.case_sensitive else key.lower()
            if len(path) == 2 and key in self.env_vars:
                values.setdefault(path[0], {})[name] = self.env_vars[key]
        return values


class ServerSettings(BaseSettings):
    """What every Tandem server reads (subclassed per process)."""

    model_config = SettingsConfigDict(env_prefix="TANDEM_", extra="ignore", protected_namespaces=(),
                                      populate_by_name=True, cli_kebab_case=True, cli_implicit_flags=True,
                                      cli_hide_none_type=True, cli_avoid_json=True)

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
    limits: RequestLimits = Field(RequestLimits(), description="request caps")
    # Liveness (docs/deployment.md, "Failures"): keepalive on every channel, both ends.
    keepalive_time_s: float = Field(5.0, gt=0, description="seconds between HTTP/2 keepalive pings on every gRPC "
                                                           "connection (client and server side)")
    keepalive_timeout_s: float = Field(5.0, gt=0, description="seconds a keepalive ping waits for its ack before "
                                                              "the connection (and every call on it) is failed")

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource,
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, env_settings, _NestedEnvironment(settings_cls)

    @model_validator(mode="before")
    @classmethod
    def _nest_keywords(cls, data: object) -> object:
        """A nested model's fields given as keywords by their flat names (``num_blocks=8``) go
        into the model; they win over the same field from the environment."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for name, path in settings_fields(cls).items():
            if len(path) == 2 and name in data:
                given = data.get(path[0], {})
                given = given if isinstance(given, dict) else dataclasses.asdict(given)
                data[path[0]] = {**given, name: data.pop(name)}
        return data

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

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, value: object) -> object:
        return value.upper() if isinstance(value, str) else value

    @property
    def listen_host(self) -> str:
        """The host part of ``listen`` (brackets of an IPv6 literal removed)."""
        return self.listen.rpartition(":")[0].strip("[]")


class WorkerSettings(ServerSettings):
    """Settings of a worker process (a prefill worker reads exactly these; a decode worker
    reads ``decode_worker.settings.DecodeWorkerSettings``): the engine's, nested, and KV transfer."""

    advertise: str = Field("", description="address peers dial (registry, KV destination); empty: the listen "
                                           "address, a wildcard host replaced by this host's IP")
    worker_id: str = Field("", description="id in the registry; empty: {role}-{hostname}-{pid}")
    heartbeat_interval_s: float = Field(1.0, gt=0, description="seconds between heartbeats (< registry_ttl_s)")
    load_format: typing.Literal["auto", "dummy"] = Field("auto", description="auto, or dummy: random weights")
    engine: EngineConfig = Field(EngineConfig(), description="the engine's settings")
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


class _OneLineErrors(argparse.ArgumentParser):
    """argparse, but an error is one line on stderr (no usage block), exit code 2."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (--help lists the flags)\n")


def cli_parser(settings_cls: type[S], prog: str, description: str) -> tuple[argparse.ArgumentParser,
                                                                              CliSettingsSource[S]]:
    """The argument parser of ``settings_cls``'s flags and the pydantic-settings CLI source that
    fills it: one flag per setting, named by the setting (module docstring), its help the
    field's description, default and environment variable. A nested model's own JSON flag
    (``--engine '{...}'``) is left out: each of its fields has a flag; a setting that is a model
    in turn (``--speculative-config '{...}'``) is one JSON flag."""
    parser = _OneLineErrors(prog=prog, description=description, allow_abbrev=False)

    def add_flag(group, *_names: str, dest: str, help: str, **kwargs):  # noqa: A002 (argparse's name)
        path = dest.split(".")
        # A setting that is itself a model (``speculative_config``) is one JSON flag, not one per field.
        name = _setting_at(settings_cls, path) if len(path) <= 2 else None
        if name is None:
            return None
        if help == argparse.SUPPRESS:  # pydantic-settings hides a model's JSON flag: not ours
            outer, inner = settings_fields(settings_cls)[name]
            help = settings_cls.model_fields[outer].annotation.__pydantic_fields__[inner].description  # noqa: A001
        return group.add_argument(f"--{name.replace('_', '-')}", dest=dest, **kwargs,
                                  help=f"{help} [env {env_name(settings_cls, name)}]")

    source = CliSettingsSource(settings_cls, cli_prog_name=prog, root_parser=parser, add_argument_method=add_flag)
    return parser, source


def from_args(settings_cls: type[S], argv: Sequence[str] | None, prog: str, description: str) -> S:
    """Parse flags into settings (flags override the environment; ``argv`` ``None``:
    ``sys.argv[1:]``).

    Raises:
        SystemExit: bad flags or a bad value: exit code 2 after one line on stderr naming the
            setting (argparse's convention).
    """
    parser, source = cli_parser(settings_cls, prog, description)
    try:
        return settings_cls(_cli_settings_source=source(args=True if argv is None else list(argv)))
    except ValidationError as exc:
        problems = []
        for e in exc.errors():
            name = _setting_at(settings_cls, e["loc"])
            problems.append(f"{setting_name(settings_cls, name) if name else 'settings'}: "
                            f"{e['msg'].removeprefix('Value error, ')}")
        parser.error("; ".join(problems))
        raise  # unreachable: parser.error exits


# A list setting given as one string in an environment variable or a flag: "a,b" (split_commas).
CommaSeparated = Annotated[list[str], NoDecode]


def split_commas(value: object) -> object:
    """``"a, b,c"`` (an environment variable or a flag) → ``["a", "b", "c"]``; a list stays."""
    if isinstance(value, str):
        return [a.strip() for a in value.split(",") if a.strip()]
    return value
