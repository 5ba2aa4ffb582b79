"""The engine core: requests in, one step at a time, token outputs out.

``EngineCore.step`` runs scheduler → model runner → sampled tokens → scheduler, and decides when a
sample is finished from its tokens alone (EOS, stop token ids, ``max_tokens``, ``max_model_len``).
Text and stop strings are the front end's (:mod:`engine.output_processor` offline, the gateway
when serving), as in vLLM's core / front-end split. Both workers and the offline
:class:`engine.LLM` drive it.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from engine.block_hash import hash_seed
from engine.config import EngineConfig, resolve_async_scheduling, resolve_disable_by_batch_size
from engine.core.block_pool import BlockPool, cdiv
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from engine.core.sequence import Sequence
from engine.core.stop import check_stop
from engine.loading.quantized_loader import resolve_quantization
from engine.model_source import gguf_file
from engine.outputs import CompletionOutput, EngineStats, RequestOutput, SpecDecodingStats, StepOutput, StepTotals
from engine.parallel.distributed import RankFailedError
from engine.parallel.tp_ranks import FollowerRanks
from engine.runner.devices import resolve_device, resolve_dtype, resolve_kv_cache_dtype, use_device
from engine.runner.grammar import Grammars
from engine.runner.logits_processors import LogitsProcessors
from engine.runner.model_runner import PendingStep
from engine.runner.model_shard import PoolAllocator, build_shard
from engine.sampling_params import SamplingParams
from engine.speculative import build_proposer
from engine.speculative.acceptance import num_accepted
from engine.validation import check_prompt

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    outputs: list[CompletionOutput]
    pin_prompt_blocks: bool = False
    pinned: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)

    def to_output(self) -> RequestOutput:
        cached = max(self.seqs[0].num_cached_tokens, 0)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, cached, self.outputs,
                             self.finished, list(self.pinned))


class EngineCore:
    """A paged-KV, continuously batched engine over one model.

    Args:
        model: ``None`` (the default SmolLM2-135M-Instruct), an HF directory, a GGUF file, a
            hub id ``ORG/NAME``, a preset name or a config dict (see
            :func:`engine.model_source.resolve_model`).
        config: cache and scheduler settings.
        load_format: ``"auto"`` or ``"dummy"`` (random weights of the model's real shapes).
        allocate_pools: where the KV pools come from when another process holds them (the
            worker, which moves their blocks to and from other workers): called once with the
            pool's shape, dtype and every rank's device, it returns a
            :func:`engine.parallel.shared_memory.allocate_shared` handle per rank; ``None``:
            this process allocates them.

    With ``config.tensor_parallel_size`` > 1 this process is rank 0: it starts the other ranks
    (:mod:`engine.parallel.tp_ranks`), schedules, broadcasts each step to them and samples; call
    :meth:`shutdown` when done (it also runs when the engine is garbage-collected, or at exit).

    Attributes:
        model_id, tokenizer: the model's id and :class:`engine.tokenizer.Tokenizer` (``None``
            for presets and config dicts).
        max_model_len: tokens per sequence at most (the setting, lowered to what the KV cache
            holds).
        kv_cache_dtype: the KV cache's dtype name (``"bfloat16"``, ..., ``"fp8_e4m3"``): published
            by workers and part of the prefix cache's hash seed, so caches of other dtypes
            never share blocks or a pool.
        quantization: how the weights are held, resolved: ``"gguf"`` or ``"none"``
            (:class:`engine.config.EngineConfig`).
        kv_pools: every rank's KV cache tensor, in rank order (one without tensor parallelism):
            ``[num_blocks, kv_heads_per_rank, num_layers, 2, block_size, head_dim]`` each, rank
            ``r`` holding KV heads ``[r * kv_heads_per_rank, (r + 1) * kv_heads_per_rank)``;
            with ``allocate_pools``, rank 0's alone.
        hash_seed: the seed of the prefix cache's chained block hashes (``engine.block_hash``).
        memory_profile: on CUDA with the KV cache sized from memory, the measured
            :class:`engine.runner.profiling.MemoryProfile` (rank 0's); else ``None``.
        startup: how long start-up took, by phase (:class:`engine.outputs.StartupStats`).
        ranks: rank 0's handle on the other ranks (``None`` without tensor parallelism).

    Raises:
        ValueError: unknown model, or a setting that cannot work (e.g. too little KV memory, a
            tensor-parallel size that does not divide the model's heads).
        RuntimeError: a tensor-parallel rank failed to start.
    """

    def __init__(self, model: str | dict | None = None, config: EngineConfig | None = None,
                 load_format: str = "auto", allocate_pools: PoolAllocator | None = None) -> None:
        started = time.perf_counter()
        self.config = config = config or EngineConfig()
        self.device = resolve_device(config.device)
        use_device(self.device)
        self.quantization = resolve_quantization(config.quantization, gguf_file(model) if load_format != "dummy" else None,
                                                 self.device, config.tensor_parallel_size)
        self.dtype = resolve_dtype(config.dtype, self.device)
        torch.manual_seed(config.seed)
        self.ranks = FollowerRanks(model, config, load_format, self.device) if config.tensor_parallel_size > 1 else None
        try:
            shard = build_shard(model, config, load_format, self.device, self.dtype,
                                self.ranks.group if self.ranks else None, self.ranks.store if self.ranks else None,
                                started, self.quantization, allocate_pools)
        except BaseException:
            if self.ranks is not None:
                self.ranks.close()
            raise
        loaded = shard.loaded
        self.model, self.model_config = loaded.model, loaded.config
        self.model_id, self.tokenizer = loaded.model_id, loaded.tokenizer
        self.eos_token_ids = set(loaded.config.eos_token_id)
        self.vocab_size = loaded.config.vocab_size
        self.num_blocks, self.max_model_len = shard.num_blocks, shard.max_model_len
        self.memory_profile, self.startup = shard.memory_profile, shard.startup
        self.kv_cache, self.kv_pools, self.runner = shard.kv_cache, shard.kv_pools, shard.runner

        bs = config.block_size
        self.block_pool = BlockPool(self.num_blocks)
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype)[0]
        self.hash_seed = hash_seed(self.model_id, bs, self.kv_cache_dtype, self.quantization)
        self.kv_manager = KVCacheManager(self.block_pool, bs, self.hash_seed, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens, self.max_model_len)
        self.grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.runner.logits = LogitsProcessors(self.vocab_size, self.device, sorted(self.eos_token_ids), self.grammars)
        self.scheduler.on_release = self._on_release
        spec = config.speculative_config
        self.proposer = build_proposer(spec, shard.draft, self.kv_manager) if spec is not None else None
        self._spec_max_batch = resolve_disable_by_batch_size(spec, self.device.type) if spec is not None else None
        # Speculative decoding's counts: drafts per position, accepted per position.
        self._spec_drafts: list[int] = [0] * (spec.num_speculative_tokens if spec else 0)
        self._spec_accepted: list[int] = [0] * len(self._spec_drafts)
        self._spec_verifications = 0
        self.requests: dict[str, _Request] = {}
        self.pinned: dict[str, list[int]] = {}  # finished requests whose pinned blocks await release
        self._arrivals = itertools.count()
        self._step_totals: dict[str, StepTotals] = {}
        # Steps launched and not completed yet, oldest first: at most two with async scheduling.
        self._in_flight: deque[tuple[SchedulerOutput, PendingStep, float]] = deque()
        self._depth = 2 if resolve_async_scheduling(config, self.device.type) else 1
        if self.ranks is not None:
            self.runner.broadcast = self.ranks.group.broadcast_step
            if self._depth == 2:
                self.runner.share_sampled = self.ranks.group.broadcast_tensor
            self._close_ranks = weakref.finalize(self, self.ranks.close)
        num_graphs = len(self.runner.graphs.graphs) if self.runner.graphs is not None else 0
        logger.info("engine ready: %s on %s (%s, KV cache %s), %d KV blocks of %d tokens (%d tokens), "
                    "max_model_len %d, tensor parallel size %d, %d CUDA graphs, start-up %.1f s", self.model_id,
                    self.device, self.dtype, self.kv_cache_dtype, self.num_blocks, bs, self.num_blocks * bs,
                    self.max_model_len, config.tensor_parallel_size, num_graphs, self.startup.total_s)

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do without them); the engine cannot
        step afterwards. Call it after the last step, from the thread that stepped."""
        if self.ranks is not None:
            self.runner.release_cuda_graphs()
            self._close_ranks()

    # ----------------------------------------------------------------- requests
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt: text is encoded with the model's tokenizer, special tokens
        added as the model's post-processor says (the rule the gateway follows too).

        Raises:
            ValueError: text given but the model has no tokenizer.
        """
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass token ids")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        """:func:`engine.validation.check_prompt` with this engine's limits (reads only settings,
        so any thread may call it).

        Raises:
            ValueError: naming ``prompt``.
        """
        check_prompt(prompt_token_ids, self.max_model_len, self.vocab_size)

    def validate_params(self, params: SamplingParams) -> None:
        """Refuse sampling parameters this engine cannot run, before the request joins a batch,
        so that one request's parameters can never fail a step shared with others (reads only
        settings, so any thread may call it).

        Raises:
            ValueError: naming the field: ``n`` above ``max_num_seqs`` (its samples could never
                all run), ``logprobs`` above the vocabulary size, a stop token id, a
                ``logit_bias`` key or a bad word's token outside the vocabulary, a structured
                output this engine cannot compile (``json_schema``, ``regex``, ``choice``,
                ``grammar``: it is compiled here, and cached).
        """
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"n must be <= max_num_seqs={self.config.max_num_seqs}, got {params.n}")
        if params.logprobs > self.vocab_size:
            raise ValueError(f"logprobs must be <= vocab_size={self.vocab_size}, got {params.logprobs}")
        for name, tokens in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias),
                             ("bad_words_token_ids", [t for word in params.bad_words_token_ids for t in word])):
            bad = next((t for t in tokens if t >= self.vocab_size), None)
            if bad is not None:
                raise ValueError(f"{name} has {bad}, not below vocab_size={self.vocab_size}")
        if params.structured_output is not None:
            self.grammars.compile(params.structured_output)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    pin_prompt_blocks: bool = False, release_blocks: list[int] = (), cache_salt: str = "",
                    block_hashes: list[bytes] | None = None) -> list[int]:
        """Queue a request. Nothing is allocated until the scheduler admits it.

        Args:
            request_id: unique among the engine's requests.
            prompt: text or token ids.
            params: how to sample.
            pin_prompt_blocks: pin each prompt block for the caller as soon as its KV is
                computed (the last, partial one when the whole prompt is); pinned blocks outlive
                the request until :meth:`release` (a prefill worker streams them to a decode
                worker meanwhile). Outputs are also emitted when more blocks are pinned.
            release_blocks: a reservation (``reserve_blocks``) the request replaces: freed as
                it is queued, in the same step, so the scheduler finds its cached blocks again and
                its free ones are the request's to take (a decode worker prefilling locally).
            cache_salt: the tenant's salt of the prefix cache's block hashes (``""``: none).
            block_hashes: the token-id prompt's :meth:`block_hashes` under ``cache_salt``, when
                the caller has them (``None``: computed on this thread when first needed).

        Returns:
            The prompt's token ids.

        Raises:
            ValueError: empty or too long prompt, duplicate ``request_id``, ``block_hashes`` not
                one per full block; ``release_blocks`` are freed all the same.
        """
        self.free_blocks(list(release_blocks))
        req = self._new_request(request_id, prompt, params, cache_salt, block_hashes)
        req.pin_prompt_blocks = pin_prompt_blocks
        self.scheduler.add(req.seqs[0])
        return req.prompt_token_ids

    def _new_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                     cache_salt: str = "", block_hashes: list[bytes] | None = None,
                     first_token_ids: list[int] = ()) -> _Request:
        if request_id in self.requests or request_id in self.pinned:
            raise ValueError(f"request_id {request_id!r} is already in use")
        token_ids = self.tokenize(prompt)
        self.validate_prompt(token_ids)
        self.validate_params(params)
        self._check_block_hashes(token_ids, block_hashes)
        self._check_output_so_far(token_ids, params, first_token_ids)
        arrival = next(self._arrivals)
        seqs = [Sequence(request_id, i, list(token_ids), len(token_ids), params, arrival,
                         block_hashes=list(block_hashes or ()), cache_salt=cache_salt) for i in range(params.n)]
        seqs[0].forks = seqs[1:]
        req = _Request(request_id, prompt if isinstance(prompt, str) else None, token_ids, params,
                       seqs, [CompletionOutput(i) for i in range(params.n)])
        self.requests[request_id] = req
        return req

    def _check_output_so_far(self, prompt_token_ids: list[int], params: SamplingParams,
                             first_token_ids: list[int]) -> None:
        """Refuse a request whose output so far (its resumed tokens, the prompt's last
        ``num_resumed_tokens``, then each sample's first token) is not one its structured
        output allows, before it joins a batch.

        Raises:
            ValueError: naming ``num_resumed_tokens`` (not below the prompt's length),
                ``prompt_token_ids`` or ``first_token_ids``.
        """
        resumed = params.num_resumed_tokens
        if resumed >= len(prompt_token_ids):
            raise ValueError(f"num_resumed_tokens must be below the prompt's {len(prompt_token_ids)} tokens, "
                             f"got {resumed}")
        spec = params.structured_output
        if spec is None:
            return
        output = prompt_token_ids[len(prompt_token_ids) - resumed:]
        if not first_token_ids:
            self.grammars.replay(spec, output, "prompt_token_ids")
        for token in dict.fromkeys(first_token_ids):
            self.grammars.replay(spec, output + [token], "first_token_ids")

    def stop_sample(self, request_id: str, index: int, stop_reason: str) -> None:
        """End sample ``index`` of a request with ``finish_reason="stop"`` because the front end
        matched the stop string ``stop_reason`` in its text; its blocks are freed. A request
        whose samples have all finished leaves the engine."""
        req = self.requests.get(request_id)
        if req is None or req.outputs[index].finished:
            return
        out = req.outputs[index]
        out.finish_reason, out.stop_reason = "stop", stop_reason
        self.scheduler.finish(req.seqs[index])
        if req.finished:
            self._retire(req)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free all its blocks, pinned ones included. Returns its final
        output (``finish_reason`` ``"abort"`` for unfinished samples), or ``None`` when no
        request of that id is live (its pins, if any, are released all the same)."""
        self.release(request_id)
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        for seq, out in zip(req.seqs, req.outputs):
            if not seq.is_finished:
                self.scheduler.finish(seq)
            if out.finish_reason is None:
                out.finish_reason = "abort"
        return req.to_output()

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------- disaggregated serving
    def release(self, request_id: str) -> bool:
        """Unpin the prompt blocks pinned for a request (see ``pin_prompt_blocks``).

        Returns:
            Whether any were pinned.
        """
        req = self.requests.get(request_id)
        pinned = self.pinned.pop(request_id, None) or (req.pinned if req is not None else [])
        if req is not None:
            req.pinned, req.pin_prompt_blocks = [], False
        self.kv_manager.release_blocks(pinned)
        return bool(pinned)

    def block_hashes(self, prompt_token_ids: list[int], cache_salt: str = "") -> list[bytes]:
        """The chained hashes of the prompt's full blocks under ``cache_salt`` (16 bytes each),
        as the prefix cache keys them. Any thread may call it, also while a step runs: a caller
        off the engine thread hashes a long prompt there and passes the hashes to
        :meth:`reserve_blocks`, :meth:`add_request` or :meth:`add_prefilled_request`, which
        then skip it (250 blocks a 4000-token prompt, once per call)."""
        return self.kv_manager.block_hashes(prompt_token_ids, cache_salt)

    def _check_block_hashes(self, prompt_token_ids: list[int], block_hashes: list[bytes] | None) -> None:
        full = len(prompt_token_ids) // self.config.block_size
        if block_hashes is not None and len(block_hashes) != full:
            raise ValueError(f"block_hashes has {len(block_hashes)} hashes for {full} full blocks")

    def reserve_blocks(self, prompt_token_ids: list[int], cache_salt: str = "",
                       block_hashes: list[bytes] | None = None,
                       params: SamplingParams | None = None) -> tuple[list[int], int]:
        """Reserve the blocks of a prompt whose KV another worker will send (or this one will
        compute, see ``add_request(release_blocks=...)``), reusing the leading full blocks the
        prefix cache holds under ``cache_salt`` (``KVCacheManager.reserve``). ``block_hashes``:
        the prompt's :meth:`block_hashes`, when the caller has them. ``params``: the request's
        sampling parameters, checked first (:meth:`validate_params`: a structured output is
        compiled), so a request this engine would refuse holds no block.

        Admission control: one free block per running or waiting sequence stays free as
        headroom, so a new reservation never forces the running batch into preemption at its
        next block boundary; back-pressure goes to the caller instead.

        Returns:
            ``(block_ids, num_cached)``: a block per prompt position, the first ``num_cached``
            already holding their KV.

        Raises:
            engine.core.block_pool.NoFreeBlocksError: the pool cannot hold them now.
            ValueError: ``block_hashes`` not one per full block; ``params`` refused (naming
                the field).
        """
        if params is not None:
            self.validate_params(params)
        self._check_block_hashes(prompt_token_ids, block_hashes)
        headroom = len(self.scheduler.running) + len(self.scheduler.waiting)
        return self.kv_manager.reserve(prompt_token_ids, headroom, cache_salt, block_hashes)

    def free_blocks(self, block_ids: list[int]) -> None:
        """Return reserved blocks that never became a request (an expired lease, an abort)."""
        self.kv_manager.release_blocks(block_ids)

    def add_prefilled_request(
        self, request_id: str, prompt_token_ids: list[int], first_token_ids: list[int],
        params: SamplingParams, block_ids: list[int], cache_salt: str = "",
        block_hashes: list[bytes] | None = None,
    ) -> RequestOutput:
        """Join a request whose prompt KV already fills ``block_ids`` (from :meth:`reserve_blocks`)
        to the running batch, with the first token of each of its ``n`` samples sampled by the
        prefill worker. The request takes ownership of ``block_ids``; its samples share them.

        A seeded sample's noise is a function of its seed, index and position
        (:mod:`engine.runner.sampler`), so its tokens equal those of the same request run on one engine.

        ``cache_salt`` must be the one the blocks were reserved under (their full blocks join the
        prefix cache under it, keyed by ``block_hashes``, the prompt's :meth:`block_hashes` when
        the caller has them; ``None``: computed here).

        Returns:
            The request's output so far (finished if a first token already ended it).

        Raises:
            ValueError: wrong number of first tokens, blocks or block hashes, or a bad prompt;
                the blocks are then still the caller's.
        """
        if len(first_token_ids) != params.n:
            raise ValueError(f"first_token_ids has {len(first_token_ids)} tokens for n={params.n}")
        if not all(0 <= t < self.vocab_size for t in first_token_ids):
            raise ValueError(f"first_token_ids must be in [0, {self.vocab_size})")
        if len(block_ids) != cdiv(len(prompt_token_ids), self.config.block_size):
            raise ValueError(f"block_ids has {len(block_ids)} blocks for {len(prompt_token_ids)} tokens")
        req = self._new_request(request_id, prompt_token_ids, params, cache_salt, block_hashes, first_token_ids)
        self.kv_manager.adopt(req.seqs, block_ids, len(prompt_token_ids))
        for seq, token_id in zip(req.seqs, first_token_ids):
            seq.forks = []
            self.scheduler.add_running(seq)
            self._append_token(req, seq, token_id, {})
        if req.finished:
            del self.requests[request_id]
        return req.to_output()

    # ------------------------------------------------------------------- steps
    def step(self) -> StepOutput:
        """Run one iteration: launch the next step, if one can be scheduled, and complete the
        oldest step in flight.

        With async scheduling (``EngineConfig.async_scheduling``, on CUDA by default) two steps
        are in flight at once: step N+1 is scheduled and launched while step N runs on the
        device, and step N's results are processed after that launch, so the device never
        waits for the host between them; a call then returns the outputs of the step launched
        by the call before. Without it each call launches a step and completes it. The step in
        flight completes before the next one is scheduled, so that those steps run without the
        overlap, while a structured-output sequence runs (its grammar matcher needs each token),
        while the engine speculates (drafts are proposed from the tokens on the host) and after
        a verification (where its sequences go on depends on the drafts accepted).

        Returns:
            The outputs of every request that gained tokens, finished, or pinned more prompt
            blocks in the completed step (cumulative: each ``CompletionOutput`` holds all tokens
            so far), and whether a step was launched or completed. Finished requests leave the
            engine and their blocks are freed (pinned ones stay until :meth:`release`).

        Raises:
            RankFailedError: a tensor-parallel rank died or a step's collective failed: this and
                every later step fail (abort the requests and shut the engine down).
        """
        if self.ranks is not None and self.ranks.failure is not None:
            raise RankFailedError(self.ranks.failure)
        launched, completed = False, None
        if len(self._in_flight) < self._depth:
            if self._in_flight and self._needs_tokens_on_host(self._in_flight[-1][0]):
                completed = self._complete(*self._in_flight.popleft())
            started = time.perf_counter()
            step = self.scheduler.schedule(self._propose() if self._speculates() else None)
            if not step.is_empty:
                self._in_flight.append((step, self._guard(self.runner.launch, step), started))
                launched = True
        if completed is not None:
            return completed
        if self._in_flight and (len(self._in_flight) == self._depth or not launched):
            return self._complete(*self._in_flight.popleft())
        return StepOutput([], launched)

    @property
    def async_scheduling(self) -> bool:
        """Whether a step is launched before the one ahead of it completes (``EngineConfig.async_scheduling``)."""
        return self._depth == 2

    @property
    def has_steps_in_flight(self) -> bool:
        """Whether a launched step has not completed yet (:meth:`step` completes it)."""
        return bool(self._in_flight)

    def _guard(self, fn: Callable[..., T], *args) -> T:
        """``fn(*args)``, a failure of a tensor-parallel step turned into ``RankFailedError``."""
        try:
            result = fn(*args)
        except Exception as exc:
            if self.ranks is None:
                raise
            # Any failure of a tensor-parallel step leaves the ranks out of step with each other.
            raise RankFailedError(self.ranks.explain(exc)) from exc
        if self.ranks is not None and self.ranks.failure is not None:
            # A rank died during the step: its aborted collectives returned, with garbage.
            raise RankFailedError(self.ranks.failure)
        return result

    def _complete(self, step: SchedulerOutput, pending: PendingStep, started: float) -> StepOutput:
        """Wait for a launched step's results and account for them: computed blocks join the
        prefix cache, prompt blocks are pinned, fork children join, sampled tokens are appended
        and stop conditions checked. A sequence that ended (or was preempted) while the step
        was in flight keeps nothing of it but, when preempted, its sampled token."""
        result = self._guard(pending.result)
        touched: dict[str, _Request] = {}
        bs, caching = self.config.block_size, self.config.enable_prefix_caching
        for s in step.scheduled:
            computed = s.num_computed_after
            # Only a step that fills a block (or pins one) has prefix-cache or pin work.
            if s.start // bs == computed // bs and computed != s.seq.num_prompt_tokens or s.stale or s.spec_token_ids:
                continue  # (a verify row's blocks are cached once its accepted tokens are known)
            if caching:
                self.kv_manager.cache_computed_blocks(s.seq, computed)
            req = self.requests[s.seq.request_id]
            if req.pin_prompt_blocks and self._pin_computed_prompt_blocks(req, s.seq, computed):
                touched[req.request_id] = req
        self.scheduler.complete(step)
        verified = {s.seq: s for s in step.scheduled if s.spec_token_ids}
        num_drafted = num_kept = 0
        row, seqs = 0, result.sequences
        while row < len(seqs):
            seq = seqs[row]
            s = verified.get(seq)
            count = 1 + len(s.spec_token_ids) if s is not None else 1  # a verify row's rows are adjacent
            tokens, logprobs = result.token_ids[row:row + count], result.logprobs[row:row + count]
            row += count
            seq.num_output_placeholders -= 1
            req = self.requests.get(seq.request_id)
            if seq.is_finished or req is None or req.seqs[seq.index] is not seq:
                continue  # ended while the step was in flight: the token is past its end
            if s is not None:
                accepted = self._accept(s, tokens)
                num_drafted += len(s.spec_token_ids)
                num_kept += accepted
                tokens, logprobs = tokens[:accepted + 1], logprobs[:accepted + 1]
            for token_id, token_logprobs in zip(tokens, logprobs):
                self._append_token(req, seq, token_id, token_logprobs)
                if seq.is_finished:
                    break  # a stop inside an accepted run: the rest is past the sample's end
            if s is not None and caching and not seq.is_finished:
                self.kv_manager.cache_computed_blocks(seq)
            touched[req.request_id] = req
        outputs = []
        for req in touched.values():
            outputs.append(req.to_output())
            if req.finished:
                self._retire(req)
        now = time.perf_counter()
        stats = dataclasses.replace(result.stats, step_s=now - started, completed_at=now,
                                    num_verifies=len(verified), num_draft_tokens=num_drafted,
                                    num_accepted_tokens=num_kept)
        self._step_totals[stats.kind] = self._step_totals.get(stats.kind, StepTotals()).add(stats)
        return StepOutput(outputs, True, stats)

    def _needs_tokens_on_host(self, in_flight: SchedulerOutput) -> bool:
        """Whether the next step is scheduled only once ``in_flight``'s tokens are on the host: a
        structured sequence's token bitmask follows its output to the last token, drafts are
        proposed from the tokens so far, and a verification's accepted drafts decide where its
        sequence goes on."""
        if self.runner.logits.num_structured:
            return True
        return self.proposer is not None and (self._speculates() or any(s.spec_token_ids for s in in_flight.scheduled))

    # ------------------------------------------------------ speculative decoding
    def _speculates(self) -> bool:
        """Whether the next step gets drafts: a proposer, and no more running sequences than
        ``disable_by_batch_size`` (resolved)."""
        return self.proposer is not None and (self._spec_max_batch is None
                                              or len(self.scheduler.running) <= self._spec_max_batch)

    def _propose(self) -> dict[Sequence, list[int]]:
        """Drafts for this step's decoding sequences, up to the engine's ``k`` or the request's
        own ``SamplingParams.num_speculative_tokens`` where that is smaller. A sequence whose
        logits are processed (penalties, bias, bad words, ``min_tokens``, structured output: their
        state follows the output token by token) decodes one token a step."""
        k = self.config.speculative_config.num_speculative_tokens
        room = {s: min(k, self.scheduler.draft_room(s), k if s.params.num_speculative_tokens is None
                       else s.params.num_speculative_tokens) for s in self.scheduler.running
                if s.num_computed_tokens == s.num_tokens - 1 and not s.num_output_placeholders
                and not s.params.processes_logits}
        seqs = [s for s, n in room.items() if n]
        if not seqs:
            return {}
        drafts = self.proposer.propose(seqs, [room[s] for s in seqs])
        return {seq: d for seq, d in zip(seqs, drafts) if d}

    def _accept(self, s: ScheduledSequence, sampled: list[int]) -> int:
        """Verify a verify row's drafts against what the target sampled at their positions
        (:func:`engine.speculative.acceptance.num_accepted`), drop the rejected ones' KV and
        count them. Returns how many drafts were accepted."""
        drafts = s.spec_token_ids
        accepted = num_accepted(drafts, sampled)
        self.kv_manager.rewind(s.seq, s.start + 1 + accepted)
        self._spec_verifications += 1
        for i in range(len(drafts)):
            self._spec_drafts[i] += 1
            self._spec_accepted[i] += i < accepted
        return accepted

    def _on_release(self, seq: Sequence) -> None:
        """A sequence was preempted or ended: the sampler's and the proposer's state for it goes
        (a proposer learns from it only while the engine speculates)."""
        self.runner.logits.release(seq)
        if self.proposer is not None:
            self.proposer.release(seq, learn=self._speculates())

    def _pin_computed_prompt_blocks(self, req: _Request, seq: Sequence, num_computed: int) -> bool:
        """Pin the prompt blocks of ``seq`` (sample 0) whose KV a completed step wrote (its first
        ``num_computed`` tokens); True if any."""
        computed = min(num_computed, seq.num_prompt_tokens)
        bs = self.config.block_size
        done = cdiv(computed, bs) if computed == seq.num_prompt_tokens else computed // bs
        new = seq.block_table[len(req.pinned):done]
        self.kv_manager.pin(new)
        req.pinned.extend(new)
        return bool(new)

    def _retire(self, req: _Request) -> None:
        del self.requests[req.request_id]
        if req.pinned:
            self.pinned[req.request_id] = req.pinned

    def _append_token(self, req: _Request, seq: Sequence, token_id: int,
                      logprobs: dict[int, float]) -> None:
        out = req.outputs[seq.index]
        seq.token_ids.append(token_id)
        out.token_ids.append(token_id)
        out.logprobs.append(logprobs)
        finish = check_stop(req.params, token_id, seq.num_output_tokens, seq.num_tokens, self.eos_token_ids,
                            self.max_model_len)
        if finish is not None:
            out.finish_reason = finish
            out.stop_reason = token_id if token_id in req.params.stop_token_ids else None
            self.scheduler.finish(seq)

    # ------------------------------------------------------------------- stats
    def stats(self) -> EngineStats:
        """A snapshot of the engine's load (call it on the thread that steps the engine)."""
        sched = self.scheduler
        return EngineStats(
            num_running=len({s.request_id for s in sched.running}),
            num_waiting=len({s.request_id for s in sched.waiting}),
            num_running_seqs=len(sched.running),
            num_waiting_seqs=len(sched.waiting),
            num_free_blocks=self.block_pool.num_free_blocks,
            num_total_blocks=self.num_blocks,
            num_pinned_requests=len(self.pinned) + sum(bool(r.pinned) for r in self.requests.values()),
            prefix_cache_hit_rate=self.kv_manager.prefix_hit_rate,
            num_preemptions=sched.num_preemptions,
            step_totals=dict(self._step_totals),
            spec_decoding=None if self.proposer is None else SpecDecodingStats(
                self._spec_verifications, sum(self._spec_drafts), sum(self._spec_accepted),
                tuple(self._spec_drafts), tuple(self._spec_accepted)),
        )

    @property
    def num_free_blocks(self) -> int:
        """Blocks not referenced by any sequence or pin (evictable cached blocks included)."""
        return self.block_pool.num_free_blocks
