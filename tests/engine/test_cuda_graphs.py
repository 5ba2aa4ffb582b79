"""Decode steps replayed from CUDA graphs, and other steps from graphs of the pieces between
their attentions: padding rows change nothing, graph and eager agree.

The padding semantics are checked on the CPU through the graph runners' eager forwards (what a
graph captures); replaying real graphs needs a GPU (tests/engine/test_gpu_engine.py).
"""

import numpy as np
import pytest
import torch
import transformers

from engine import EngineConfig, EngineCore, SamplingParams
from engine.core.scheduler import ScheduledSequence, SchedulerOutput
from engine.runner.cuda_graphs import CUDAGraphRunner, is_long_tail, round_up_table
from engine.runner.piecewise_graphs import PiecewiseCUDAGraphs
from tests.helpers.models import make_hf_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    make_hf_model(transformers.LlamaConfig, dict(max_position_embeddings=256)).save_pretrained(path)
    return path


def _decode_batch(engine: EngineCore, num_seqs: int):
    """Prefill ``num_seqs`` greedy requests, then return the scheduler's next (decode-only) step."""
    for i in range(num_seqs):
        engine.add_request(f"r{i}", [(7 * i + j) % 90 + 2 for j in range(5 + 3 * i)],
                           SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running):
        engine.step()
    step = engine.scheduler.schedule()
    assert step.num_decodes == len(step.scheduled) == num_seqs
    return step


