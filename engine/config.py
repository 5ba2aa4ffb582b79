"""Engine configuration: cache and scheduler settings, validated when built."""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass
class EngineConfig:
    """Settings of one engine instance (one worker).

    Attributes:
        block_size: tokens per KV block, one of 8/16/32/64/128.
        max_num_seqs: sequences in the running batch at most.
        max_num_batched_tokens: tokens per step at most (prefill chunks plus decode tokens);
            also the chunked-prefill chunk size.
        max_model_len: tokens per sequence at most (prompt + output); ``None``: the model's
            ``max_position_embeddings``.
        num_blocks: KV blocks in the pool; ``None``: sized from the memory budget.
        kv_cache_memory_bytes: the KV cache's size in bytes when not on CUDA (default 1 GiB).
        gpu_memory_utilization: on CUDA, the fraction of the GPU's memory that weights,
            activations and the KV cache may use together.
        enable_prefix_caching: reuse cached full blocks across requests.
        dtype: ``"auto"`` (bfloat16 on CUDA, float32 on CPU), ``"float32"``, ``"bfloat16"``, ``"float16"``.
        quantization: ``"gguf"``: keep a GGUF file's Q4_0/Q4_1/Q8_0 weights quantized and
            compute with them (CPU only; the matmuls in bfloat16); ``"none"``: dequantize every weight to
            ``dtype`` (the path that matches HF transformers); ``"auto"``: ``"gguf"`` for a GGUF
            model on the CPU, else ``"none"``.
        kv_cache_dtype: ``"auto"``: the KV cache holds K and V in the model's ``dtype``;
            ``"fp8_e4m3"``: in float8 e4m3 (``torch.float8_e4m3fn``), half a bfloat16 cache's bytes
            per block, so twice the blocks in the same memory; values are saturated to ±448 with
            a fixed scale of 1.0 (:mod:`engine.runner.kv_cache`). On CUDA it needs a GPU with float8
            support in Triton (compute capability 8.9 or later; refused at start-up otherwise).
        device: ``"auto"`` (CUDA when available), ``"cpu"`` or ``"cuda[:N]"``.
        seed: seed of the generator of the per-step seeds of requests without their own seed.
        cuda_graph_batch_sizes: on CUDA, the batch sizes at which decode-only steps are captured
            as CUDA graphs at start-up (a step is padded to the next captured size; larger ones
            run eagerly); ``None``: 1, 2, 4, 8, 16, ... every multiple of 8, up to
            ``max_num_seqs``. Each must be in ``[1, max_num_batched_tokens]``. Ignored on CPU.
        cuda_graph_token_sizes: on CUDA, the token counts at which the pieces between
            attentions are captured as CUDA graphs for the other steps (prompt chunks; a step is
            padded to the next captured count, its attentions run eagerly; larger ones run
            wholly eagerly, :mod:`engine.runner.piecewise_graphs`); ``None``: 16, 32, 64, 128, then eight
            counts per doubling (144, 160, ..., 256, 288, ..., 512, ...) up to
            ``min(max_num_batched_tokens, 2048)``; empty: none (only decode graphs). Each must be
            in ``[1, max_num_batched_tokens]``. Ignored on CPU.
        enforce_eager: on CUDA, capture no graphs and run every step eagerly.
        tensor_parallel_size: ranks the model is sharded over (Megatron-LM tensor parallelism,
            :mod:`engine.parallel.tensor_parallel`), one process each; on CUDA rank ``r`` runs on the GPU
            ``device``'s index + ``r``. It must divide the model's attention and KV head counts.
        async_scheduling: schedule and launch each step while the one before it runs on the
            device, its sampled tokens fed to the next step there (``EngineCore.step``);
            ``None``: on CUDA only (on the CPU a step has run by the time it is launched, so
            overlapping would only delay each token by a step).

    Raises:
        ValueError: a field is out of range; the message names it.
    """

    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    num_blocks: int | None = None
    kv_cache_memory_bytes: int = 1 << 30
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    dtype: str = "auto"
    quantization: str = "auto"
    kv_cache_dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    cuda_graph_batch_sizes: list[int] | None = None
    cuda_graph_token_sizes: list[int] | None = None
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        for name in ("cuda_graph_batch_sizes", "cuda_graph_token_sizes"):
            if getattr(self, name) is not None:
                setattr(self, name, sorted(set(getattr(self, name))))
        checks = [
            ("block_size", self.block_size in SUPPORTED_BLOCK_SIZES, f"must be one of {SUPPORTED_BLOCK_SIZES}"),
            ("max_num_seqs", self.max_num_seqs >= 1, "must be >= 1"),
            ("max_num_batched_tokens", self.max_num_batched_tokens >= 1, "must be >= 1"),
            ("tensor_parallel_size", self.tensor_parallel_size >= 1, "must be >= 1"),
            ("max_model_len", self.max_model_len is None or self.max_model_len >= 1, "must be >= 1"),
            ("num_blocks", self.num_blocks is None or self.num_blocks >= 1, "must be >= 1"),
            ("kv_cache_memory_bytes", self.kv_cache_memory_bytes >= 1, "must be >= 1"),
            ("gpu_memory_utilization", 0 < self.gpu_memory_utilization <= 1, "must be in (0, 1]"),
            ("dtype", self.dtype == "auto" or self.dtype in DTYPE_NAMES, f"must be auto or one of {DTYPE_NAMES}"),
            ("quantization", self.quantization in QUANTIZATIONS, f"must be one of {QUANTIZATIONS}"),
            ("kv_cache_dtype", self.kv_cache_dtype in KV_CACHE_DTYPES, f"must be one of {KV_CACHE_DTYPES}"),
            *((name, sizes is None or (len(sizes) >= least and all(
                isinstance(n, int) and 1 <= n <= self.max_num_batched_tokens for n in sizes)),
               f"must be a list of {'at least one size' if least else 'sizes'} in [1, max_num_batched_tokens]")
              for name, sizes, least in (("cuda_graph_batch_sizes", self.cuda_graph_batch_sizes, 1),
                                         ("cuda_graph_token_sizes", self.cuda_graph_token_sizes, 0))),
        ]
        for name, ok, message in checks:
            if not ok:
                raise ValueError(f"{name} {message}, got {getattr(self, name)!r}")

    def resolved_async_scheduling(self, device_type: str) -> bool:
        """Whether an engine on a device of ``device_type`` (``"cuda"``, ``"cpu"``) schedules
        asynchronously (``async_scheduling``, resolved)."""
        return device_type == "cuda" if self.async_scheduling is None else self.async_scheduling
