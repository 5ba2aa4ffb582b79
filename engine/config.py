"""Engine configuration: cache and scheduler settings, validated when built.

:class:`EngineConfig` is the one declaration of each engine setting: its type, bounds, default
and description. A worker's settings nest it whole (``cluster.settings.WorkerSettings.engine``)
and take the worker's flags, environment variables and ``--help`` from these fields.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic.dataclasses import dataclass

SUPPORTED_BLOCK_SIZES = (8, 16, 32, 64, 128)
# NVLink multicast (NVLS) stays off in every process Tandem starts (tensor-parallel ranks, the
# local launcher's workers): on a shared host a program using it can take the GPUs out of
# service, and NCCL, PyTorch's symmetric memory and NVSHMEM would each try it on their own. A
# value already in the environment wins.
NVLINK_MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# Model / KV cache dtypes by name (``engine.runner.devices.DTYPES`` maps them to torch dtypes).
DTYPE_NAMES = ("float32", "bfloat16", "float16")
# How a quantized checkpoint's weights are held (``engine.loading.quantized_loader``).
QUANTIZATIONS = ("auto", "gguf", "none")
# KV cache dtypes (vLLM's names): "auto" is the model's dtype (``engine.runner.devices.resolve_kv_cache_dtype``).
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")
# Proposers of speculative decoding (``engine.speculative``), vLLM's method names.
SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model")


@dataclass(config=ConfigDict(extra="forbid"))
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``speculative_config``): a proposer drafts up to
    ``num_speculative_tokens`` tokens per decoding sequence, the target verifies them in one
    forward (:mod:`engine.speculative`).

    Raises:
        pydantic.ValidationError: (a ``ValueError``) a field is out of range or unknown; the
            error names it.
    """

    method: Literal[*SPECULATIVE_METHODS] = Field(
        "ngram", description="ngram: prompt lookup, the tokens that followed the latest earlier occurrence of the "
                             "sequence's last n tokens; suffix: a suffix tree over the request's and recent "
                             "requests' tokens, the most frequent continuation of the longest matched suffix; "
                             "draft_model: a smaller model of the target's vocabulary drafts greedily, its paged "
                             "KV under the target's block ids")
    model: str | dict[str, Any] | None = Field(
        None, description="draft_model: the draft (as the engine's model: a GGUF file, an HF directory, a hub id, "
                          "a preset or a config dict, the last two with random weights); it must have the "
                          "target's vocabulary")
    num_speculative_tokens: int = Field(4, ge=1, le=32, description="draft tokens per sequence and step at most (k)")
    prompt_lookup_max: int = Field(5, ge=1, le=64, description="ngram: the longest n-gram matched")
    prompt_lookup_min: int = Field(2, ge=1, le=64, description="ngram: the shortest n-gram matched")
    suffix_max_depth: int = Field(24, ge=2, le=256, description="suffix: the longest suffix matched, and the "
                                                                 "depth of the tree")
    suffix_max_cached_requests: int = Field(
        64, ge=0, description="suffix: finished requests whose tokens stay in the shared tree (0: only the "
                              "request's own tokens)")
    suffix_min_token_prob: float = Field(
        0.1, ge=0, le=1, description="suffix: a draft stops at a token whose frequency among its siblings "
                                     "is below this")
    disable_by_batch_size: int | None = Field(
        None, ge=1, description="a step speculates only while at most this many sequences run (above it, "
                                "verifying drafts costs more than it saves); unset: 2 on the CPU (where the GGUF "
                                "weights' int4 matmul costs 1.5x a one-token step up to 4 tokens and 2.8x at 5-8: "
                                "bench/speculative.py), 4 on CUDA (an H200, bf16 SmolLM2, n-gram: 1.3x plain decoding "
                                "at 4 sequences, 0.24x at 64, where plain decoding keeps async scheduling)")

    @field_validator("prompt_lookup_min")
    @classmethod
    def _check_lookup_min(cls, value: int, info: ValidationInfo) -> int:
        bound = info.data.get("prompt_lookup_max")
        if bound is not None and value > bound:
            raise ValueError(f"must be <= prompt_lookup_max={bound}, got {value}")
        return value

    @model_validator(mode="after")
    def _check_draft_model(self) -> SpeculativeConfig:
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("model: set it for method 'draft_model' (the draft), and only for it")
        return self


