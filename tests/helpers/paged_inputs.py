"""Random paged-cache inputs for the kernel tests: block-major pools, shuffled block tables."""

from __future__ import annotations

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# GPU-only tests: the project's "gpu" marker, skipped where no CUDA device is present.
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def gpu_test(fn):
    """Mark ``fn`` as a GPU-only test."""
    return pytest.mark.gpu(needs_cuda(fn))


# ‖out − ref‖ / ‖ref‖ bounds, by the query's dtype: float32 uses exact products; bf16 rounds P
# and the output to 8 bits. An fp8 cache adds nothing: the reference reads the same fp8 values,
# and the kernels upcast them exactly.
REL_TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}
FP8 = torch.float8_e4m3fn


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; NaN anywhere gives NaN (which fails every bound)."""
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm())


def layer_views(
    num_blocks: int, num_layers: int, layer: int, block_size: int, num_kv_heads: int,
    head_dim: int, dtype: torch.dtype, generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random block-major pool ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``
    and layer ``layer``'s strided (k_cache, v_cache) views, as engine/runner/kv_cache.py builds them."""
    pool = torch.randn(
        num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim, generator=generator,
    ).to(dtype=dtype, device=DEVICE)
    return pool[:, layer, 0], pool[:, layer, 1]


def shuffled_block_tables(
    seq_lens: list[int], block_size: int, num_blocks: int, generator: torch.Generator,
) -> torch.Tensor:
    """``[num_seqs, max_blocks] int32``: distinct random physical blocks per sequence; unused
    entries point at random blocks too (the kernels must not read past ``seq_lens``)."""
    needed = [-(-n // block_size) for n in seq_lens]
    assert sum(needed) <= num_blocks
    perm = torch.randperm(num_blocks, generator=generator)
    width = max(needed) + 1
    tables = torch.randint(0, num_blocks, (len(seq_lens), width), generator=generator, dtype=torch.int32)
    start = 0
    for row, n in enumerate(needed):
        tables[row, :n] = perm[start:start + n].to(torch.int32)
        start += n
    return tables.to(DEVICE)


def blocks_for(seq_lens: list[int], block_size: int) -> int:
    """Physical blocks for these sequences, plus a few spare ones."""
    return sum(-(-n // block_size) for n in seq_lens) + 3
