"""The batch-invariant Triton matmul against kernels.reference (CPU under TRITON_INTERPRET=1,
and on the GPU), and its invariance on the GPU: a row's result is the same bytes at every M.
(The interpreter runs a tile's ``tl.dot`` through NumPy's BLAS, whose rounding is its own: the
invariance is the GPU kernel's property, tested there.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels
import kernels.reference as reference
from tests.helpers.paged_inputs import DEVICE, REL_TOL, gpu_test, rel_err

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _inputs(m: int, n: int, k: int, dtype: torch.dtype, seed: int, bias: bool):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k + 8, generator=gen).to(dtype=dtype, device=DEVICE)[:, :k]  # a row stride of its own
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype=dtype, device=DEVICE)
    b = torch.randn(n, generator=gen).to(dtype=dtype, device=DEVICE) if bias else None
    return x, w, b


@settings(max_examples=12, deadline=None)
@given(m=st.integers(1, 70), n=st.sampled_from([1, 40, 64, 130]), k=st.sampled_from([8, 64, 100, 200]),
       dtype=st.sampled_from(DTYPES), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_matmul_matches_reference(m, n, k, dtype, bias, seed):
    x, w, b = _inputs(m, n, k, dtype, seed, bias)
    out = kernels.matmul(x, w, b)
    assert out.shape == (m, n) and out.dtype == dtype
    assert rel_err(out, reference.matmul(x, w, b)) < REL_TOL[dtype]
    assert kernels.matmul(x, w, b, out_dtype=torch.float32).dtype == torch.float32


def test_shape_dtype_and_layout_errors_name_the_inputs():
    x = torch.zeros(3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="weight"):
        kernels.matmul(x, torch.zeros(4, 6, device=DEVICE))
    with pytest.raises(ValueError, match="dtype"):
        kernels.matmul(x, torch.zeros(4, 8, dtype=torch.float16, device=DEVICE))
    with pytest.raises(ValueError, match="bias"):
        kernels.matmul(x, torch.zeros(4, 8, device=DEVICE), torch.zeros(3, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous rows"):
        kernels.matmul(torch.zeros(8, 3, device=DEVICE).t(), torch.zeros(4, 8, device=DEVICE))


@gpu_test
def test_on_cuda_rows_are_invariant_where_cublas_rows_are_not():
    """Llama-3-8B's MLP down projection shape in bfloat16: every row of a 1-, 9-, 64- and
    256-row call equals that row in a 512-row call; cuBLAS (``F.linear``) is shown to differ
    somewhere across the same Ms, so the test could fail."""
    x, w, _ = _inputs(512, 4096, 14336, torch.bfloat16, 3, bias=False)
    full, cublas_full = kernels.matmul(x, w), F.linear(x, w)
    cublas_differs = False
    for m in (1, 9, 64, 256):
        assert torch.equal(kernels.matmul(x[:m].contiguous(), w), full[:m]), m
        cublas_differs |= not torch.equal(F.linear(x[:m], w), cublas_full[:m])
    assert rel_err(full, reference.matmul(x, w)) < REL_TOL[torch.bfloat16]
    assert cublas_differs, "cuBLAS rounded every M alike here: this shape does not show the difference"
