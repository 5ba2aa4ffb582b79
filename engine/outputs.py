"""What the engine returns: vLLM-style ``RequestOutput`` and ``CompletionOutput`` per request, a
``StepOutput`` (with its ``StepStats``) per step and an ``EngineStats`` snapshot of its load."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One sample of a request.

    Attributes:
        index: which of the request's ``n`` samples.
        text: the generated text, cut before a matched stop string (filled by the front end,
            :class:`engine.output_processor.OutputProcessor`; the engine core never detokenizes).
        token_ids: the generated token ids.
        finish_reason: ``"stop"`` (EOS, stop token or stop string), ``"length"`` (``max_tokens``
            or ``max_model_len``), ``"abort"``, or ``None`` while unfinished.
        stop_reason: the stop string or stop token id that ended it, if any.
        logprobs: per generated token, ``{token_id: logprob}`` with the sampled token and the
            requested top-N alternatives (natural log, untempered model distribution).
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, float]] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's state: its prompt and its samples so far.

    Attributes:
        request_id: the request's id.
        prompt: the prompt text, when the request came as text.
        prompt_token_ids: the tokenized prompt.
        num_cached_tokens: prompt tokens served from the prefix cache.
        outputs: one :class:`CompletionOutput` per sample, by index.
        finished: every sample has finished.
        pinned_block_ids: for a request added with ``pin_prompt_blocks``, the prompt blocks
            pinned so far for the caller, in position order (block ``i`` holds prompt tokens
            ``[i * block_size, (i + 1) * block_size)``); they stay allocated until
            ``EngineCore.release``.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    num_cached_tokens: int
    outputs: list[CompletionOutput]
    finished: bool
    pinned_block_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class StepStats:
    """What one step ran and where its time went (host clock, seconds).

    Attributes:
        num_seqs: sequences scheduled.
        num_decodes: of those, single-token decodes.
        num_tokens: tokens computed (prefill chunks plus decodes).
        cuda_graph_size: the captured batch size the step replayed, ``None`` when it ran eagerly.
        cuda_graph_splits: the decode kernel's split count in the replayed graph (more than
            the batch size's own for a long-tail batch, ``engine.runner.cuda_graphs``), ``None`` when eager.
        piecewise_graph_tokens: the padded token count whose piecewise graphs ran the step
            (``engine.runner.piecewise_graphs``), ``None`` when it replayed a decode graph or ran eagerly.
        prepare_s: host-side preparation: input tensors, their copies, sampling settings.
        execute_s: the model runner's whole step, the wait for the sampled tokens included.
        step_s: the engine's whole step, from its scheduling to its outputs (under async
            scheduling the next step's launch included, which overlaps this step's device time).
        completed_at: ``time.perf_counter()`` when the engine had the step's results: the
            interval between two steps' is a step's cost when steps overlap.
        num_kv_slots_used: tokens in the scheduled sequences' KV cache after the step.
        num_kv_slots_allocated: slots of the blocks those sequences hold (``block_size`` each);
            ``1 - used / allocated`` is the step's reservation waste.
        num_verifies: of the sequences, those that verified drafts (speculative decoding: one
            query of their last token and the drafts).
        num_draft_tokens: draft tokens the step verified.
        num_accepted_tokens: of those, the ones accepted.
    """

    num_seqs: int
    num_decodes: int
    num_tokens: int
    cuda_graph_size: int | None
    cuda_graph_splits: int | None
    prepare_s: float
    execute_s: float
    num_kv_slots_used: int
    num_kv_slots_allocated: int
    step_s: float = 0.0
    piecewise_graph_tokens: int | None = None
    completed_at: float = 0.0
    num_verifies: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def kind(self) -> str:
        """``"decode"`` (every sequence decodes: one token, or its last and its drafts),
        ``"prefill"`` (prompt chunks only) or ``"mixed"`` (both: chunked prefill beside the
        running batch)."""
        decodes = self.num_decodes + self.num_verifies
        if decodes == self.num_seqs:
            return "decode"
        return "prefill" if decodes == 0 else "mixed"


@dataclass(frozen=True)
class StepTotals:
    """The steps of one kind (:attr:`StepStats.kind`) an engine ran since it started.

    Attributes:
        steps: steps that ran the model.
        seconds: their wall time (:attr:`StepStats.step_s`), summed, seconds.
        tokens: the tokens they computed (prompt chunks and decodes), summed.
    """

    steps: int = 0
    seconds: float = 0.0
    tokens: int = 0

    def add(self, stats: StepStats) -> StepTotals:
        """These totals with one more step."""
        return StepTotals(self.steps + 1, self.seconds + stats.step_s, self.tokens + stats.num_tokens)


@dataclass
class StepOutput:
    """What one engine step did (vLLM's ``EngineCore.step`` returns the same pair).

    Attributes:
        outputs: every request that gained tokens, finished, or pinned more prompt blocks.
        model_executed: whether a forward pass ran; ``False`` when nothing could be scheduled
            (every waiting sequence needs blocks that reservations or pins hold), so a driver
            may sleep until something changes.
        stats: the step's :class:`StepStats` when the model ran.
    """

    outputs: list[RequestOutput]
    model_executed: bool
    stats: StepStats | None = None


@dataclass(frozen=True)
class StartupStats:
    """How long an engine took to start (seconds).

    Attributes:
        load_s: building the model and loading its weights.
        profile_s: measuring the largest step's memory to size the KV cache (CUDA).
        warmup_s: compiling every kernel variant of the eager steps (CUDA).
        cuda_graph_s: capturing the decode graphs and the piecewise ones (CUDA, unless ``enforce_eager``).
        total_s: the whole constructor.
    """

    load_s: float
    profile_s: float
    warmup_s: float
    cuda_graph_s: float
    total_s: float


@dataclass(frozen=True)
class SpecDecodingStats:
    """Speculative decoding since the engine started (vLLM's spec-decode metrics).

    Attributes:
        num_drafts: verifications: a sequence verifying its drafts in a step, counted once.
        num_draft_tokens: draft tokens verified.
        num_accepted_tokens: of those, the ones accepted.
        num_drafts_per_position: ``[i]`` verifications with a draft at position ``i`` (0: the
            first draft token).
        num_accepted_per_position: ``[i]`` of those, the ones whose draft ``i`` was accepted.
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_drafts_per_position: tuple[int, ...] = ()
    num_accepted_per_position: tuple[int, ...] = ()

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / draft tokens (0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        """Per draft position, the fraction of its drafts accepted."""
        return [a / d if d else 0.0 for a, d in zip(self.num_accepted_per_position, self.num_drafts_per_position)]

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verification yields on average: its accepted drafts plus the target's token
        after them (1 before any)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's load.

    Attributes:
        num_running: requests with a sequence in the running batch.
        num_waiting: requests queued (not yet admitted, or preempted).
        num_running_seqs, num_waiting_seqs: the same, counted in sequences.
        num_free_blocks: unreferenced KV blocks (evictable prefix-cache blocks included).
        num_total_blocks: KV blocks in the pool.
        num_pinned_requests: requests whose prompt blocks are pinned for a caller (prefill,
            until the KV transfer is done).
        prefix_cache_hit_rate: prompt tokens found in the prefix cache / prompt tokens looked up.
        num_preemptions: sequences preempted since start.
        step_totals: the steps run since start, by kind (``"decode"``, ``"prefill"``,
            ``"mixed"``; a kind not run yet is absent).
        spec_decoding: speculative decoding since start (``None``: the engine does not speculate).
    """

    num_running: int = 0
    num_waiting: int = 0
    num_running_seqs: int = 0
    num_waiting_seqs: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_pinned_requests: int = 0
    prefix_cache_hit_rate: float = 0.0
    num_preemptions: int = 0
    step_totals: dict[str, StepTotals] = field(default_factory=dict)
    spec_decoding: SpecDecodingStats | None = None
