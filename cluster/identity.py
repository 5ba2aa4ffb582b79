"""A worker's identity is its certificate: a registry entry is trusted only if the certificate
served on the entry's address names the entry's worker id.

Registry entries are written by whoever holds the Redis password, and every worker of a role
holds a certificate the role checks accept (``cluster.tls.PeerRoleInterceptor``, the channels'
``tandem-{role}`` name). A stolen prefill key and the password would otherwise register a
second prefill worker under any name and be sent prompts. Per-instance certificates
(``cluster.tls.issue_instance_cert``) carry ``spiffe://tandem/{role}/{instance}``;
:class:`InstanceVerifier` completes a TLS handshake with the entry's address (the cluster CA
verifies the chain, this process's certificate is presented as the worker port requires),
reads the URI and refuses the entry unless it names the entry's role and id. A worker checks its
own certificate the same way at startup (:func:`check_own_instance`), so a misnamed one fails
there and not at the gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections.abc import Callable
from pathlib import Path

from cluster.registry import WorkerInfo
from cluster.tls import INSTANCE_URI_PREFIX, instance_uri

logger = logging.getLogger(__name__)

_MAX_VERDICTS = 4096  # cached verdicts at most before the expired ones are dropped


def certificate_instances(cert: bytes, role: str) -> list[str]:
    """The instances of ``role`` a certificate names (its ``spiffe://tandem/{role}/{id}`` URIs).

    Args:
        cert: the certificate, PEM or DER bytes.

    Raises:
        ValueError: the bytes are not a certificate.
    """
    from cryptography import x509

    parsed = (x509.load_pem_x509_certificate(cert) if cert.lstrip().startswith(b"-----")
              else x509.load_der_x509_certificate(cert))
    try:
        uris = parsed.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
            x509.UniformResourceIdentifier)
    except x509.ExtensionNotFound:
        return []
    prefix = f"{INSTANCE_URI_PREFIX}{role}/"
    return [uri.removeprefix(prefix) for uri in uris if uri.startswith(prefix)]


def check_own_instance(tls_dir: str, role: str, worker_id: str, setting: str) -> None:
    """Refuse to register under ``worker_id`` with a certificate that does not name it.

    Raises:
        ValueError: ``{tls_dir}/{role}.pem`` names no instance or another one (the message names
            ``setting``, the URI wanted and the command that issues it).
    """
    try:
        named = certificate_instances((Path(tls_dir) / f"{role}.pem").read_bytes(), role)
    except OSError as exc:
        raise ValueError(f"{setting}: cannot read {exc.filename}: {exc.strerror}") from None
    if worker_id not in named:
        raise ValueError(f"{setting}: {role}.pem names instance(s) {named or 'none'}, this worker registers as "
                         f"{worker_id!r}: the gateway would refuse it (issue one naming {instance_uri(role, worker_id)} "
                         f"with `tandem certs issue CA_DIR {role} {worker_id} --out DIR`, or set the worker id to "
                         f"the certificate's)")


class InstanceVerifier:
    """Checks that the certificate on a registry entry's address names the entry (module docstring),
    caching each verdict: a match for ``verified_ttl_s`` seconds, a refusal or a failed handshake
    for ``retry_s`` (a worker still starting is accepted at a later refresh).

    Args:
        tls_dir: this process's TLS directory (``ca.pem``, ``{own_role}.pem``, ``{own_role}-key.pem``).
        own_role: whose certificate to present (``gateway``).
        timeout_s: seconds one handshake may take.
        verified_ttl_s: seconds a match is trusted before the next handshake.
        retry_s: seconds before a refused or unreachable entry is tried again.
        clock: monotonic seconds (injected in tests).
    """

    def __init__(self, tls_dir: str, own_role: str, timeout_s: float = 2.0, verified_ttl_s: float = 300.0,
                 retry_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.paths = tuple(Path(tls_dir) / name for name in ("ca.pem", f"{own_role}.pem", f"{own_role}-key.pem"))
        self.timeout_s, self.verified_ttl_s, self.retry_s = timeout_s, verified_ttl_s, retry_s
        self._clock = clock
        self._verdicts: dict[tuple[str, str, str], tuple[str | None, float]] = {}

    async def refusal(self, worker: WorkerInfo) -> str | None:
        """Why ``worker``'s entry is not trusted (``None``: the certificate on its address names it)."""
        key = (worker.worker_id, str(worker.role), worker.address)
        now = self._clock()
        cached = self._verdicts.get(key)
        if cached is not None and cached[1] > now:
            return cached[0]
        reason = await self._check(worker)
        if len(self._verdicts) >= _MAX_VERDICTS:  # entries of workers long gone
            self._verdicts = {k: v for k, v in self._verdicts.items() if v[1] > now}
        self._verdicts[key] = (reason, now + (self.verified_ttl_s if reason is None else self.retry_s))
        return reason

    async def trusted(self, workers: list[WorkerInfo]) -> list[WorkerInfo]:
        """The entries of ``workers`` whose address presents their instance's certificate; each
        refusal that is new (not the cached verdict) is logged."""
        now = self._clock()
        fresh = {w.worker_id for w in workers
                 if (cached := self._verdicts.get((w.worker_id, str(w.role), w.address))) is None or cached[1] <= now}
        reasons = await asyncio.gather(*(self.refusal(w) for w in workers))
        for worker, reason in zip(workers, reasons):
            if reason is not None and worker.worker_id in fresh:
                logger.warning("not trusting %s worker %s: it %s", worker.role, worker.worker_id, reason)
        return [w for w, reason in zip(workers, reasons) if reason is None]

    async def _check(self, worker: WorkerInfo) -> str | None:
        try:
            cert = await asyncio.wait_for(self._peer_certificate(worker.address), self.timeout_s)
        except (OSError, ssl.SSLError, asyncio.TimeoutError) as exc:
            return f"completed no TLS handshake with a cluster certificate on {worker.address} ({exc!r})"
        named = certificate_instances(cert, str(worker.role))
        if worker.worker_id not in named:
            return (f"presents a certificate on {worker.address} that names {worker.role} instance(s) "
                    f"{named or 'none'}, not {worker.worker_id!r}")
        return None

    async def _peer_certificate(self, address: str) -> bytes:
        """The DER certificate the server at ``address`` presents, verified against the CA."""
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(self.paths[0]))
        context.check_hostname = False  # the name that matters is the instance URI, checked by the caller
        context.load_cert_chain(self.paths[1], self.paths[2])
        context.set_alpn_protocols(["h2"])
        host, _, port = address.rpartition(":")
        _, writer = await asyncio.open_connection(host.strip("[]"), int(port), ssl=context,
                                                  server_hostname="tandem-cluster")
        try:
            return writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        finally:
            writer.close()
            with contextlib.suppress(OSError, ssl.SSLError):
                await writer.wait_closed()
