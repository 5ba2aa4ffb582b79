"""Spot checks of received KV against a lying peer: the decode worker recomputes one sampled
block of a transferred prompt itself and compares it with the block it received, before the
sequence joins a batch.

Transport checksums and digests prove the bytes arrived as sent; they cannot prove that the
sender computed them. A prefill worker that holds a valid certificate but returns garbage KV (a
bug, a corrupted GPU, a compromised host) is caught only by computing the KV again. Doing so
for every request would be a local prefill, so a request is checked at ``kv_spot_check_rate``
(decided at Admit, :meth:`SpotChecker.wanted`; always when the gateway asks, for a peer under
suspicion). A checked request's one block ``k`` is drawn uniformly from the blocks that arrived
(not the leading ones this worker's own prefix cache held); the engine prefills the prompt's
first ``(k + 1) * block_size`` tokens as a request of its own, under a random cache salt (so no
cached block, received or not, is reused: every block is computed here), with its prompt blocks
pinned, and block ``k`` of the two is compared:

    relative error = ||received - recomputed||_2 / ||recomputed||_2    (over the block's K and V,
                                                                         every layer and head)

and the block fails when it exceeds :data:`TOLERANCE` of the precision the KV was computed in: the
KV dtype's, or bfloat16's where the matmuls run in bfloat16 over float32 KV (a GGUF model's
quantized weights on the CPU, ``engine.layers.quantized``: a prompt chunk takes a dense bfloat16
matmul or the int4 kernel by its length, so the two computations of a block differ by a few
1e-3). The same weights and the same tokens on both sides give the same KV up to rounding:
different batch shapes, chunk boundaries and kernels reorder floating-point sums, and the
difference grows through the layers.
The tolerances sit well above that and far below what garbage gives (random KV, or KV of other
tokens, has a relative error near or above 1; docs/architecture.md, "Spot checks", has the
numbers and the detection odds per rate).
"""

from __future__ import annotations

import contextlib
import logging
import random
import secrets
import time
from dataclasses import dataclass

import grpc
import torch

from cluster.metrics import WorkerMetrics
from engine.core.core_client import EngineCoreClient
from engine.sampling_params import SamplingParams
from kvtransfer import KVPool
from protos.status import StatusError

logger = logging.getLogger(__name__)

# Relative error (module docstring) a recomputed block may differ by, per KV dtype. fp32: sums
# reordered across ~30 layers stay near 1e-6; 1e-3 leaves a wide margin.
# bf16 (8-bit mantissa, unit roundoff 2^-9 = 0.2%): each layer's K/V is rounded, and the inputs
# differ by the previous layers' rounding: a few 1e-3; 5e-2 is an order of magnitude above. fp16
# as bf16 with 3 more mantissa bits. fp8 (e4m3: 3-bit mantissa, roundoff 6%; e5m2: 2 bits, 12%):
# one rounding step of a value near a boundary flips it by 2^-3 (2^-2) of itself, so the RMS
# difference of two computations is a few percent; 0.25 (0.4) still separates it from garbage (~1.4).
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 2e-2,
             torch.float8_e4m3fn: 0.25, torch.float8_e5m2: 0.4}


@dataclass(frozen=True)
class SpotCheckResult:
    """One check's outcome.

    Attributes:
        block_index: the prompt block checked (its position).
        relative_error: ``||received - recomputed|| / ||recomputed||``.
        tolerance: the dtype's bound.
    """

    block_index: int
    relative_error: float
    tolerance: float

    @property
    def passed(self) -> bool:
        return self.relative_error <= self.tolerance


