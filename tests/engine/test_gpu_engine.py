"""The engine on CUDA: Triton kernels, CUDA graphs, warm-up, KV sizing (skipped without a GPU).

The device machine has no model files, so the oracle is a random-weight model of SmolLM2's
shapes built and saved here (the real HF-directory loading path), run by transformers on the
same GPU. Graph and eager engines are compared in float32, where a different matmul tiling for
a padded batch moves logits by ~1e-6, far from any tie.
"""

import gc
import statistics

import pytest
import torch

from engine import LLM, SamplingParams
from engine.runner.kv_cache import KVCache

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)

SMOLLM2_SHAPES = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
    rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
)


@pytest.fixture(scope="module")
def smollm2_random_dir(tmp_path_factory):
    """An HF directory with random SmolLM2-shaped weights (std 0.05: logits far from ties)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SMOLLM2_SHAPES)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.05)
    path = tmp_path_factory.mktemp("smollm2-random")
    model.save_pretrained(path)
    return path, model


def test_fp32_greedy_matches_hf_on_gpu(smollm2_random_dir):
    path, hf = smollm2_random_dir
    hf = hf.to("cuda").eval()
    llm = LLM(model=str(path), device="cuda", dtype="float32", block_size=16, gpu_memory_utilization=0.3)
    prompts = [[(97 * i + 13 * j) % 49152 for j in range(20 + 37 * i)] for i in range(6)]
    free = llm.engine.num_free_blocks
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True), use_tqdm=False)
    assert llm.engine.num_free_blocks == free
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
    hf.generation_config.eos_token_id = None
    for prompt, out in zip(prompts, outs):
        with torch.inference_mode():
            ids = torch.tensor([prompt], device="cuda")  # token 0 is also the pad id: pass the mask
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist()


def test_bf16_llama3_8b_shapes_run_with_memory_budget():
    llm = LLM(model="llama-3-8b", load_format="dummy", device="cuda", dtype="bfloat16",
              gpu_memory_utilization=0.85, max_model_len=8192)
    engine = llm.engine
    assert engine.num_blocks > 1000
    free = engine.num_free_blocks
    prompts = [[(7 * i + j) % 128000 for j in range(100 + 50 * i)] for i in range(8)]
    params = SamplingParams(max_tokens=16, temperature=0.7, top_p=0.9, seed=1, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 16 for o in outs)
    assert engine.num_free_blocks == free


def _prompts(count: int, seed: int, low: int = 20, high: int = 300) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (count,), generator=gen).tolist()
    return [torch.randint(0, 49152, (n,), generator=gen).tolist() for n in lengths]


def _run(llm: LLM, prompts, params):
    """Drive the engine step by step; returns (tokens of each prompt's sample 0, every step's stats)."""
    engine = llm.engine
    params = params if isinstance(params, list) else [params] * len(prompts)
    ids = [f"req-{id(prompts)}-{i}" for i in range(len(prompts))]
    for request_id, prompt, p in zip(ids, prompts, params):
        engine.add_request(request_id, prompt, p)
    done, stats = {}, []
    while len(done) < len(ids):
        out = engine.step()
        if out.stats is not None:  # (a step only launched, under async scheduling, has none yet)
            stats.append(out.stats)
        done.update({o.request_id: o.outputs[0].token_ids for o in out.outputs if o.finished})
    return [done[i] for i in ids], stats


@pytest.fixture(scope="module")
def graph_and_eager(smollm2_random_dir):
    path, _ = smollm2_random_dir
    settings = dict(model=str(path), device="cuda", dtype="float32", block_size=16, num_blocks=2048, max_num_seqs=64)
    return (LLM(**settings, cuda_graph_batch_sizes=[1, 2, 4, 8, 16, 32, 64]),
            LLM(**settings, enforce_eager=True))


def test_async_scheduling_equals_synchronous_scheduling(graph_and_eager, smollm2_random_dir):
    """On CUDA each step is launched before the last one's tokens reach the host (its decodes
    read them on the device): every token and log-probability is the one a synchronous engine
    gives (the log-probabilities to float32 rounding), through CUDA graphs, piecewise graphs,
    prompt chunks, forked samples, seeded sampling, requests finishing mid-batch, and every block
    comes back."""
    graphs, _ = graph_and_eager
    path, _ = smollm2_random_dir
    sync = LLM(model=str(path), device="cuda", dtype="float32", block_size=16, num_blocks=2048, max_num_seqs=64,
               cuda_graph_batch_sizes=[1, 2, 4, 8, 16, 32, 64], async_scheduling=False)
    assert graphs.engine.async_scheduling and not sync.engine.async_scheduling
    prompts = _prompts(12, seed=41)
    params = [SamplingParams(max_tokens=8 + 5 * i, temperature=0, logprobs=2, ignore_eos=True) for i in range(6)]
    params += [SamplingParams(max_tokens=20, temperature=0.8, seed=11 + i, n=2, ignore_eos=True) for i in range(3)]
    params += [SamplingParams(max_tokens=30, temperature=1.0, top_k=20, seed=5, ignore_eos=True)] * 3

    def outputs(llm):
        free = llm.engine.num_free_blocks
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.num_free_blocks == free
        return [c for o in outs for c in o.outputs]

    got, expected = outputs(graphs), outputs(sync)
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    # Forked samples join a step later under async scheduling, so a batch can be padded to
    # another graph size: float32 logits then differ in the last bits.
    for a, b in zip(got, expected):
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.keys() == y.keys() and all(abs(x[t] - y[t]) < 1e-4 for t in x)


@pytest.mark.parametrize("batch", [1, 3, 8, 13, 40])
def test_graph_replay_equals_eager_greedy(graph_and_eager, batch):
    graphs, eager = graph_and_eager
    prompts = _prompts(batch, seed=batch)
    got, stats = _run(graphs, prompts, GREEDY)
    expected, eager_stats = _run(eager, prompts, GREEDY)
    assert got == expected
    replayed = [s.cuda_graph_size for s in stats if s.cuda_graph_size is not None]
    assert replayed and all(size >= 1 for size in replayed)
    if batch in (3, 13, 40):
        assert max(replayed) > batch  # padded rows ran beside the real ones
    pieced = [s for s in stats if s.kind != "decode"]  # prompt chunks: the piecewise graphs
    assert pieced and all(s.num_tokens <= s.piecewise_graph_tokens for s in pieced)
    assert any(s.num_tokens < s.piecewise_graph_tokens for s in pieced)
    assert all(s.cuda_graph_size is None and s.piecewise_graph_tokens is None for s in eager_stats)


def test_a_long_tail_batch_replays_more_splits_and_equals_eager_greedy(graph_and_eager):
    graphs, eager = graph_and_eager
    prompts = _prompts(1, seed=7, low=3600, high=3700) + _prompts(11, seed=8)
    got, stats = _run(graphs, prompts, GREEDY)
    assert got == _run(eager, prompts, GREEDY)[0]
    runner = graphs.engine.runner.graphs
    long_tail = [s for s in stats if s.cuda_graph_size is not None
                 and s.cuda_graph_splits == runner.long_tail_splits.get(s.cuda_graph_size)]
    assert long_tail and all(s.cuda_graph_splits > runner.num_splits[s.cuda_graph_size] for s in long_tail)


def test_seeded_sampling_ignores_batch_mates_graphs_and_engines(graph_and_eager):
    graphs, eager = graph_and_eager
    prompts = _prompts(5, seed=99)
    seeded = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    mates = [SamplingParams(max_tokens=30, temperature=1.2), SamplingParams(max_tokens=10, temperature=0.7, top_k=5),
             SamplingParams(max_tokens=20, temperature=0), SamplingParams(max_tokens=16, temperature=1.0, seed=7)]
    alone, _ = _run(graphs, prompts[:1], [seeded])
    batched, _ = _run(graphs, prompts, [seeded, *mates])
    other_engine, _ = _run(eager, prompts[:1], [seeded])
    assert alone[0] == batched[0] == other_engine[0]
    other_seed, _ = _run(graphs, prompts[:1], [SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=5)])
    assert other_seed[0] != alone[0]


def test_first_batch_runs_at_full_speed(smollm2_random_dir):
    """Start-up compiled every kernel variant: no step of the first batch stalls on a compile,
    and its decode steps take as long as the second batch's."""
    path, _ = smollm2_random_dir
    llm = LLM(model=str(path), device="cuda", dtype="bfloat16", num_blocks=8192, max_num_seqs=128,
              max_num_batched_tokens=1024, enable_prefix_caching=False)  # the second batch repeats the first
    assert llm.engine.startup.warmup_s > 0 and llm.engine.startup.cuda_graph_s > 0
    prompts = _prompts(128, 3, 50, 150)  # all prefilled in ~13 steps, then 128 decoding
    params = SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, ignore_eos=True)
    _, first = _run(llm, prompts, params)
    _, second = _run(llm, prompts, params)

    def decode_median(stats):
        return statistics.median(s.step_s for s in stats if s.num_decodes == s.num_seqs == 128)

    assert decode_median(first) < 1.3 * decode_median(second) + 1e-3
    assert max(s.step_s for s in first) < 2 * max(s.step_s for s in second) + 0.05  # a compile takes > 0.1 s


def test_kv_cache_leaves_the_measured_headroom(smollm2_random_dir):
    path, _ = smollm2_random_dir
    gc.collect()
    torch.cuda.empty_cache()
    llm = LLM(model=str(path), device="cuda", dtype="bfloat16", gpu_memory_utilization=0.5,
              max_num_batched_tokens=4096, max_num_seqs=256)
    engine, profile = llm.engine, llm.engine.memory_profile
    assert profile.activation_bytes > 0 and profile.cuda_graph_bytes > 0
    per_block = KVCache.bytes_per_block(engine.model_config, 16, torch.bfloat16)
    assert engine.num_blocks == profile.kv_cache_bytes // per_block
    # Prefill-heavy steps of 4096 tokens in which up to 256 rows sample with filters and logprobs.
    prompts = _prompts(300, 4, 200, 900)
    _run(llm, prompts, SamplingParams(max_tokens=3, temperature=1.0, top_p=0.8, top_k=40, logprobs=5))
    free, total = torch.cuda.mem_get_info()
    # This engine's share: what the device holds beyond what others held when it started (1 GiB
    # for the allocator's fragmentation).
    assert total - free - profile.others_bytes <= profile.budget_bytes + (1 << 30)