@dataclass(config=ConfigDict(extra="forbid"))
class EngineConfig:
    """Settings of one engine instance (one worker); each field's description says what it is.

    A list of sizes may also be given as one comma-separated string (``"1,2,4"``: an
    environment variable or a flag); the sizes are sorted and deduplicated.

    Raises:
        pydantic.ValidationError: (a ``ValueError``) a field is out of range or unknown; the
            error names it.
    """

    block_size: int = Field(16, description=f"tokens per KV block, one of {SUPPORTED_BLOCK_SIZES}")
    max_num_seqs: int = Field(256, ge=1, description="sequences in the running batch at most")
    max_num_batched_tokens: int = Field(
        2048, ge=1, description="tokens per engine step at most (prefill chunks plus decode tokens); also the "
                                "chunked-prefill chunk size")
    max_model_len: int | None = Field(
        None, ge=2, description="tokens per sequence at most (prompt + output); unset: the model's "
                                "max_position_embeddings, lowered to what the KV cache holds")
    num_blocks: int | None = Field(None, ge=1, description="KV blocks in the pool; unset: sized from the memory budget")
    kv_cache_memory_bytes: int = Field(1 << 30, ge=1, description="KV cache bytes when not on CUDA")
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="on CUDA, the fraction of the GPU's memory that weights, activations and the "
                                     "KV cache may use together")
    enable_prefix_caching: bool = Field(True, description="reuse cached full KV blocks across requests")
    dtype: Literal["auto", *DTYPE_NAMES] = Field(
        "auto", description="model dtype (and the KV cache's, unless kv_cache_dtype says otherwise); auto: "
                            "bfloat16 on CUDA, float32 on CPU")
    quantization: Literal[*QUANTIZATIONS] = Field(
        "auto", description="gguf: keep a GGUF model's Q4_0/Q4_1/Q8_0 weights quantized and compute with them "
                            "(CPU; the matmuls in bfloat16); none: dequantize every weight to dtype (the path "
                            "that matches HF transformers); auto: gguf for a GGUF model on the CPU, else none")
    kv_cache_dtype: Literal[*KV_CACHE_DTYPES] = Field(
        "auto", description="KV cache dtype: auto (the model's dtype) or fp8_e4m3 (float8 e4m3, a fixed scale of "
                            "1.0, values saturated to ±448, engine.runner.kv_cache: twice a bfloat16 cache's blocks in "
                            "the same memory; on CUDA it needs compute capability >= 8.9, refused at start-up "
                            "otherwise)")
    device: str = Field("auto", description="auto (CUDA when available), cpu or cuda[:N]; with tensor "
                                            "parallelism, rank 0's GPU (rank r runs on the GPU r after it)")
    seed: int = Field(0, ge=0, description="seed of the generator of the per-step seeds of requests without "
                                           "their own seed")
    cuda_graph_batch_sizes: list[int] | None = Field(
        None, description="CUDA: batch sizes at which decode-only steps are captured as CUDA graphs at start-up "
                          "(a step is padded to the next captured size; larger ones run eagerly), each in "
                          "[1, max_num_batched_tokens]; unset: 1, 2, 4, then every multiple of 8 up to "
                          "max_num_seqs")
    cuda_graph_token_sizes: list[int] | None = Field(
        None, description="CUDA: token counts at which the pieces between attentions of the other steps (prompt "
                          "chunks) are captured as CUDA graphs (a step is padded to the next captured count, its "
                          "attentions run eagerly; larger ones run wholly eagerly, engine.runner.piecewise_graphs), each "
                          "in [1, max_num_batched_tokens]; unset: 16, 32, 64, 128, then eight counts per doubling "
                          "(144, 160, ..., 256, 288, ...) up to min(max_num_batched_tokens, 2048); empty: none")
    enforce_eager: bool = Field(False, description="CUDA: capture no graphs and run every step eagerly (less "
                                                   "start-up, slower steps)")
    batch_invariant: bool = Field(
        False, description="CUDA: every row's result independent of what else runs in its step (a greedy answer "
                           "the same at any batch size and with speculation or without, in bfloat16 too): linear "
                           "layers through a matmul of one fixed tile shape (kernels.matmul), the decode "
                           "attention with one split count for every batch; slower than cuBLAS; needs "
                           "tensor_parallel_size 1")
    tensor_parallel_size: int = Field(
        1, ge=1, description="ranks the model is sharded over (Megatron-LM tensor parallelism, "
                             "engine.parallel.tensor_parallel), one process and one GPU each; it must divide the model's "
                             "attention and KV head counts")
    async_scheduling: bool | None = Field(
        None, description="schedule and launch each step while the one before it runs on the device, its "
                          "sampled tokens fed to the next step there (engine.core.engine_core.EngineCore.step); "
                          "unset: on CUDA only (on the CPU a step has run by the time it is launched, so "
                          "overlapping would only delay each token by a step); steps that speculate run without the overlap")
    speculative_config: SpeculativeConfig | None = Field(
        None, description="speculative decoding (engine.config.SpeculativeConfig, a dict or JSON: "
                          "{\"method\": \"ngram\", \"num_speculative_tokens\": 4}); unset: none. A step that "
                          "speculates is scheduled once the step ahead of it has completed (drafts are proposed "
                          "from the tokens on the host)")

    @field_validator("speculative_config", mode="before")
    @classmethod
    def _parse_speculative(cls, value: object) -> object:
        return json.loads(value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check_batch_invariant_parallel(self) -> EngineConfig:
        if self.batch_invariant and self.tensor_parallel_size > 1:
            raise ValueError("batch_invariant runs with tensor_parallel_size 1 only (an all-reduce's order is NCCL's)")
        return self

    @field_validator("block_size")
    @classmethod
    def _check_block_size(cls, value: int) -> int:
        if value not in SUPPORTED_BLOCK_SIZES:
            raise ValueError(f"must be one of {SUPPORTED_BLOCK_SIZES}, got {value}")
        return value

    @field_validator("cuda_graph_batch_sizes", "cuda_graph_token_sizes", mode="before")
    @classmethod
    def _split_sizes(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("cuda_graph_batch_sizes", "cuda_graph_token_sizes")
    @classmethod
    def _check_sizes(cls, sizes: list[int] | None, info: ValidationInfo) -> list[int] | None:
        if sizes is None:
            return None
        least = 1 if info.field_name == "cuda_graph_batch_sizes" else 0
        bound = info.data.get("max_num_batched_tokens")
        if len(sizes) < least or bound is None or not all(1 <= n <= bound for n in sizes):
            raise ValueError(f"must be a list of {'at least one size' if least else 'sizes'} in "
                             f"[1, max_num_batched_tokens], got {sizes!r}")
        return sorted(set(sizes))


# Running sequences above which an engine stops speculating (SpeculativeConfig.disable_by_batch_size),
# by device type: bench/results/speculative/ (the CPU's int4 matmul; on an H200, bf16, n-gram gave
# 1.8x plain decoding at batch 1, 1.3x at 4 and 0.24x at 64).
SPECULATION_MAX_BATCH = {"cpu": 2, "cuda": 4}


def resolve_disable_by_batch_size(config: SpeculativeConfig, device_type: str) -> int | None:
    """The running sequences above which an engine on ``device_type`` does not speculate
    (``disable_by_batch_size``, resolved; ``None``: no bound)."""
    if config.disable_by_batch_size is not None:
        return config.disable_by_batch_size
    return SPECULATION_MAX_BATCH.get(device_type)


def resolve_async_scheduling(config: EngineConfig, device_type: str) -> bool:
    """Whether an engine of ``config`` on a device of ``device_type`` (``"cuda"``, ``"cpu"``)
    schedules asynchronously (``async_scheduling``, resolved; a step that speculates still waits
    for the one ahead of it: :meth:`engine.core.engine_core.EngineCore.step`)."""
    return device_type == "cuda" if config.async_scheduling is None else config.async_scheduling
