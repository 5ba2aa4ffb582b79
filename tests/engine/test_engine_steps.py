"""Per-step statistics and seeded sampling through the engine, on a tiny random model (CPU)."""

import pytest

from engine import EngineConfig, EngineCore, SamplingParams

TINY = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "eos_token_id": [1]}


@pytest.fixture(scope="module")
def engine():
    return EngineCore(TINY, EngineConfig(block_size=8, num_blocks=64), load_format="dummy")


def _run(engine, request_id):
    stats = []
    while True:
        out = engine.step()
        stats.append(out.stats)
        for r in out.outputs:
            if r.request_id == request_id and r.finished:
                return r, stats


def test_step_reports_what_it_ran(engine):
    engine.add_request("a", list(range(2, 22)), SamplingParams(max_tokens=4, temperature=0))
    _, stats = _run(engine, "a")
    prefill, decodes = stats[0], stats[1:]
    assert (prefill.num_seqs, prefill.num_decodes, prefill.num_tokens) == (1, 0, 20)
    assert all((s.num_seqs, s.num_decodes, s.num_tokens) == (1, 1, 1) for s in decodes)
    assert all(s.cuda_graph_size is None for s in stats)  # CPU: eager
    assert all(0 < s.prepare_s <= s.execute_s <= s.step_s for s in stats)
    assert prefill.num_kv_slots_used == 20 and prefill.num_kv_slots_allocated == 24  # 3 blocks of 8


def test_step_totals_count_each_kind_of_step():
    """A prefill, a step that prefills one prompt beside another's decode, then decodes: the
    engine's totals count each kind and its tokens, and grow by exactly what each step ran."""
    engine = EngineCore(TINY, EngineConfig(block_size=8, num_blocks=64), load_format="dummy")
    assert engine.stats().step_totals == {}
    engine.add_request("a", list(range(2, 22)), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    steps = [engine.step().stats]
    engine.add_request("b", list(range(3, 13)), SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    while engine.has_unfinished_requests:
        steps.append(engine.step().stats)
    assert [s.kind for s in steps[:3]] == ["prefill", "mixed", "decode"]
    totals = engine.stats().step_totals
    assert set(totals) == {"prefill", "mixed", "decode"}
    for kind, total in totals.items():
        ran = [s for s in steps if s.kind == kind]
        assert total.steps == len(ran) and total.tokens == sum(s.num_tokens for s in ran)
        assert total.seconds == pytest.approx(sum(s.step_s for s in ran))
    assert totals["prefill"].tokens == 20 and totals["mixed"].tokens == 10 + 1  # b's prompt beside a's decode
    assert sum(t.tokens for t in totals.values()) == 20 + 10 + 5 + 2  # prompts, then every later token


def test_startup_is_timed(engine):
    startup = engine.startup
    assert 0 < startup.load_s <= startup.total_s
    assert startup.warmup_s >= 0 and startup.cuda_graph_s >= 0
    assert engine.memory_profile is None  # CPU: sized from kv_cache_memory_bytes / num_blocks


def test_seeded_request_continued_on_another_engine_matches(engine):
    """Prefill + first token on one engine, the rest on another: the same tokens as one engine."""
    other = EngineCore(TINY, EngineConfig(block_size=8, num_blocks=64, seed=99), load_format="dummy")
    prompt = list(range(3, 30))
    params = SamplingParams(max_tokens=12, temperature=1.5, seed=5, n=2, ignore_eos=True)
    engine.add_request("whole", prompt, params)
    whole, _ = _run(engine, "whole")

    engine.add_request("split", prompt, SamplingParams(**{**params.__dict__, "max_tokens": 1}), pin_prompt_blocks=True)
    first, _ = _run(engine, "split")
    blocks, cached = other.reserve_blocks(prompt)
    assert cached == 0
    other.kv_cache.tensor[blocks] = engine.kv_cache.tensor[first.pinned_block_ids]
    engine.release("split")
    out = other.add_prefilled_request("split", prompt, [c.token_ids[0] for c in first.outputs], params, blocks)
    rest = out if out.finished else _run(other, "split")[0]
    assert [c.token_ids for c in rest.outputs] == [c.token_ids for c in whole.outputs]
    assert whole.outputs[0].token_ids != whole.outputs[1].token_ids
