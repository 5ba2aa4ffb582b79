"""TLS for the gateway and mutual TLS among the gateway and the workers, from one private CA.

A TLS directory (``tandem certs init DIR``, :func:`init_certs`) holds ``ca.pem`` (the cluster's
CA certificate), ``ca-key.pem`` (kept by whoever issues certificates; no server reads it) and,
per role (``gateway``, ``prefill``, ``decode``), ``{role}.pem`` and ``{role}-key.pem``. Every
certificate carries the DNS names ``tandem-cluster`` and ``tandem-{role}``; the gateway's also
``localhost``, ``127.0.0.1`` and any extra public names (subject alternative names: what its
clients dial, ``tandem certs init DIR --san NAME,...``).

A worker instance's own TLS directory (``tandem certs issue DIR ROLE INSTANCE --out OUT``,
:func:`issue_instance_cert`) holds ``ca.pem`` and its ``{role}.pem`` / ``{role}-key.pem``, whose
certificate also carries the URI ``spiffe://tandem/{role}/{instance}`` (:func:`instance_uri`): the
gateway routes to a registry entry only if the certificate on the entry's address names the
entry's worker id (:mod:`cluster.identity`), so a role's key alone cannot register a second worker.

Identity is the certificate, not the address: internal channels verify the peer's certificate
against ``ca.pem`` under a fixed name (``grpc.ssl_target_name_override``): ``tandem-decode``
where only a decode worker will do (a worker sending KV), ``tandem-cluster`` for any
member. Workers require a client certificate from the same CA, and each of their methods takes
calls only from the roles that make them (:class:`PeerRoleInterceptor`: ``TransferKV`` from a
prefill worker or a decode worker lent to prefill, ``Admit``/``Prefill``/``Decode``/``Abort`` from
the gateway); the gateway's public port asks for none (API keys authenticate clients).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import ipaddress
import os
import re
import ssl
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from cluster.interceptors import wrap_handler

ROLES = ("gateway", "prefill", "decode")
CLUSTER_NAME = "tandem-cluster"
INSTANCE_URI_PREFIX = "spiffe://tandem/"
_INSTANCE = re.compile(r"[A-Za-z0-9._-]+")  # a worker id (cluster.registry.WorkerInfo)


def role_name(role: str) -> str:
    """The DNS name every certificate of ``role`` carries, e.g. ``tandem-decode``."""
    return f"tandem-{role}"


@dataclass(frozen=True)
class TlsFiles:
    """One process's TLS material, read from a TLS directory.

    Attributes:
        ca: the cluster CA certificate (PEM bytes).
        cert: this process's certificate chain (PEM bytes).
        key: its private key (PEM bytes).
    """

    ca: bytes
    cert: bytes
    key: bytes

    @classmethod
    def load(cls, directory: str, role: str, setting: str) -> TlsFiles:
        """Read ``ca.pem``, ``{role}.pem`` and ``{role}-key.pem`` from ``directory``.

        Raises:
            ValueError: a file is missing or unreadable; names it and ``setting``.
        """
        base = Path(directory)
        try:
            return cls((base / "ca.pem").read_bytes(), (base / f"{role}.pem").read_bytes(),
                       (base / f"{role}-key.pem").read_bytes())
        except OSError as exc:
            raise ValueError(f"{setting}: cannot read {exc.filename}: {exc.strerror}") from None

    def matches(self) -> bool:
        """Whether the key belongs to the certificate (a half-replaced pair does not)."""
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization

        try:
            cert_key = x509.load_pem_x509_certificate(self.cert).public_key()
            key = serialization.load_pem_private_key(self.key, password=None)
        except ValueError:
            return False
        raw = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
        return cert_key.public_bytes(*raw) == key.public_key().public_bytes(*raw)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Credentials of a channel to a cluster member: the peer verified against the CA, this
        process's certificate presented."""
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)