@torch.inference_mode()  # as ModelRunner.execute runs (on CUDA the step's buffers are inference tensors)
def test_padded_rows_neither_write_the_cache_nor_change_real_rows(tiny_dir):
    engine = EngineCore(str(tiny_dir), EngineConfig(block_size=8, num_blocks=64))
    step = _decode_batch(engine, 3)
    runner = engine.runner
    eager = runner.buffers.prepare(step)
    cache_before = engine.kv_cache.tensor.clone()
    expected = engine.model(eager.input_ids, eager.positions, engine.kv_cache, eager.metadata)
    written = engine.kv_cache.tensor.clone()
    engine.kv_cache.tensor.copy_(cache_before)

    graphs = CUDAGraphRunner(engine.model, engine.kv_cache, [8], runner.max_blocks_per_seq, engine.max_model_len)
    graphs.reset_padding()
    graphs.prepare(step, 8)
    hidden = graphs.forward(8)
    torch.testing.assert_close(hidden[:3], expected, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(hidden[3:]).all()
    # The same 3 slots written and nothing else; their values agree up to rounding (a batch of 8
    # rows may round differently from one of 3 on the CPU).
    assert torch.equal(engine.kv_cache.tensor != cache_before, written != cache_before)
    torch.testing.assert_close(engine.kv_cache.tensor, written, rtol=1e-5, atol=1e-5)


def test_batch_size_for_pads_up_and_falls_back_to_eager(tiny_dir):
    engine = EngineCore(str(tiny_dir), EngineConfig(block_size=8, num_blocks=64))
    graphs = CUDAGraphRunner(engine.model, engine.kv_cache, [1, 2, 4], engine.runner.max_blocks_per_seq,
                             engine.max_model_len)
    step = _decode_batch(engine, 3)
    assert graphs.batch_size_for(step) == 4
    step.scheduled[0].forks = [step.scheduled[1].seq]  # a fork child samples from its parent's row
    assert graphs.batch_size_for(step) is None
    step.scheduled[0].forks = []
    step.num_decodes = 2  # a prefill chunk in the step
    assert graphs.batch_size_for(step) is None


def test_a_verification_pads_to_the_graph_of_its_rows(tiny_dir):
    engine = EngineCore(str(tiny_dir), EngineConfig(block_size=8, num_blocks=64))
    graphs = CUDAGraphRunner(engine.model, engine.kv_cache, [1, 2, 4], engine.runner.max_blocks_per_seq,
                             engine.max_model_len)
    step = _decode_batch(engine, 2)
    decode, verified = step.scheduled
    for drafts, size in (([50, 51], 4), ([50, 51, 52], None)):  # 1 + 3 rows; 1 + 4 rows past the ladder
        verify = ScheduledSequence(verified.seq, 1 + len(drafts), drafts)
        verify.start, verify.samples = verified.start, True
        step = SchedulerOutput(scheduled=[decode, verify], num_decodes=1)
        assert step.verifies_as_decodes and graphs.batch_size_for(step) == size


def _mixed_step(engine: EngineCore):
    """Two sequences past their prompts and a 20-token prompt: the scheduler's next step holds
    2 decodes and the prompt's chunk (22 tokens)."""
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for i in range(2):
        engine.add_request(f"d{i}", [(7 * i + j) % 90 + 2 for j in range(5 + 3 * i)], greedy)
    engine.step()
    engine.add_request("p", [(5 * j) % 90 + 2 for j in range(20)], greedy)
    step = engine.scheduler.schedule()
    assert step.num_decodes == 2 and step.num_tokens == 22
    return step


@pytest.mark.parametrize("ladder", [[1], [1, 2, 4, 8, 16, 24], [16, 32, 256, 512, 768], [3, 7]])
def test_round_up_table_gives_the_smallest_ladder_size_at_least_n(ladder):
    table = round_up_table(ladder)
    assert len(table) == ladder[-1] + 1
    assert table[1:] == [min(s for s in ladder if s >= n) for n in range(1, ladder[-1] + 1)]


@torch.inference_mode()
def test_pieces_padded_over_stale_rows_equal_the_model_and_write_only_the_step(tiny_dir):
    engine = EngineCore(str(tiny_dir), EngineConfig(block_size=8, num_blocks=64))
    step = _mixed_step(engine)
    inputs = engine.runner.buffers.prepare(step)
    cache_before = engine.kv_cache.tensor.clone()
    expected = engine.model(inputs.input_ids, inputs.positions, engine.kv_cache, inputs.metadata)
    written = engine.kv_cache.tensor.clone()
    engine.kv_cache.tensor.copy_(cache_before)

    pieces = PiecewiseCUDAGraphs(engine.model, [8, 32, 16], torch.device("cpu"))
    assert [pieces.size_for(n) for n in (1, 8, 9, 22, 32)] == [8, 8, 16, 32, 32]
    assert pieces.size_for(0) is None and pieces.size_for(33) is None  # past the ladder: eager
    for buffer in (pieces.embedded, pieces.attn_out, pieces.qkv, pieces.residual, pieces.hidden):
        buffer.normal_()  # what an earlier, larger step would have left in the padding rows
    hidden = pieces.forward(32, inputs.input_ids, inputs.positions, engine.kv_cache, inputs.metadata)
    assert hidden.shape == expected.shape
    torch.testing.assert_close(hidden, expected, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(pieces.hidden).all()
    assert torch.equal(engine.kv_cache.tensor != cache_before, written != cache_before)
    torch.testing.assert_close(engine.kv_cache.tensor, written, rtol=1e-5, atol=1e-5)


def test_the_runner_runs_steps_within_the_ladder_as_pieces_and_the_rest_eagerly(tiny_dir):
    config = EngineConfig(block_size=8, num_blocks=64, max_num_batched_tokens=40)
    prompts = [[(3 * i + j) % 90 + 2 for j in range(40 if i == 0 else 6 + 5 * i)] for i in range(4)]
    params = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True, logprobs=2)]
    expected = _generate(EngineCore(str(tiny_dir), config), prompts, params)
    engine = EngineCore(str(tiny_dir), config)
    ladder = [8, 16, 32]  # steps of 40, 40, 40, 12 tokens, then decodes
    engine.runner.pieces = PiecewiseCUDAGraphs(engine.model, ladder, engine.runner.device)  # eager pieces
    stats = []
    assert _generate(engine, prompts, params, stats) == expected
    assert engine.num_free_blocks == 64
    pieced = [s for s in stats if s.piecewise_graph_tokens is not None]
    assert any(s.kind == "decode" for s in pieced) and any(s.kind != "decode" for s in pieced)
    assert all(s.piecewise_graph_tokens == min(n for n in ladder if n >= s.num_tokens) for s in pieced)
    eager = [s for s in stats if s.piecewise_graph_tokens is None]
    assert eager and all(s.num_tokens > 32 for s in eager)


