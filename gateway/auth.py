"""Who may call the gateway: API keys, each naming a tenant with its own limits.

Keys are configured by their SHA-256 (hex), never in clear: ``HASH:TENANT[:MAX_STREAMS]`` entries
in ``TANDEM_API_KEYS`` (comma-separated) and/or one per line in the file ``TANDEM_API_KEYS_FILE``
(``#`` comments and blank lines ignored). A client sends its key as ``authorization: Bearer KEY``
(or ``x-api-key: KEY``), in gRPC metadata or as an HTTP header. :class:`TenantGate` knows the
keys and counts each tenant's calls in flight, on every port together; :class:`AuthInterceptor`
applies it to the gRPC port: every call without a known key is refused with
``UNAUTHENTICATED`` (health stays open for probes) and a tenant's call beyond its concurrent
limit with ``RESOURCE_EXHAUSTED`` (reflection needs a key but is not counted: a tenant limited
to one stream can still use grpcurl, whose reflection stream stays open during the call); the
servicer reads the caller's tenant from :data:`tenant_var`. The HTTP port (:mod:`gateway.openai_api`)
asks the same gate. With no key configured the gateway is open (the local demo) and every
request is one anonymous tenant.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import functools
import hashlib
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc

from cluster.interceptors import wrap_handler
from protos.status import StatusError

OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)
UNCOUNTED_METHOD_PREFIXES = ("/grpc.reflection.",)
_HASH = re.compile(r"[0-9a-f]{64}")
_TENANT = re.compile(r"[A-Za-z0-9._-]{1,64}")


@dataclass(frozen=True)
class Tenant:
    """A caller of the gateway.

    Attributes:
        name: the tenant's name (letters, digits, ``. _ -``, at most 64): in logs, and the
            salt of its prefix cache (tenants never share cached KV).
        max_streams: concurrent calls at most (0: no limit).
    """

    name: str
    max_streams: int = 0


tenant_var: contextvars.ContextVar[Tenant | None] = contextvars.ContextVar("tenant", default=None)


def hash_key(key: str) -> str:
    """The SHA-256 (hex) under which an API key is configured."""
    return hashlib.sha256(key.encode()).hexdigest()


class ApiKeys:
    """Known API keys, by hash.

    Args:
        tenants: SHA-256 hex of a key → its tenant.
    """

    def __init__(self, tenants: dict[str, Tenant]) -> None:
        self._tenants = dict(tenants)

    def __len__(self) -> int:
        return len(self._tenants)

    @classmethod
    def parse(cls, entries: Iterable[str], source: str) -> ApiKeys:
        """Keys from ``HASH:TENANT[:MAX_STREAMS]`` entries (blank ones and ``#`` comments skipped).

        Raises:
            ValueError: a malformed entry, naming ``source`` and the entry's number (never
                its hash).
        """
        tenants: dict[str, Tenant] = {}
        for number, entry in enumerate(entries, 1):
            entry = entry.split("#", 1)[0].strip()
            if not entry:
                continue
            parts = entry.split(":")
            ok = (len(parts) in (2, 3) and _HASH.fullmatch(parts[0].lower()) and _TENANT.fullmatch(parts[1])
                  and (len(parts) == 2 or parts[2].isdigit()))
            if not ok:
                raise ValueError(f"{source}: entry {number} is not SHA256HEX:TENANT[:MAX_STREAMS] (tenant: "
                                 f"letters, digits, . _ -, at most 64)")
            tenants[parts[0].lower()] = Tenant(parts[1], int(parts[2]) if len(parts) == 3 else 0)
        return cls(tenants)

    @classmethod
    def load(cls, inline: Iterable[str], file: str, inline_source: str, file_source: str) -> ApiKeys:
        """Keys from inline entries and from ``file`` (empty: none).

        Raises:
            ValueError: a malformed entry or an unreadable file, naming its setting.
        """
        keys = cls.parse(inline, inline_source)
        if file:
            try:
                lines = Path(file).read_text().splitlines()
            except OSError as exc:
                raise ValueError(f"{file_source}: cannot read {file}: {exc.strerror or exc}") from None
            keys._tenants.update(cls.parse(lines, f"{file_source} ({file})")._tenants)
        return keys

    def tenant(self, key: str) -> Tenant | None:
        """The tenant of ``key`` (as the client sent it), or ``None`` for an unknown key."""
        return self._tenants.get(hash_key(key))


def key_of(headers: Iterable[tuple[str, str]] | None) -> str:
    """The API key in gRPC metadata or HTTP headers (lower-case names): ``authorization: Bearer
    KEY`` or ``x-api-key: KEY``; ``""`` when there is none."""
    for name, value in headers or ():
        if name == "authorization" and isinstance(value, str) and value.lower().startswith("bearer "):
            return value[7:].strip()
        if name == "x-api-key" and isinstance(value, str):
            return value.strip()
    return ""


class TenantGate:
    """The known keys and the calls each tenant has in flight (all ports together).

    Args:
        keys: the known keys (at least one; with none, the gateway is open and has no gate).
    """

    def __init__(self, keys: ApiKeys) -> None:
        self.keys = keys
        self.in_flight: collections.Counter[str] = collections.Counter()

    def tenant(self, key: str) -> Tenant:
        """The tenant of ``key`` (as the client sent it).

        Raises:
            StatusError: ``UNAUTHENTICATED`` for no key or an unknown one.
        """
        tenant = self.keys.tenant(key) if key else None
        if tenant is None:
            raise StatusError(grpc.StatusCode.UNAUTHENTICATED,
                              "a valid API key is required (authorization: Bearer KEY)")
        return tenant

    @contextlib.contextmanager
    def admitted(self, tenant: Tenant) -> Iterator[None]:
        """Count one call of ``tenant`` while the block runs.

        Raises:
            StatusError: ``RESOURCE_EXHAUSTED`` when the tenant has ``max_streams`` calls in flight.
        """
        if tenant.max_streams and self.in_flight[tenant.name] >= tenant.max_streams:
            raise StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"tenant {tenant.name} already has {tenant.max_streams} calls in flight, its limit")
        self.in_flight[tenant.name] += 1
        try:
            yield
        finally:
            self.in_flight[tenant.name] -= 1


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """API-key authentication and per-tenant concurrency limits on the gRPC port (module docstring).

    Args:
        gate: the keys and the tenants' counts.
    """

    def __init__(self, gate: TenantGate) -> None:
        self.gate = gate

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        key = key_of(handler_call_details.invocation_metadata)
        counted = not handler_call_details.method.startswith(UNCOUNTED_METHOD_PREFIXES)
        return wrap_handler(handler, scope=functools.partial(self._admit, key, counted))

    @contextlib.asynccontextmanager
    async def _admit(self, key: str, counted: bool, context: grpc.aio.ServicerContext):
        with contextlib.ExitStack() as admitted:
            try:
                tenant = self.gate.tenant(key)
                if counted:
                    admitted.enter_context(self.gate.admitted(tenant))
            except StatusError as exc:
                await context.abort(exc.code, exc.message)
            tenant_var.set(tenant)  # the call's own task: seen by its servicer, by no other call
            yield