class _WatchedFiles:
    """A role's files in a TLS directory and the modification times they were read at."""

    def __init__(self, directory: str, role: str, setting: str) -> None:
        self.directory, self.role, self.setting = directory, role, setting
        self.paths = [Path(directory) / name for name in ("ca.pem", f"{role}.pem", f"{role}-key.pem")]
        self.stamp = self._stamp()
        self.files = TlsFiles.load(directory, role, setting)
        if not self.files.matches():
            raise ValueError(f"{setting}: {role}-key.pem does not belong to {role}.pem")

    def _stamp(self) -> tuple[int, ...]:
        return tuple(p.stat().st_mtime_ns if p.exists() else -1 for p in self.paths)

    def changed(self) -> TlsFiles | None:
        """The files if they changed since last read and are complete and consistent (the key
        matches the certificate); ``None`` otherwise (unchanged, or mid-rotation: keep the old)."""
        now = self._stamp()
        if now == self.stamp:
            return None
        try:
            fresh = TlsFiles.load(self.directory, self.role, self.setting)
        except ValueError:
            return None
        if not fresh.matches():
            return None
        self.stamp, self.files = now, fresh
        return fresh


def server_credentials(directory: str, role: str, require_client_auth: bool, setting: str) -> grpc.ServerCredentials:
    """Credentials of a server port from a TLS directory, re-read when its files change: at each
    new handshake the files' modification times are compared, and a changed set that is
    complete and consistent (the key matches the certificate) replaces the old one (rotation
    without a restart; connections already open keep theirs).

    Args:
        directory: the TLS directory.
        role: whose certificate to serve (``gateway``, ``prefill``, ``decode``).
        require_client_auth: a client must present a certificate signed by the CA (else the
            handshake fails).
        setting: the setting that named ``directory``, for errors.

    Raises:
        ValueError: the files cannot be read now, or the key does not match the certificate.
    """
    watched = _WatchedFiles(directory, role, setting)

    def configuration(files: TlsFiles) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration([(files.key, files.cert)], root_certificates=files.ca)

    def fetch() -> grpc.ServerCertificateConfiguration | None:  # gRPC calls it at each new handshake
        fresh = watched.changed()
        return None if fresh is None else configuration(fresh)

    return grpc.dynamic_ssl_server_credentials(configuration(watched.files), fetch,
                                               require_client_authentication=require_client_auth)


class _RotatingContext(ssl.SSLContext):
    """An ``ssl.SSLContext`` that re-reads its certificate when the files change: asyncio wraps
    every new connection with :meth:`wrap_bio`, the moment gRPC's ``fetch`` is called at."""

    watched: _WatchedFiles

    def wrap_bio(self, *args, **kwargs):
        if self.watched.changed() is not None:
            # The files changed again meanwhile (mid-rotation): the next handshake takes that change.
            with contextlib.suppress(ssl.SSLError, OSError):
                self.load_cert_chain(self.watched.paths[1], self.watched.paths[2])
        return super().wrap_bio(*args, **kwargs)


def server_ssl_context(directory: str, role: str, setting: str) -> ssl.SSLContext:
    """An HTTPS server's context from a TLS directory (``{role}.pem`` served, no client
    certificate asked), re-read when its files change as :func:`server_credentials` is.

    Raises:
        ValueError: the files cannot be read now, or the key does not match the certificate.
    """
    context = _RotatingContext(ssl.PROTOCOL_TLS_SERVER)
    context.watched = _WatchedFiles(directory, role, setting)
    context.load_cert_chain(context.watched.paths[1], context.watched.paths[2])
    return context