@pytest.fixture
def triton_ops(monkeypatch):
    """Run the engine's layers, attention and sampler through the Triton kernels (on the CPU under
    TRITON_INTERPRET=1) instead of the references."""
    import kernels
    from engine.runner import model_shard, sampler
    from engine.runner.attention import PagedAttentionBackend
    from engine.layers import activation, norm, rotary

    for module in (activation, norm, rotary, sampler):
        monkeypatch.setattr(module, "ops_for", lambda device: kernels)
    monkeypatch.setattr(model_shard, "get_attention_backend", lambda device: PagedAttentionBackend(kernels))
    return monkeypatch


def test_triton_kernels_in_the_engine_match_the_references(tiny_dir, triton_ops):
    """Every Triton kernel inside the real model runner, prefill + decode, greedy and seeded."""
    prompts = [[(5 * i + j) % 90 + 2 for j in range(7 + 9 * i)] for i in range(3)]
    params = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True, logprobs=2)]
    config = EngineConfig(block_size=8, num_blocks=64, max_num_batched_tokens=16)
    triton_engine = EngineCore(str(tiny_dir), config)
    from engine.runner.warmup import warm_up

    warm_up(triton_engine.runner, config.max_num_batched_tokens, config.max_num_seqs)  # dummy steps on block 0
    assert triton_engine.num_free_blocks == 64
    got = _generate(triton_engine, prompts, params)
    triton_ops.undo()  # the references from here on
    torch_engine = EngineCore(str(tiny_dir), config)
    assert got == _generate(torch_engine, prompts, params)


def _generate(engine, prompts, params, stats=None):
    """Each prompt with each of ``params``: their tokens by request; each step's stats appended
    to ``stats``."""
    outs = {}
    for i, prompt in enumerate(prompts):
        for j, p in enumerate(params):
            engine.add_request(f"{i}-{j}", prompt, p)
    while engine.has_unfinished_requests:
        result = engine.step()
        if stats is not None:
            stats.append(result.stats)
        for out in result.outputs:
            if out.finished:
                outs[out.request_id] = out.outputs[0].token_ids
    return outs


def test_a_long_tail_is_one_long_context_among_short_ones():
    # padding rows (0) are left out; the longest must dwarf the mean and fill its unsplit programs
    assert is_long_tail(np.array([3500, 400, 400, 400, 0, 0]), 1)
    assert not is_long_tail(np.array([3500, 3000, 2800, 400]), 1)  # mean 2425: not twice
    assert not is_long_tail(np.array([900, 20, 20, 20]), 1)  # its program holds < 1024 tokens
    assert not is_long_tail(np.array([3500, 400, 400, 400]), 4)  # 875 tokens a program already
    assert not is_long_tail(np.zeros(8, dtype=np.int32), 1)


@torch.inference_mode()
def test_a_long_tail_batch_replays_its_graph_with_more_splits(tmp_path):
    # One KV head: on the CPU (4 SMs to the kernels) a batch of 4 gets 1 split, its long-tail graph 2.
    model = make_hf_model(transformers.LlamaConfig, dict(max_position_embeddings=2048, num_key_value_heads=1))
    model.save_pretrained(tmp_path)
    engine = EngineCore(str(tmp_path), EngineConfig(block_size=16, num_blocks=160, max_num_batched_tokens=2048))
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    engine.add_request("long", [(3 * j) % 90 + 2 for j in range(1100)], params)
    for i in range(3):
        engine.add_request(f"short{i}", [(7 * i + j) % 90 + 2 for j in range(10 + i)], params)
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens
                                          for s in engine.scheduler.running):
        engine.step()
    step = engine.scheduler.schedule()
    graphs = CUDAGraphRunner(engine.model, engine.kv_cache, [1, 2, 4], engine.runner.max_blocks_per_seq,
                             engine.max_model_len)
    assert graphs.variants() == [(4, 2), (4, 1), (2, 2), (1, 4)]
    assert graphs.peak_variants() == [(4, 1), (4, 2)]
    eager = engine.runner.buffers.prepare(step)
    expected = engine.model(eager.input_ids, eager.positions, engine.kv_cache, eager.metadata)
    graphs.reset_padding()
    graphs.prepare(step, 4)
    assert graphs.splits_for(4) == 2
    torch.testing.assert_close(graphs.forward(4, 2), expected, rtol=1e-5, atol=1e-5)

    short = _decode_batch(EngineCore(str(tmp_path), EngineConfig(block_size=16, num_blocks=160)), 3)
    graphs.prepare(short, 4)
    assert graphs.splits_for(4) == 1
