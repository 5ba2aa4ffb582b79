"""The request path every public API shares: a ``tandem.v1.GenerateRequest`` in (as the client
sent it, or as a protocol adapter translated it), its ``GenerateResponse`` messages out.

:meth:`FrontEnd.respond` checks and tokenizes the request (:mod:`gateway.request`), builds its
output (:mod:`gateway.output`: detokenization, stop strings, usage), hands both to the
orchestrator, and keeps the request's log lines, trace attributes and metrics. Every failure
reaches the adapter as one type, :class:`protos.status.StatusError` (``INTERNAL`` for an
unexpected error, which is logged); the adapter answers it in its protocol's terms, renaming the
native field an ``INVALID_ARGUMENT`` names into its own (:func:`renamed`). tandem.v1
(:mod:`gateway.server`), KServe v2 (:mod:`gateway.kserve`) and OpenAI's HTTP API
(:mod:`gateway.openai_api`) are adapters over it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping

import grpc

from cluster import tracing
from cluster.log import request_id_var
from cluster.server import Admission
from gateway import metrics
from gateway.auth import Tenant
from gateway.orchestrator import Orchestrator
from gateway.output import RequestOutput
from gateway.request import Intake
from protos.status import StatusError
from protos.tandem.v1 import gateway_pb2

logger = logging.getLogger(__name__)

# A call cancelled this close to its deadline was ended by the deadline (clocks and the network differ).
_DEADLINE_SLACK_S = 0.25


class FrontEnd:
    """Checks, runs and streams back requests of every API.

    Args:
        intake: checks and tokenizes requests.
        orchestrator: drives them through the cluster.

    Attributes:
        admission: open while the gateway takes new requests; counts those in flight (drain).
    """

    def __init__(self, intake: Intake, orchestrator: Orchestrator) -> None:
        self.intake = intake
        self.model = intake.model
        self.orchestrator = orchestrator
        self.admission = Admission()

    @property
    def routable(self) -> bool:
        """Whether a request can be routed now (a decode worker can take one)."""
        return self.intake.view.routable

    async def respond(self, request: gateway_pb2.GenerateRequest, tenant: Tenant | None,
                       time_remaining: Callable[[], float | None],
                       on_prompt: Callable[[int], None] | None = None) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        """Serve one request: the checks, tokenization and orchestration, with its log lines and
        metrics; the responses are streamed.

        Args:
            request: as the client sent it, or as a protocol adapter translated it.
            tenant: the caller (``None``: the gateway is open).
            time_remaining: seconds until the client's deadline (``None``: none).
            on_prompt: called with the prompt's token count once it is checked, before routing.

        Raises:
            StatusError: the status the client gets.
        """
        started = time.monotonic()
        status = grpc.StatusCode.OK
        metrics.IN_FLIGHT.inc()
        try:
            request_id = self.intake.request_id(request)  # checked before it is written in a log line
            request_id_var.set(request_id)
            tracing.annotate({"tandem.request_id": request_id, "tandem.tenant": tenant.name if tenant else "-"})
            self.admission.check()
            with self.admission.track():
                with tracing.span("validate_and_tokenize") as validated:
                    checked = await self.intake.check_request(request, request_id, tenant)
                    tracing.annotate({"tandem.prompt_tokens": len(checked.prompt), "tandem.n": checked.params.n,
                                      "tandem.max_tokens": checked.params.max_tokens}, validated)
                if on_prompt is not None:
                    on_prompt(len(checked.prompt))
                logger.info("generate: %d prompt tokens, n=%d, max_tokens=%d, tenant %s", len(checked.prompt),
                            checked.params.n, checked.params.max_tokens, tenant.name if tenant else "-")
                params, pool = checked.params, checked.pool
                output = RequestOutput(request_id, self.model.tokenizer, checked.prompt, params.stop, params.n,
                                       min(params.max_tokens, pool.max_model_len - len(checked.prompt)))
                async with contextlib.aclosing(self.orchestrator.drive(checked, output, time_remaining)) as stream:
                    async for response in stream:
                        yield response
        except StatusError as exc:
            status = exc.code
            logger.info("generate failed: %s %s", exc.code.name, exc.message)
            raise
        except (asyncio.CancelledError, GeneratorExit):
            # gRPC cancels the call both when the client goes and when its deadline passes; the
            # client's own timer often fires first and its RST_STREAM arrives a little early.
            left = time_remaining()
            status = (grpc.StatusCode.DEADLINE_EXCEEDED if left is not None and left <= _DEADLINE_SLACK_S
                      else grpc.StatusCode.CANCELLED)
            logger.info("client %s", "deadline passed" if status == grpc.StatusCode.DEADLINE_EXCEEDED else "cancelled")
            raise
        except Exception:
            status = grpc.StatusCode.INTERNAL
            logger.exception("generate failed")
            raise StatusError(status, "internal error (see the gateway log)") from None
        finally:
            metrics.IN_FLIGHT.dec()
            metrics.REQUESTS.labels(status.name).inc()
            metrics.E2E.observe(time.monotonic() - started)
            if status == grpc.StatusCode.OK:
                logger.info("generate done in %.3f s", time.monotonic() - started)


def renamed(error: StatusError, names: Mapping[str, str]) -> StatusError:
    """``error`` naming an API's own field instead of the native one it starts with.

    Args:
        error: a refusal of the request path (``INVALID_ARGUMENT`` messages start with the
            native field: ``prompt: ...``, ``sampling.top_p: ...``).
        names: native field prefix → the API's name, tried in order (``{"sampling.": ""}``
            turns ``sampling.top_p`` into ``top_p``; ``{"prompt": "text_input"}`` renames a
            whole field).

    Returns:
        The error with the first matching prefix replaced (the same error when none matches).
    """
    message = error.message
    for native, name in names.items():
        if message.startswith(native) and (native.endswith(".") or message[len(native):][:1] in (":", ".", "[")):
            return StatusError(error.code, name + message.removeprefix(native))
    return error
