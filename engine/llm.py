"""The offline API, in the style vLLM's users know: ``LLM(...).generate(prompts, params)``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from tqdm import tqdm

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.tokenizer import Message, Tokenizer


class LLM:
    """Generate text for a batch of prompts with continuous batching and a paged KV cache.

    Args:
        model: ``None`` for the default SmolLM2-135M-Instruct; an HF directory, a GGUF file,
            ``ORG/NAME`` from the HF cache, a preset (``"llama-3-8b"``, ``"smollm2-135m"``) or a
            LlamaConfig-like dict (with ``load_format="dummy"`` for random weights).
        load_format: ``"auto"`` or ``"dummy"``.
        **config: :class:`engine.config.EngineConfig` fields (``block_size=16``,
            ``max_num_seqs``, ``max_num_batched_tokens``, ``num_blocks``, ``dtype``, ...).

    Raises:
        ValueError: unknown model or a bad setting, naming it.
    """

    def __init__(self, model: str | dict | None = None, load_format: str = "auto", **config) -> None:
        self.engine = EngineCore(model, EngineConfig(**config), load_format=load_format)
        self._ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer | None:
        """The model's :class:`engine.tokenizer.Tokenizer` (``None`` for presets and config dicts)."""
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns one :class:`RequestOutput` per prompt, in order.

        Args:
            prompts: texts (encoded as the served API encodes ``prompt``: special tokens added
                as the model's post-processor says), or token-id lists (used as they are).
            params: one :class:`SamplingParams` for all, or one per prompt (default: ``SamplingParams()``).
            use_tqdm: show a progress bar.

        Raises:
            ValueError: a bad prompt (empty, longer than ``max_model_len``) or mismatched
                ``params`` length; no request is left in the engine.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"params has {len(params)} entries for {len(prompts)} prompts")
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        processor = OutputProcessor(self.engine)
        try:
            # add_request validates; a bad prompt stops here and the finally drops the rest
            # (queued requests hold no blocks until the scheduler admits them).
            for request_id, prompt, p in zip(ids, prompts, params):
                processor.add_request(request_id, prompt, p)
            return self._run(ids, processor, use_tqdm)
        finally:
            for request_id in ids:
                self.engine.abort_request(request_id)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate.

        Raises:
            ValueError: the model has no tokenizer or chat template.
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        if self.engine.tokenizer is None:
            raise ValueError("messages: this model has no tokenizer")
        try:
            prompts = [self.engine.tokenizer.apply_chat_template(c) for c in conversations]
        except ValueError as exc:
            raise ValueError(f"messages: {exc}") from None
        return self.generate(prompts, params, use_tqdm)

    def _run(self, ids: list[str], processor: OutputProcessor, use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Generating", disable=not use_tqdm, unit="req") as bar:
            while len(finished) < len(ids):
                for out in processor.process(self.engine.step().outputs):
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
        return [finished[i] for i in ids]
