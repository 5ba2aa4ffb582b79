"""The entry points' plain-Python stand-ins for Triton's host helpers give Triton's answers."""

import triton

from kernels._launch import cdiv, next_power_of_2


def test_next_power_of_2_is_tritons():
    for n in list(range(0, 4200)) + [2**20 - 1, 2**20, 2**20 + 1]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n


def test_cdiv_is_tritons():
    for a in range(0, 300):
        for b in (1, 2, 3, 16, 64, 128, 1000):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
