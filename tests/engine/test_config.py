"""Engine settings: validation naming the field, and the CUDA graph ladder they imply."""

import pytest
import torch

from engine.config import EngineConfig
from engine.runner.cuda_graphs import cuda_graph_sizes
from engine.runner.piecewise_graphs import piecewise_token_sizes

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


@pytest.mark.parametrize("field", ["cuda_graph_batch_sizes", "cuda_graph_token_sizes"])
@pytest.mark.parametrize("sizes", [[0], [4096], [2, -1]])
def test_bad_cuda_graph_sizes_name_the_field(field, sizes):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: sizes}, max_num_batched_tokens=2048)


def test_decode_graphs_need_a_size_and_piecewise_graphs_may_have_none():
    with pytest.raises(ValueError, match=r"cuda_graph_batch_sizes\n.*must be a list of at least one size"):
        EngineConfig(cuda_graph_batch_sizes=[])
    assert piecewise_token_sizes(EngineConfig(cuda_graph_token_sizes=[]), CUDA) == []


def test_default_ladder_covers_every_batch_up_to_max_num_seqs_with_little_padding():
    sizes = cuda_graph_sizes(EngineConfig(max_num_seqs=256), CUDA)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 256
    padded = [min(s for s in sizes if s >= n) for n in range(1, 257)]
    assert max(p - n for n, p in zip(range(1, 257), padded)) <= 7
    assert cuda_graph_sizes(EngineConfig(max_num_seqs=3), CUDA) == [1, 2, 3]


def test_explicit_sizes_are_sorted_and_graphs_are_off_where_they_cannot_run():
    config = EngineConfig(cuda_graph_batch_sizes=[32, 1, 8, 8])
    assert cuda_graph_sizes(config, CUDA) == [1, 8, 32]
    assert cuda_graph_sizes(config, CPU) == []
    assert cuda_graph_sizes(EngineConfig(enforce_eager=True), CUDA) == []


def test_kv_cache_dtype_is_auto_or_fp8_e4m3_and_a_bad_one_names_the_field():
    assert EngineConfig().kv_cache_dtype == "auto"
    assert EngineConfig(kv_cache_dtype="fp8_e4m3").kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp8_e5m2")


def test_piecewise_ladder_doubles_to_128_then_takes_eight_counts_per_doubling_up_to_the_step_bound():
    sizes = piecewise_token_sizes(EngineConfig(), CUDA)
    assert sizes[:6] == [16, 32, 64, 128, 144, 160]
    assert sizes[-3:] == [1792, 1920, 2048]
    assert len(sizes) == 4 + 4 * 8
    assert all((after - before) * 8 <= before for before, after in zip(sizes[3:], sizes[4:]))  # padding < 1/8
    assert piecewise_token_sizes(EngineConfig(max_num_batched_tokens=8192), CUDA) == sizes  # then eager
    assert piecewise_token_sizes(EngineConfig(max_num_batched_tokens=600), CUDA)[-5:] == [448, 480, 512, 576, 600]
    assert piecewise_token_sizes(EngineConfig(max_num_batched_tokens=100), CUDA) == [16, 32, 64, 100]
    assert piecewise_token_sizes(EngineConfig(max_num_batched_tokens=8), CUDA) == [8]
    config = EngineConfig(cuda_graph_token_sizes=[512, 64, 64])
    assert piecewise_token_sizes(config, CUDA) == [64, 512]
    assert piecewise_token_sizes(config, CPU) == []
    assert piecewise_token_sizes(EngineConfig(enforce_eager=True), CUDA) == []
