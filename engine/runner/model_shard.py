"""What every rank of an engine builds, in the same order on every rank: the model (its shard
under tensor parallelism), the KV cache sized from memory, the model runner, warmed up.

Under tensor parallelism the ranks run this in lockstep, each in its own process: the memory
profile's and the warm-up's dummy steps run the model's collectives on every rank alike, the
KV cache gets the block count every rank has room for (the smallest), and rank 0 allocates each
rank's KV pool (:mod:`engine.parallel.shared_memory`), so that it can move any rank's blocks to and from
other workers.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.runner.attention import get_attention_backend
from engine.config import EngineConfig, resolve_disable_by_batch_size
from engine.runner.cuda_graphs import cuda_graph_sizes
from engine.runner.devices import check_kv_cache_dtype, rank_device, resolve_kv_cache_dtype
from engine.parallel.distributed import TPGroup
from engine.runner.kv_cache import KVCache
from engine.layers.linear import BatchInvariantLinear, PackedLinear, packed_linear_available
from engine.loading.loader import LoadedModel, load_model
from engine.loading.quantized_loader import resolve_quantization
from engine.model_source import resolve_model
from engine.runner.model_runner import ModelRunner
from engine.outputs import StartupStats
from engine.runner.piecewise_graphs import piecewise_token_sizes
from engine.runner.profiling import MemoryProfile, device_used_bytes, profile_memory
from engine.parallel.shared_memory import allocate_shared, open_shared, release_handle
from engine.runner.warmup import start_up

logger = logging.getLogger(__name__)

# (pool shape, dtype, every rank's device) -> a shared-memory handle per rank, in rank order.
PoolAllocator = Callable[[tuple[int, ...], torch.dtype, Sequence[torch.device]], list[dict]]


@dataclass
class ModelShard:
    """One rank's model, KV cache and runner.

    Attributes:
        loaded: the model (this rank's shard) and what came with it (config, id, tokenizer).
        kv_cache: this rank's KV cache.
        kv_pools: rank 0: every rank's KV cache tensor, in rank order, each
            ``[num_blocks, kv_heads_per_rank, num_layers, 2, block_size, head_dim]`` (the other
            ranks map theirs from it); another rank: its own only.
        runner: runs this rank's steps.
        draft: the draft model's runner (speculative method ``draft_model``): its KV cache has
            the target's ``num_blocks`` blocks, block ``b`` of it holding the draft's KV of the
            tokens whose target KV is in block ``b``; ``None`` without a draft, and on a rank
            other than 0 (the whole draft runs on rank 0).
        num_blocks: KV blocks per rank (the same on every rank).
        max_model_len: tokens per sequence at most (the setting, lowered to what the KV cache holds).
        memory_profile: on CUDA with the KV cache sized from memory, this rank's measured profile.
        startup: how long start-up took, by phase.
    """

    loaded: LoadedModel
    kv_cache: KVCache
    kv_pools: list[torch.Tensor]
    runner: ModelRunner
    num_blocks: int
    max_model_len: int
    memory_profile: MemoryProfile | None
    startup: StartupStats
    draft: ModelRunner | None = None


def build_shard(model: str | dict | None, config: EngineConfig, load_format: str, device: torch.device,
                dtype: torch.dtype, tp: TPGroup | None = None, store: dist.Store | None = None,
                started: float | None = None, quantization: str = "none",
                allocate_pools: PoolAllocator | None = None) -> ModelShard:
    """Load, size, allocate and warm up one rank (call it on every rank with the same arguments
    but ``device``).

    Args:
        model, load_format: as :func:`engine.loading.loader.load_model`.
        config: the engine's settings.
        device, dtype: this rank's device and the model's dtype (the KV cache's is
            ``config.kv_cache_dtype``'s: :func:`engine.runner.devices.resolve_kv_cache_dtype`).
        tp: this process's rank of a tensor-parallel engine (``None``: the whole model).
        store: with ``tp``, the ranks' rendezvous store (KV pool handles go through it).
        started: the ``time.perf_counter()`` the engine's start-up began at (default: now).
        quantization: ``"gguf"`` or ``"none"`` (resolved: :func:`engine.loading.quantized_loader.resolve_quantization`).
        allocate_pools: on rank 0, where every rank's KV pool comes from when another process
            holds them (``EngineCore``'s); ``None``: rank 0 allocates them.

    Raises:
        ValueError: a bad model or setting (from the loader), a KV cache dtype the device cannot
            run, no room for a single KV block, or a draft model whose vocabulary is not the
            target's.
    """
    started = time.perf_counter() if started is None else started
    kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype)[1]
    check_kv_cache_dtype(kv_dtype, device)
    others_bytes = device_used_bytes(device) if device.type == "cuda" else 0
    loaded = load_model(model, dtype=dtype, device=device, attn_backend=get_attention_backend(device),
                        load_format=load_format, tp=tp, quantization=quantization)
    net = loaded.model
    _replace_linears(net, config, device, dtype)
    # The draft runs whole on rank 0 (its proposals reach the other ranks as a verification's
    # input tokens), so only rank 0's blocks hold its KV too.
    draft = _load_draft(config, load_format, device, dtype, loaded.config.vocab_size) \
        if tp is None or tp.is_driver else None
    load_s = time.perf_counter() - started

    bs = config.block_size
    graph_sizes = cuda_graph_sizes(config, device)
    token_sizes = piecewise_token_sizes(config, device)
    memory_profile = None
    if device.type == "cuda" and not config.num_blocks:
        memory_profile = profile_memory(net, config, kv_dtype, device, graph_sizes, token_sizes, others_bytes)
    per_block = KVCache.bytes_per_block(net.config, bs, kv_dtype)
    if draft is not None:  # a block id holds the target's KV and the draft's
        per_block += KVCache.bytes_per_block(draft.config, bs, kv_dtype)
    budget = memory_profile.kv_cache_bytes if memory_profile is not None else config.kv_cache_memory_bytes
    num_blocks = config.num_blocks or budget // per_block
    if tp is not None:
        num_blocks = tp.min(num_blocks)  # every rank raises below, or none
    if num_blocks < 1:
        raise ValueError(f"no room for KV blocks ({per_block} bytes each) in a budget of {budget} bytes: "
                         "raise gpu_memory_utilization or kv_cache_memory_bytes")
    profile_s = time.perf_counter() - started - load_s
    max_len = min(config.max_model_len or loaded.config.max_position_embeddings, num_blocks * bs)
    if config.max_model_len and max_len < config.max_model_len and (tp is None or tp.is_driver):
        logger.warning("max_model_len lowered to %d: the KV cache holds %d blocks of %d tokens", max_len, num_blocks, bs)

    pools = _kv_pools(KVCache.shape(net.config, num_blocks, bs), kv_dtype, device, tp, store, allocate_pools)
    kv_cache = KVCache(net.config, num_blocks, bs, kv_dtype, device, tensor=pools[0])
    runner = ModelRunner(net, kv_cache, config.max_num_batched_tokens, config.max_num_seqs, max_len, config.seed,
                         config.batch_invariant)
    startup = start_up(runner, config, graph_sizes, token_sizes, started, load_s, profile_s)
    draft_runner = None
    if draft is not None:
        draft_runner = ModelRunner(draft.model, KVCache(draft.config, num_blocks, bs, kv_dtype, device),
                                   config.max_num_batched_tokens, config.max_num_seqs, max_len)
        spec = config.speculative_config
        # Decode rows of a draft step: a token per sequence, or its tokens accepted since its last proposal.
        rows = (resolve_disable_by_batch_size(spec, device.type) or config.max_num_seqs) * (1 + spec.num_speculative_tokens)
        start_up(draft_runner, config, [n for n in graph_sizes if n <= rows] or graph_sizes[:1], [],
                 time.perf_counter(), 0.0, 0.0)
    return ModelShard(loaded, kv_cache, pools, runner, num_blocks, max_len, memory_profile, startup, draft_runner)


def _load_draft(config: EngineConfig, load_format: str, device: torch.device, dtype: torch.dtype,
                vocab_size: int) -> LoadedModel | None:
    """The draft model of speculative method ``draft_model`` (``None`` for another method or
    none), on ``device`` in ``dtype``: random weights when the target's are (``load_format``
    ``"dummy"``) or when the draft names no checkpoint (a preset, a config dict); a GGUF
    draft on the CPU keeps its quantized weights unless the engine's ``quantization`` is
    ``"none"``.

    Raises:
        ValueError: from the loader, or naming ``speculative_config.model`` when the draft's
            vocabulary size is not ``vocab_size`` (the target's).
    """
    spec = config.speculative_config
    if spec is None or spec.method != "draft_model":
        return None
    source = resolve_model(spec.model)
    fmt = "dummy" if load_format == "dummy" or source.path is None else "auto"
    name = "auto" if config.quantization == "gguf" else config.quantization
    quantization = resolve_quantization(name, source.gguf if fmt == "auto" else None, device)
    draft = load_model(spec.model, dtype=dtype, device=device, attn_backend=get_attention_backend(device),
                       load_format=fmt, quantization=quantization)
    if draft.config.vocab_size != vocab_size:
        raise ValueError(f"speculative_config.model: the draft's vocabulary has {draft.config.vocab_size} tokens, "
                         f"the target's {vocab_size}")
    _replace_linears(draft.model, config, device, dtype)
    return draft


def _replace_linears(net: torch.nn.Module, config: EngineConfig, device: torch.device, dtype: torch.dtype) -> None:
    """The batch-invariant projections when ``config.batch_invariant`` asks for them, else the
    oneDNN-packed ones where they apply (:mod:`engine.layers.linear`).

    Raises:
        ValueError: ``batch_invariant`` off CUDA (its matmul is a Triton kernel).
    """
    if config.batch_invariant:
        if device.type != "cuda":
            raise ValueError(f"batch_invariant runs on CUDA only, the engine's device is {device}")
        net.replace_linears(BatchInvariantLinear)
    elif packed_linear_available(device, dtype):
        net.replace_linears(PackedLinear)


def _kv_pools(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, tp: TPGroup | None,
              store: dist.Store | None, allocate: PoolAllocator | None) -> list[torch.Tensor]:
    """This rank's KV pool first; on rank 0 of a tensor-parallel engine that allocates them,
    every other rank's after it, allocated here on its device and shared with it through
    ``store``. With ``allocate`` (rank 0), every rank's pool is mapped from its handle."""
    world_size, rank = (1, 0) if tp is None else (tp.world_size, tp.rank)
    if rank:
        pool = open_shared(json.loads(store.get(f"kv_pool/{rank}")))
        tp.barrier()  # mapped: rank 0 may delete what names it
        return [pool]
    if allocate is not None:
        handles = allocate(shape, dtype, [rank_device(device, r) for r in range(world_size)])
        pools, shared = [open_shared(handles[0])], handles[1:]
    elif tp is None:
        return [torch.zeros(shape, dtype=dtype, device=device)]
    else:
        pools, shared = [torch.zeros(shape, dtype=dtype, device=device)], []
        for other in range(1, world_size):
            pool, handle = allocate_shared(shape, dtype, rank_device(device, other))
            pools.append(pool)
            shared.append(handle)
    for other, handle in enumerate(shared, start=1):
        store.set(f"kv_pool/{other}", json.dumps(handle))
    if tp is not None:
        tp.barrier()
    if allocate is None:
        for handle in shared:
            release_handle(handle)
    return pools