class SpotChecker:
    """Draws which requests are checked and checks them.

    Args:
        engine: the worker's engine (its core computes the recomputed block).
        pool: the worker's KV pool (both blocks are read from it).
        rate: the share of transferred prompts checked, in [0, 1].
        rng: the draws (seed it in tests).

    Raises:
        ValueError: ``rate`` outside [0, 1], or a KV dtype without a tolerance.
    """

    def __init__(self, engine: EngineCoreClient, pool: KVPool, rate: float, rng: random.Random | None = None) -> None:
        if not 0 <= rate <= 1:
            raise ValueError(f"rate must be in [0, 1], got {rate}")
        if pool.layout.dtype not in TOLERANCE:
            raise ValueError(f"no spot-check tolerance for KV dtype {pool.layout.dtype}")
        self.engine, self.pool, self.rate = engine, pool, rate
        computed_in = torch.bfloat16 if engine.info.quantization == "gguf" else pool.layout.dtype
        self.tolerance = max(TOLERANCE[pool.layout.dtype], TOLERANCE[computed_in])
        self._rng = rng or random.Random()

    def wanted(self, asked: bool) -> bool:
        """Whether to check a request being admitted (``asked``: the gateway asks for it)."""
        return asked or self._rng.random() < self.rate

    async def check(self, request_id: str, prompt: list[int], block_ids: list[int],
                    num_cached: int) -> SpotCheckResult | None:
        """Recompute one received block of ``prompt`` and compare (module docstring).

        Args:
            request_id: the checked request's (the check's engine request is named after it).
            prompt: the prompt's token ids.
            block_ids: the reservation's blocks, in position order (owned by the caller, not
                written meanwhile).
            num_cached: leading positions that came from this worker's prefix cache.

        Returns:
            The outcome, or ``None`` when no full block arrived (nothing to check) or the
            recomputation was aborted (the worker is shutting down).

        Raises:
            engine.core.core_client.EngineError: the engine failed (nothing of the check stays
                allocated).
        """
        block_size = self.engine.info.block_size
        received = range(num_cached, len(prompt) // block_size)
        if not received:
            return None
        k = self._rng.choice(received)
        check_id = f"{request_id}-spot-check-{secrets.token_hex(4)}"
        final = None
        try:
            outputs = self.engine.generate(check_id, prompt[:(k + 1) * block_size], SamplingParams(max_tokens=1, temperature=0.0),
                                           pin_prompt_blocks=True, cache_salt=f"spot-check-{secrets.token_hex(16)}")
            async with contextlib.aclosing(outputs) as stream:
                async for final in stream:
                    pass
            if final is None or len(final.pinned_block_ids) <= k:  # aborted (the worker is stopping)
                logger.warning("spot check of block %d not run: its recomputation was aborted", k)
                return None
            recomputed = self.pool.gather([final.pinned_block_ids[k]]).float()
            got = self.pool.gather([block_ids[k]]).float()
            error = (torch.linalg.vector_norm(got - recomputed) /
                     torch.linalg.vector_norm(recomputed).clamp_min(torch.finfo(torch.float32).tiny)).item()
        finally:
            self.engine.release(check_id)  # unpins the recomputed blocks; a no-op if none
        return SpotCheckResult(k, error, self.tolerance)


async def spot_check(checker: SpotChecker, engine: EngineCoreClient, metrics: WorkerMetrics, request_id: str,
                     prompt: list[int], block_ids: list[int], num_cached: int) -> None:
    """Check a claimed reservation's KV before the request decodes (:meth:`SpotChecker.check`),
    counting the outcome; on a mismatch, or any failure of the check, the blocks are freed.

    Raises:
        StatusError: ``DATA_LOSS`` naming the block and its error: the sender's KV is not what
            its prompt gives (the gateway fails the request over and quarantines the sender).
    """
    started = time.perf_counter()
    try:
        result = await checker.check(request_id, prompt, block_ids, num_cached)
    except BaseException:
        engine.free_blocks(block_ids)
        raise
    if result is None:
        return
    metrics.kv_spot_check_seconds.observe(time.perf_counter() - started)
    metrics.kv_spot_checks.labels("passed" if result.passed else "failed").inc()
    if not result.passed:
        engine.free_blocks(block_ids)
        logger.error("KV spot check failed: prompt block %d differs from its recomputation by %.3g (relative, "
                     "tolerance %.3g)", result.block_index, result.relative_error, result.tolerance)
        raise StatusError(grpc.StatusCode.DATA_LOSS,
                          f"kv spot check: prompt block {result.block_index} of the received KV differs from its "
                          f"recomputation by {result.relative_error:.3g} (relative; tolerance {result.tolerance:.3g})")