class ClientCredentials:
    """The credentials a process dials cluster members with, re-read when its TLS files change
    (the client side of rotation; :func:`server_credentials` is the server's): :meth:`current`
    compares the files' modification times at most every ``check_interval_s`` seconds and takes
    a changed set once it is complete and consistent. ``cluster.channels.ChannelCache`` then
    replaces its channels, so new calls present the new certificate and trust the new CA.

    Args:
        directory, role, setting: as :func:`server_credentials`.
        check_interval_s: seconds between looks at the files.

    Raises:
        ValueError: the files cannot be read now, or the key does not match the certificate.
    """

    def __init__(self, directory: str, role: str, setting: str, check_interval_s: float = 1.0) -> None:
        self._watched = _WatchedFiles(directory, role, setting)
        self.check_interval_s = check_interval_s
        self.generation = 0  # grows with each change taken
        self._credentials = self._watched.files.channel_credentials()
        self._checked_at = time.monotonic()

    def current(self) -> grpc.ChannelCredentials:
        """The credentials to dial with now (re-read first when the files changed)."""
        now = time.monotonic()
        if now - self._checked_at >= self.check_interval_s:
            self._checked_at = now
            fresh = self._watched.changed()
            if fresh is not None:
                self._credentials = fresh.channel_credentials()
                self.generation += 1
        return self._credentials


def peer_roles(context: grpc.aio.ServicerContext) -> set[str]:
    """The roles the caller's verified certificate names (``tandem-{role}`` DNS names); empty
    without TLS or without a client certificate."""
    names = context.auth_context().get("x509_subject_alternative_name", [])
    return {role for role in ROLES if role_name(role).encode() in names}


class PeerRoleInterceptor(grpc.aio.ServerInterceptor):
    """Under mTLS, each method of ``service`` only for the roles that call it: the caller's
    certificate must name one of ``allowed[method]`` (else ``PERMISSION_DENIED``); a method
    missing from ``allowed`` is for no one. Other services (health, reflection) are left to
    the certificate check of the port.

    Args:
        service: full service name, e.g. ``tandem.v1.DecodeWorker``.
        allowed: method name (``"TransferKV"``) → roles (``("prefill",)``).
    """

    def __init__(self, service: str, allowed: Mapping[str, Collection[str]]) -> None:
        self.service = service
        self.allowed = {method: tuple(roles) for method, roles in allowed.items()}

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        service, _, method = handler_call_details.method.lstrip("/").partition("/")
        if handler is None or service != self.service:
            return handler
        return wrap_handler(handler, scope=functools.partial(self._check, method, self.allowed.get(method, ())))

    @contextlib.asynccontextmanager
    async def _check(self, method: str, roles: tuple[str, ...], context: grpc.aio.ServicerContext):
        if not peer_roles(context) & set(roles):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"{method} takes calls from {' or '.join(roles) or 'no'} certificates only")
        yield


# A DNS name of a certificate: dot-separated labels of letters, digits and inner hyphens (RFC
# 1123), at most 253 characters, the first label possibly a wildcard ``*``.
_DNS_NAME = re.compile(r"(?=.{1,253}$)(\*|[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)"
                       r"(\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*")


def split_names(values: Sequence[str], setting: str) -> list[str]:
    """The subject alternative names in ``values``, each a comma-separated list (``"gw.example,
    203.0.113.7"``); blanks skipped, order kept.

    Raises:
        ValueError: a name that is neither an IP address nor a DNS name, naming it and ``setting``.
    """
    names = [name.strip() for value in values for name in value.split(",") if name.strip()]
    for name in names:
        _check_name(name, setting)
    return names


def _check_name(name: str, setting: str) -> None:
    if not _is_ip(name) and not _DNS_NAME.fullmatch(name):
        raise ValueError(f"{setting}: {name!r} is neither an IP address nor a DNS name")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def instance_uri(role: str, instance: str) -> str:
    """The URI subject alternative name that names one worker instance, e.g.
    ``spiffe://tandem/prefill/prefill-0`` (a SPIFFE ID: the form cert-manager's CSI driver and
    SPIRE issue too)."""
    return f"{INSTANCE_URI_PREFIX}{role}/{instance}"


