"""How much of the GPU the KV cache takes (engine/runner/profiling.py's arithmetic, CUDA-free)."""

from engine.runner.profiling import NON_TORCH_BYTES, kv_cache_room

GIB = 2**30


def test_the_budget_bounds_the_cache_when_the_device_has_room():
    # 100 GiB left of this engine's budget, 120 free: the budget's margin stays free
    assert kv_cache_room(100 * GIB, 120 * GIB, 3 * GIB) == 97 * GIB


def test_free_memory_bounds_it_less_room_for_what_comes_after_when_others_hold_the_rest():
    # another process holds most of the device: only 20 GiB free against 100 left of the budget;
    # the cache leaves NON_TORCH_BYTES of them for the graphs and streams made after it
    room = kv_cache_room(100 * GIB, 20 * GIB, 3 * GIB)
    assert room == 20 * GIB - NON_TORCH_BYTES - 3 * GIB
    assert 20 * GIB - room - 3 * GIB >= GIB


def test_nothing_left_is_not_positive():
    assert kv_cache_room(100 * GIB, GIB // 2, 0) <= 0
    assert kv_cache_room(-GIB, 50 * GIB, 0) < 0
