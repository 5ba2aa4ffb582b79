"""The entry points' plain-Python stand-ins for Triton's host helpers give Triton's answers, a
prepared launch runs each call on its own tensors, and a GPU's size is asked of that GPU only."""

import pytest
import torch
import triton

from kernels._launch import KernelLaunch, cdiv, next_power_of_2, sm_count
from tests.helpers.paged_inputs import DEVICE


def test_next_power_of_2_is_tritons():
    for n in list(range(0, 4200)) + [2**20 - 1, 2**20, 2**20 + 1]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n


def test_cdiv_is_tritons():
    for a in range(0, 300):
        for b in (1, 2, 3, 16, 64, 128, 1000):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)


def test_sm_count_asks_the_gpu_it_is_given():
    assert sm_count(torch.device("cpu")) == 4  # the interpreter's
    with pytest.raises(ValueError, match="with an index"):  # not whichever GPU the thread has current
        sm_count(torch.device("cuda"))


def _silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def test_a_kernel_launch_runs_each_call_on_its_own_tensors():
    """One prepared launch, called on tensors that move between calls (and one not aligned as
    the first was: an fp32 view one element in), computes each call's own result; on a GPU
    the calls after the first went straight to the compiled kernel."""
    from kernels.activation import _silu_and_mul_kernel

    rows, d = 5, 96
    storage = torch.randn(4, rows * 2 * d + 1, device=DEVICE)
    inputs = [storage[i, :rows * 2 * d].view(rows, 2 * d) for i in range(3)]
    inputs.append(storage[3, 1:].view(rows, 2 * d))  # 4 bytes past a 16-byte boundary
    launch = KernelLaunch(_silu_and_mul_kernel, (rows, 1), dict(BLOCK=128, num_warps=1))
    for x in inputs:
        out = torch.full((rows, d), float("nan"), device=DEVICE)
        launch(x, out, x.stride(0), out.stride(0), d)
        assert torch.allclose(out, _silu_and_mul(x), rtol=1e-5, atol=1e-6)
    assert (launch._runner is not None) == (DEVICE.type == "cuda")
