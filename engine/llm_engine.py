"""The engine: requests in, one step at a time, outputs out.

``LLMEngine.step`` runs scheduler → model runner → sampled tokens → scheduler, and turns the
tokens into text and finish decisions. Both workers and the offline :class:`engine.LLM` drive it.
"""

from __future__ import annotations

import gc
import itertools
import logging
from dataclasses import dataclass

import torch

from engine.attention import get_attention_backend
from engine.block_hash import hash_seed
from engine.block_pool import BlockPool
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.kv_cache import KVCache
from engine.kv_cache_manager import KVCacheManager, cdiv
from engine.layers.linear import packed_linear_available
from engine.loader import load_model
from engine.model_runner import ModelRunner
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detokenizers: list[IncrementalDetokenizer] | None
    outputs: list[CompletionOutput]
    hold_blocks: bool = False

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)

    def to_output(self) -> RequestOutput:
        cached = max(self.seqs[0].num_cached_tokens, 0)
        return RequestOutput(
            self.request_id, self.prompt, self.prompt_token_ids, cached, self.outputs, self.finished
        )


def resolve_device(name: str) -> torch.device:
    """``"auto"`` → CUDA when available, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``"auto"`` → bfloat16 on CUDA, float32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


class LLMEngine:
    """A paged-KV, continuously batched engine over one model.

    Args:
        model: ``None`` (the default SmolLM2-135M-Instruct), an HF directory, a GGUF file, a
            hub id ``ORG/NAME``, a preset name or a config dict (see :func:`engine.loader.load_model`).
        config: cache and scheduler settings.
        load_format: ``"auto"`` or ``"dummy"`` (random weights of the model's real shapes).

    Raises:
        ValueError: unknown model, or a setting that cannot work (e.g. too little KV memory).
    """

    def __init__(self, model: str | dict | None = None, config: EngineConfig | None = None,
                 load_format: str = "auto") -> None:
        self.config = config = config or EngineConfig()
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        torch.manual_seed(config.seed)
        loaded = load_model(model, dtype=self.dtype, device=self.device,
                            attn_backend=get_attention_backend(self.device), load_format=load_format)
        self.model, self.model_config = loaded.model, loaded.config
        if packed_linear_available(self.device, self.dtype):
            self.model.pack_for_cpu()
        self.model_id, self.tokenizer = loaded.model_id, loaded.tokenizer
        self.eos_token_ids = set(loaded.config.eos_token_id)

        bs = config.block_size
        self.num_blocks = config.num_blocks or self._num_blocks_from_budget()
        max_len = min(config.max_model_len or self.model_config.max_position_embeddings,
                      self.num_blocks * bs)
        if config.max_model_len and max_len < config.max_model_len:
            logger.warning("max_model_len lowered to %d: the KV cache holds %d blocks of %d tokens",
                           max_len, self.num_blocks, bs)
        self.max_model_len = max_len
        self.kv_cache = KVCache(self.model_config, self.num_blocks, bs, self.dtype, self.device)
        self.block_pool = BlockPool(self.num_blocks)
        seed = hash_seed(self.model_id, bs, str(self.dtype).removeprefix("torch."))
        self.kv_manager = KVCacheManager(self.block_pool, bs, seed, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens, self.max_model_len)
        self.runner = ModelRunner(self.model, self.kv_cache, bs, self.max_model_len)
        self.requests: dict[str, _Request] = {}
        self.held: dict[str, list[Sequence]] = {}  # finished requests whose blocks are kept
        # False after a step that could schedule nothing (every waiting sequence needs blocks
        # that reservations or held requests own): callers may sleep until something changes.
        self.last_step_ran = False
        self._arrivals = itertools.count()
        logger.info("engine ready: %s on %s (%s), %d KV blocks of %d tokens, max_model_len %d",
                    self.model_id, self.device, self.dtype, self.num_blocks, bs, self.max_model_len)

    def _num_blocks_from_budget(self) -> int:
        per_block = KVCache.bytes_per_block(self.model_config, self.config.block_size, self.dtype)
        if self.device.type == "cuda":
            # Memory this process's caching allocator holds but no tensor uses is ours to take.
            gc.collect()
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            activations = self._activation_bytes()
            budget = int(total * self.config.gpu_memory_utilization) - (total - free) - activations
        else:
            budget = self.config.kv_cache_memory_bytes
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(
                f"no room for KV blocks ({per_block} bytes each) in a budget of {budget} bytes: "
                "raise gpu_memory_utilization or kv_cache_memory_bytes"
            )
        return num_blocks

    def _activation_bytes(self) -> int:
        """Upper estimate of one step's activation memory on the GPU (bytes): hidden states,
        the fused projections' outputs and float32 logits of every sequence."""
        cfg, tokens = self.model_config, self.config.max_num_batched_tokens
        width = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
        per_token = 4 * cfg.hidden_size + width + 3 * cfg.intermediate_size
        elem = torch.empty((), dtype=self.dtype).element_size()
        logits = 3 * self.config.max_num_seqs * cfg.vocab_size * 4
        return 2 * tokens * per_token * elem + logits + (512 << 20)

    # ----------------------------------------------------------------- requests
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt (text is encoded with the model's tokenizer).

        Raises:
            ValueError: text given but the model has no tokenizer.
        """
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass token ids")
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        return list(prompt)

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        """Raise ``ValueError`` naming ``prompt`` if the prompt is empty, too long or has ids
        outside the vocabulary."""
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(prompt_token_ids)} tokens, longer than max_model_len - 1 = "
                f"{self.max_model_len - 1}"
            )
        vocab = self.model_config.vocab_size
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    hold_blocks: bool = False) -> None:
        """Queue a request. Nothing is allocated until the scheduler admits it.

        Args:
            request_id: unique among the engine's requests.
            prompt: text or token ids.
            params: how to sample.
            hold_blocks: keep the prompt's blocks when the request finishes, until
                :meth:`release` (a prefill worker, until its KV transfer is acknowledged).

        Raises:
            ValueError: empty or too long prompt, duplicate ``request_id``.
        """
        req = self._new_request(request_id, prompt, params)
        req.hold_blocks = hold_blocks
        self.scheduler.add(req.seqs[0])

    def _new_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> _Request:
        if request_id in self.requests or request_id in self.held:
            raise ValueError(f"request_id {request_id!r} is already in use")
        token_ids = self.tokenize(prompt)
        self.validate_prompt(token_ids)
        arrival = next(self._arrivals)
        seqs = [Sequence(request_id, i, list(token_ids), len(token_ids), params, arrival,
                         generator=self._generator(params, i)) for i in range(params.n)]
        seqs[0].forks = seqs[1:]
        detoks = None
        if self.tokenizer is not None:
            backend = self.tokenizer.backend_tokenizer
            detoks = [IncrementalDetokenizer(backend, token_ids, params.stop) for _ in seqs]
        req = _Request(request_id, prompt if isinstance(prompt, str) else None, token_ids, params,
                       seqs, detoks, [CompletionOutput(i) for i in range(params.n)])
        self.requests[request_id] = req
        return req

    def _generator(self, params: SamplingParams, index: int) -> torch.Generator | None:
        if params.seed is None:
            return None
        gen = torch.Generator(device=self.device)
        gen.manual_seed(params.seed + index)
        return gen

    # ------------------------------------------------- disaggregated serving
    def prompt_blocks(self, request_id: str) -> list[int]:
        """Block ids holding the prompt's KV of a held request (see ``hold_blocks``), in order.

        Raises:
            KeyError: the request is not held.
        """
        seq = self.held[request_id][0]
        return seq.block_table[: cdiv(seq.num_prompt_tokens, self.config.block_size)]

    def release(self, request_id: str) -> bool:
        """Free a held request's blocks. Returns whether the request was held."""
        seqs = self.held.pop(request_id, None)
        for seq in seqs or ():
            self.kv_manager.free(seq)
        return seqs is not None

    def reserve_blocks(self, num_tokens: int) -> list[int]:
        """Allocate blocks for ``num_tokens`` tokens of KV that another worker will send.

        Raises:
            engine.block_pool.NoFreeBlocksError: the pool cannot hold them now.
        """
        return self.block_pool.allocate(cdiv(num_tokens, self.config.block_size))

    def free_blocks(self, block_ids: list[int]) -> None:
        """Return reserved blocks that never became a request (an expired lease, an abort)."""
        self.block_pool.free(block_ids[::-1])

    def add_prefilled_request(
        self, request_id: str, prompt_token_ids: list[int], first_token_ids: list[int],
        params: SamplingParams, block_ids: list[int],
    ) -> RequestOutput:
        """Join a request whose prompt KV already fills ``block_ids`` (from :meth:`reserve_blocks`)
        to the running batch, with the first token of each of its ``n`` samples sampled by the
        prefill worker. The request takes ownership of ``block_ids``; its samples share them.

        A seeded sample's generator is advanced past the first token's draw, so the tokens
        equal those of the same request run on one engine.

        Returns:
            The request's output so far (finished if a first token already ended it).

        Raises:
            ValueError: wrong number of first tokens or blocks, or a bad prompt; the blocks are
                then still the caller's.
        """
        if len(first_token_ids) != params.n:
            raise ValueError(f"first_token_ids has {len(first_token_ids)} tokens for n={params.n}")
        if not all(0 <= t < self.model_config.vocab_size for t in first_token_ids):
            raise ValueError(f"first_token_ids must be in [0, {self.model_config.vocab_size})")
        if len(block_ids) != cdiv(len(prompt_token_ids), self.config.block_size):
            raise ValueError(f"block_ids has {len(block_ids)} blocks for {len(prompt_token_ids)} tokens")
        req = self._new_request(request_id, prompt_token_ids, params)
        self.block_pool.acquire(block_ids * (params.n - 1))
        for seq, token_id in zip(req.seqs, first_token_ids):
            seq.forks = []
            seq.block_table = list(block_ids)
            seq.num_computed_tokens = len(prompt_token_ids)
            seq.num_cached_tokens = 0
            if seq.generator is not None:
                torch.empty(self.model_config.vocab_size, device=self.device).exponential_(
                    generator=seq.generator)
            self.scheduler.add_running(seq)
            self._append_token(req, seq, token_id, {})
        if req.finished:
            del self.requests[request_id]
        return req.to_output()

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free all its blocks. Returns its final output (``finish_reason``
        ``"abort"`` for unfinished samples), or ``None`` for an unknown id."""
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

    # ------------------------------------------------------------------- steps
    def step(self) -> list[RequestOutput]:
        """Run one iteration over the running batch.

        Returns:
            The outputs of every request that gained tokens or finished in this step
            (cumulative: each ``CompletionOutput`` holds all tokens so far). Finished requests
            are removed from the engine and their blocks freed.
        """
        step = self.scheduler.schedule()
        self.last_step_ran = not step.is_empty
        if step.is_empty:
            return []
        result = self.runner.execute(step)
        for s in step.scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens
            self.kv_manager.cache_computed_blocks(s.seq)
        self.scheduler.complete_forks(step)

        touched: dict[str, _Request] = {}
        for seq, token_id, logprobs in zip(result.sequences, result.token_ids, result.logprobs):
            req = self.requests[seq.request_id]
            self._append_token(req, seq, token_id, logprobs)
            touched[req.request_id] = req
        outputs = []
        for req in touched.values():
            outputs.append(req.to_output())
            if req.finished:
                del self.requests[req.request_id]
                if req.hold_blocks:
                    self.held[req.request_id] = req.seqs
        return outputs

    def _append_token(self, req: _Request, seq: Sequence, token_id: int,
                      logprobs: dict[int, float]) -> None:
        params, out = req.params, req.outputs[seq.index]
        seq.token_ids.append(token_id)
        out.token_ids.append(token_id)
        out.logprobs.append(logprobs)
        finish, reason = None, None
        stop = req.detokenizers[seq.index].push(token_id) if req.detokenizers else None
        if token_id in params.stop_token_ids:
            finish, reason = "stop", token_id
        elif not params.ignore_eos and token_id in self.eos_token_ids:
            finish = "stop"
        elif stop is not None:
            finish, reason = "stop", stop
        elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            finish = "length"
        if req.detokenizers:
            out.text += req.detokenizers[seq.index].take_new_text(finished=finish is not None)
        if finish is not None:
            out.finish_reason, out.stop_reason = finish, reason
            self.scheduler.finish(seq, free_blocks=not req.hold_blocks)

    # ------------------------------------------------------------------- stats
    @property
    def num_free_blocks(self) -> int:
        """Blocks not referenced by any sequence (evictable cached blocks included)."""
        return self.block_pool.num_free_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.kv_manager.prefix_hit_rate