def init_certs(directory: str, extra_names: Sequence[str] = (), days: int = 825) -> list[Path]:
    """Make a development CA and one certificate per role in ``directory`` (created; existing
    files are overwritten). Keys are ECDSA P-256, written with mode 0600. The role certificates
    name no instance: the gateway's serves its port; a worker registered in Redis needs a
    certificate of its own instance (:func:`issue_instance_cert`).

    Args:
        directory: where to write.
        extra_names: more DNS names or IP addresses for the gateway's certificate (the names its
            clients dial; :func:`split_names` reads them from a setting).
        days: validity of every certificate, days.

    Returns:
        The written files.

    Raises:
        ValueError: an extra name is neither an IP address nor a DNS name.
    """
    for name in extra_names:
        _check_name(name, "extra_names")
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "Tandem cluster CA")])
    ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                            data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                            crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
               .sign(ca_key, hashes.SHA256()))
    written.append(_write(out / "ca.pem", _cert_pem(ca_cert)))
    written.append(_write(out / "ca-key.pem", _key_pem(ca_key), private=True))
    for role in ROLES:
        extra = ["localhost", "127.0.0.1", "::1", *extra_names] if role == "gateway" else []
        written += _issue(ca_cert, ca_key, out, role, extra, uri=None, days=days)
    return written


def issue_instance_cert(ca_dir: str, role: str, instance: str, out_dir: str, days: int = 825) -> list[Path]:
    """Issue a certificate for one worker instance from the CA of ``ca_dir`` (a directory of
    :func:`init_certs`: ``ca.pem`` and ``ca-key.pem``) and write a TLS directory for it at
    ``out_dir``: ``ca.pem``, ``{role}.pem`` and ``{role}-key.pem`` (no CA key). The certificate
    carries the role's DNS names and the URI :func:`instance_uri` (``role``, ``instance``): the
    gateway routes to a registry entry only if the certificate on its address names its id
    (:mod:`cluster.identity`).

    Args:
        ca_dir: the CA's directory.
        role: ``prefill`` or ``decode``.
        instance: the worker id the instance registers under (``TANDEM_WORKER_ID``).
        out_dir: where to write (created).
        days: validity, days.

    Returns:
        The written files.

    Raises:
        ValueError: an unknown role, an instance id outside ``[A-Za-z0-9._-]+``, or the CA's
            files cannot be read (naming the file).
    """
    if role not in ("prefill", "decode"):
        raise ValueError(f"role must be prefill or decode, got {role!r}")
    if not _INSTANCE.fullmatch(instance):
        raise ValueError(f"instance must match [A-Za-z0-9._-]+, got {instance!r}")
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    try:
        ca_pem = (Path(ca_dir) / "ca.pem").read_bytes()
        ca_key = serialization.load_pem_private_key((Path(ca_dir) / "ca-key.pem").read_bytes(), password=None)
    except OSError as exc:
        raise ValueError(f"cannot read {exc.filename}: {exc.strerror}") from None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = [_write(out / "ca.pem", ca_pem)]
    return written + _issue(x509.load_pem_x509_certificate(ca_pem), ca_key, out, role, [],
                            uri=instance_uri(role, instance), days=days)


def _issue(ca_cert, ca_key, out: Path, role: str, extra_names: Sequence[str], uri: str | None,
           days: int) -> list[Path]:
    """Write ``{role}.pem`` and ``{role}-key.pem`` (a fresh P-256 key) signed by the CA: DNS names
    ``tandem-cluster``, ``tandem-{role}``, ``role`` and ``extra_names``, the URI ``uri`` if any."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    def san(name: str) -> x509.GeneralName:
        return x509.IPAddress(ipaddress.ip_address(name)) if _is_ip(name) else x509.DNSName(name)

    now = datetime.datetime.now(datetime.timezone.utc)
    key = ec.generate_private_key(ec.SECP256R1())
    names = [san(n) for n in dict.fromkeys([CLUSTER_NAME, role_name(role), role, *extra_names])]
    if uri is not None:
        names.append(x509.UniformResourceIdentifier(uri))
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, role_name(role))]))
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return [_write(out / f"{role}.pem", _cert_pem(cert)), _write(out / f"{role}-key.pem", _key_pem(key), private=True)]


def _write(path: Path, data: bytes, private: bool = False) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path


def _cert_pem(cert) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return cert.public_bytes(serialization.Encoding.PEM)


def _key_pem(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
