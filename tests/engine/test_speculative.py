"""Speculative decoding: prompt-lookup drafts, verification over the paged KV, exact acceptance,
the KV of rejected drafts rolled back (no leak), stops inside an accepted run, and the sampled
distribution kept at temperature 1."""

import collections
import math

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig, SpeculativeConfig, resolve_disable_by_batch_size
from engine.core.block_pool import BlockPool
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence, SequenceStatus
from engine.loading.presets import PRESETS
from engine.model_source import default_gguf_path
from engine.speculative.acceptance import num_accepted
from engine.speculative.ngram import propose_ngram
from engine.speculative.suffix import SuffixProposer, SuffixTrie
from tests.helpers.engine import prefill_then_decode
from tests.helpers.prompts import GROUNDED_CHATS

# Speculating at every batch size (the CPU's default stops above 2 running sequences).
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 1024}
# The weights dequantized to float32 (the path that matches HF transformers): a verification's
# rows go through matmuls of more rows than a plain decode step's, and with the GGUF weights'
# bfloat16 matmuls the two round up to a bfloat16 step apart, which flips near-ties
# (bench/speculative.py measures how often on that path).
EXACT = dict(block_size=16, num_blocks=256, quantization="none")
DRAFT = {"method": "draft_model", "num_speculative_tokens": 4, "disable_by_batch_size": 1024}
# A draft of the target's vocabulary with random weights: its drafts are almost never accepted.
RANDOM_DRAFT = {**PRESETS["smollm2-135m"], "num_hidden_layers": 2}


def test_ngram_drafts_follow_the_latest_longest_match():
    tokens = np.array([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3], dtype=np.int64)
    # "2 3" occurs at 1 and 5; its latest earlier occurrence (5) is followed by 7, 8, 5.
    assert propose_ngram(tokens, 2, 3, 3) == [7, 8, 5]
    # the trigram "5 2 3" does not occur earlier, "2 3" does: the longest match wins
    assert propose_ngram(tokens, 1, 3, 2) == [7, 8]
    assert propose_ngram(tokens, 3, 3, 2) == []
    # a match near the end drafts only what follows it
    assert propose_ngram(np.array([4, 6, 4], dtype=np.int64), 1, 2, 5) == [6, 4]


def test_suffix_trie_counts_substrings_and_uncounts_them():
    trie = SuffixTrie(max_depth=4)
    active = trie.add([1, 2, 3, 4])
    trie.add([1, 2, 3, 5, 1, 2, 3], active=active)  # one stream, added in two parts
    length, node = trie.match([7, 1, 2, 3])
    assert length == 3 and {t: c.count for t, c in node.children.items()} == {4: 1, 5: 1}
    assert trie.root.children[1].count == 3 and trie.root.count == 11
    other = SuffixTrie(max_depth=4)
    other.add([9, 9, 8])
    other.add([9, 9, 8], sign=-1)
    assert other.root.children == {} and other.root.count == 0


def _seq(tokens, index=0):
    return Sequence("r", index, list(tokens), 1, SamplingParams(), index)


def test_suffix_proposer_drafts_from_its_own_and_recent_requests_tokens():
    proposer = SuffixProposer(max_depth=8, max_cached_requests=1, min_token_prob=0.1)
    seq = _seq([5, 6, 7, 8, 1, 5, 6])
    assert proposer.propose([seq], [3]) == [[7, 8, 1]]
    seq.token_ids += [7, 8]  # grown since: only the new tokens are added
    assert proposer.propose([seq], [2]) == [[1, 5]]
    finished = _seq([40, 41, 42, 43, 44])
    finished.status = SequenceStatus.FINISHED
    proposer.release(finished)
    assert proposer.propose([_seq([3, 40, 41])], [4]) == [[42, 43, 44]]
    newer = _seq([50, 51, 52])
    newer.status = SequenceStatus.FINISHED
    proposer.release(newer)  # one request kept: the older one's tokens leave the shared tree
    assert proposer.propose([_seq([3, 40, 41], 1)], [4]) == [[]]
    skipped = _seq([60, 61, 62, 63])
    skipped.status = SequenceStatus.FINISHED
    proposer.release(skipped, learn=False)  # the engine does not speculate at its batch size
    assert proposer.propose([_seq([3, 61, 62], 2)], [4]) == [[]]
    assert proposer.propose([_seq([3, 51], 3)], [4]) == [[52]]  # the newer request's output stays


def test_the_shared_suffix_tree_holds_outputs_not_prompts():
    proposer = SuffixProposer(max_depth=8, max_cached_requests=4, min_token_prob=0.1)
    finished = Sequence("r", 0, [70, 71, 72, 73, 74], 3, SamplingParams(), 0)  # prompt 70-72, output 73, 74
    finished.status = SequenceStatus.FINISHED
    proposer.release(finished)
    assert proposer.propose([_seq([1, 70])], [3]) == [[]]
    assert proposer.propose([_seq([1, 73], 1)], [3]) == [[74]]


def test_acceptance_is_the_longest_matching_prefix():
    assert num_accepted([5, 6, 7], [5, 6, 7, 8]) == 3
    assert num_accepted([5, 6, 7], [5, 9, 7, 8]) == 1
    assert num_accepted([5], [4, 1]) == 0


def test_speculation_stops_above_two_running_sequences_on_the_cpu_by_default():
    assert resolve_disable_by_batch_size(SpeculativeConfig(), "cpu") == 2
    assert resolve_disable_by_batch_size(SpeculativeConfig(), "cuda") == 4
    assert resolve_disable_by_batch_size(SpeculativeConfig(disable_by_batch_size=8), "cpu") == 8


def test_config_refuses_bad_speculative_settings():
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        EngineConfig(speculative_config={"prompt_lookup_min": 4, "prompt_lookup_max": 3})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(speculative_config={"num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="model: set it for method 'draft_model'"):
        EngineConfig(speculative_config={"method": "draft_model"})
    with pytest.raises(ValueError, match="model: set it for method 'draft_model'"):
        EngineConfig(speculative_config={"method": "ngram", "model": "smollm2-135m"})


def test_scheduler_budgets_drafts_and_rewind_frees_their_blocks():
    pool = BlockPool(16)
    kv = KVCacheManager(pool, 4, b"seed")
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=6, max_model_len=64)
    seq = Sequence("r", 0, list(range(7)), 6, SamplingParams(max_tokens=20), 0)
    kv.allocate_slots(seq, 6)
    seq.num_computed_tokens = 6  # decoding: every token but the last computed
    sched.add_running(seq)
    free = pool.num_free_blocks
    step = sched.schedule({seq: [1, 2, 3, 4, 5, 6, 7]})
    (s,) = step.scheduled
    assert s.num_new_tokens == 6 and s.spec_token_ids == [1, 2, 3, 4, 5] and s.samples  # budget of 6 tokens
    assert seq.num_computed_tokens == 12 and len(seq.block_table) == 3
    kv.rewind(seq, 8)  # one draft accepted
    assert seq.num_computed_tokens == 8 and len(seq.block_table) == 2 and pool.num_free_blocks == free
    pool.check_invariants()


@pytest.fixture(scope="module")
def engines():
    """(plain, speculating) LLMs on the real SmolLM2."""
    return LLM(**EXACT), LLM(**EXACT, speculative_config=NGRAM)


@pytest.fixture(scope="module")
def drafted():
    """LLMs drafting with a draft model: the target itself, and :data:`RANDOM_DRAFT`."""
    return (LLM(**EXACT, speculative_config={**DRAFT, "model": str(default_gguf_path())}),
            LLM(**EXACT, speculative_config={**DRAFT, "model": RANDOM_DRAFT}))


@pytest.fixture(autouse=True)
def no_leaks(request):
    names = [name for name in ("engines", "drafted") if name in request.fixturenames]
    llms = [llm for name in names for llm in request.getfixturevalue(name)]
    free = [llm.engine.num_free_blocks for llm in llms]
    yield
    for llm, before in zip(llms, free):
        assert llm.engine.num_free_blocks == before, "blocks leaked"
        assert not llm.engine.requests
        llm.engine.block_pool.check_invariants()


def _tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.mark.slow
def test_greedy_output_equals_no_speculation_token_for_token(engines):
    plain, spec = engines
    params = SamplingParams(max_tokens=48, temperature=0)
    before = spec.engine.stats().spec_decoding
    want = _tokens(plain.chat(GROUNDED_CHATS, params, use_tqdm=False))
    got = _tokens(spec.chat(GROUNDED_CHATS, params, use_tqdm=False))
    assert got == want
    after = spec.engine.stats().spec_decoding
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    assert accepted > 0.2 * sum(len(t[0]) for t in got)  # answers that copy: many tokens come from drafts


@pytest.mark.slow
def test_a_request_limits_its_own_drafts_and_keeps_its_output(engines):
    """``SamplingParams.num_speculative_tokens``: 0 drafts nothing for the request, 1 at most one
    token a verification, 8 is capped at the engine's 4; the output is the same each time."""
    plain, spec = engines
    chat = GROUNDED_CHATS[0]
    want = _tokens(plain.chat(chat, SamplingParams(max_tokens=32, temperature=0), use_tqdm=False))
    for limit, cap in ((0, 0), (1, 1), (8, NGRAM["num_speculative_tokens"])):
        before = spec.engine.stats().spec_decoding
        params = SamplingParams(max_tokens=32, temperature=0, num_speculative_tokens=limit)
        assert _tokens(spec.chat(chat, params, use_tqdm=False)) == want, limit
        after = spec.engine.stats().spec_decoding
        verifications = after.num_drafts - before.num_drafts
        drafted = after.num_draft_tokens - before.num_draft_tokens
        assert (verifications > 0) == (cap > 0) and drafted <= cap * verifications, (limit, verifications, drafted)
        if cap > 1:
            assert drafted > verifications  # the cap, not the limit of one, bounds the longer drafts


@pytest.mark.slow
def test_stop_token_stop_string_and_max_tokens_cut_inside_an_accepted_run(engines):
    plain, spec = engines
    chat = GROUNDED_CHATS[0]
    (full,) = _tokens(plain.chat(chat, SamplingParams(max_tokens=40, temperature=0), use_tqdm=False))[0:1]
    full = full[0]
    stop_id = full[21]  # deep in the copied passage, where drafts are accepted in runs
    cut = full.index(stop_id) + 1
    out = spec.chat(chat, SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[stop_id]), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == full[:cut] and out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].stop_reason == stop_id
    for max_tokens in (13, 14, 15):
        out = spec.chat(chat, SamplingParams(max_tokens=max_tokens, temperature=0), use_tqdm=False)[0]
        assert out.outputs[0].token_ids == full[:max_tokens] and out.outputs[0].finish_reason == "length"
    stop = "square kilometres"
    want = plain.chat(chat, SamplingParams(max_tokens=40, temperature=0, stop=[stop]), use_tqdm=False)[0].outputs[0]
    got = spec.chat(chat, SamplingParams(max_tokens=40, temperature=0, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == (
        want.text, want.token_ids, "stop", stop)
    assert len(got.logprobs) == len(got.token_ids)


@pytest.mark.slow
def test_prefix_cache_holds_only_accepted_tokens(engines):
    plain, spec = engines
    chat = GROUNDED_CHATS[1]
    params = SamplingParams(max_tokens=40, temperature=0)
    first = spec.chat(chat, params, use_tqdm=False)[0]
    # The next turn's prompt is the first's prompt and answer: its full blocks must come from the
    # cache and hold the KV of exactly those tokens (else the continuation would differ).
    follow_up = first.prompt_token_ids + first.outputs[0].token_ids
    again = spec.generate([follow_up], params, use_tqdm=False)[0]
    assert again.num_cached_tokens >= (len(follow_up) - 1) // 16 * 16 - 16
    assert again.num_cached_tokens > len(first.prompt_token_ids)
    want = plain.generate([follow_up], params, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == want.outputs[0].token_ids


@pytest.mark.slow
def test_seeded_sampling_equals_no_speculation(engines):
    plain, spec = engines
    params = [SamplingParams(max_tokens=32, temperature=t, top_p=0.95, seed=seed)
              for t, seed in ((0.7, 1), (1.0, 2), (1.3, 3))]
    assert _tokens(spec.chat(GROUNDED_CHATS, params, use_tqdm=False)) == _tokens(
        plain.chat(GROUNDED_CHATS, params, use_tqdm=False))


def _chi_square_p(a: collections.Counter, b: collections.Counter) -> float:
    """p-value of Pearson's chi-square test that two samples of tokens come from one
    distribution (tokens seen fewer than 5 times in all pooled into one category)."""
    total = a + b
    common = [t for t, c in total.items() if c >= 5]
    cats = [(a[t], b[t]) for t in common] + [(sum(a[t] for t in total if t not in common),
                                             sum(b[t] for t in total if t not in common))]
    cats = [c for c in cats if sum(c)]
    na, nb = sum(a.values()), sum(b.values())
    chi2 = 0.0
    for ca, cb in cats:
        n = ca + cb
        ea, eb = n * na / (na + nb), n * nb / (na + nb)
        chi2 += (ca - ea) ** 2 / ea + (cb - eb) ** 2 / eb
    df = len(cats) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(chi2 / 2, dtype=torch.float64))) if df else 1.0


@pytest.mark.slow
def test_temperature_one_token_distribution_matches_no_speculation(engines):
    """200 unseeded samples at temperature 1 of a chat that copies its input, with and without
    speculation: at each of output positions 1-5 (position 0 is the prefill's) a chi-square test
    of homogeneity of the two samples' tokens keeps p >= 0.001 (0.5% family-wise). Speculation
    must also have accepted drafts, or the test says nothing."""
    plain, spec = engines
    params = SamplingParams(max_tokens=6, temperature=1.0, n=8)
    chats = [GROUNDED_CHATS[0]] * 25
    before = spec.engine.stats().spec_decoding.num_accepted_tokens
    with_spec = [c.token_ids for o in spec.chat(chats, params, use_tqdm=False) for c in o.outputs]
    assert spec.engine.stats().spec_decoding.num_accepted_tokens - before > 100
    without = [c.token_ids for o in plain.chat(chats, params, use_tqdm=False) for c in o.outputs]
    for pos in range(1, 6):
        p = _chi_square_p(collections.Counter(t[pos] for t in with_spec if len(t) > pos),
                          collections.Counter(t[pos] for t in without if len(t) > pos))
        assert p >= 1e-3, f"position {pos}: p = {p:.2g}"


@pytest.mark.slow
def test_speculation_is_off_above_disable_by_batch_size():
    llm = LLM(block_size=16, num_blocks=128, speculative_config={**NGRAM, "disable_by_batch_size": 2})
    params = SamplingParams(max_tokens=12, temperature=0)
    llm.chat(GROUNDED_CHATS, params, use_tqdm=False)  # three running: no drafts
    assert llm.engine.stats().spec_decoding.num_drafts == 0
    llm.chat(GROUNDED_CHATS[:2], params, use_tqdm=False)
    stats = llm.engine.stats().spec_decoding
    assert stats.num_drafts > 0 and len(stats.acceptance_rate_per_position) == 4
    assert set(llm.engine.stats().step_totals) == {"prefill", "decode"}  # a verify step is a decode step
    assert llm.engine.num_free_blocks == 128


@pytest.mark.slow
def test_suffix_method_is_exact_and_learns_from_finished_requests(engines):
    plain, _ = engines
    llm = LLM(**EXACT, speculative_config={**NGRAM, "method": "suffix", "num_speculative_tokens": 6})
    params = SamplingParams(max_tokens=40, temperature=0)
    want = _tokens(plain.chat(GROUNDED_CHATS, params, use_tqdm=False))
    assert _tokens(llm.chat(GROUNDED_CHATS, params, use_tqdm=False)) == want
    first = llm.engine.stats().spec_decoding
    # The same chats again: their answers are in the shared tree now, so nearly every draft holds.
    assert _tokens(llm.chat(GROUNDED_CHATS, params, use_tqdm=False)) == want
    second = llm.engine.stats().spec_decoding
    rate = (second.num_accepted_tokens - first.num_accepted_tokens) / (second.num_draft_tokens - first.num_draft_tokens)
    assert rate > 0.8 and rate > first.acceptance_rate
    assert llm.engine.num_free_blocks == 256


@pytest.mark.slow
def test_a_decode_engine_speculates_after_a_prefill_on_another(engines):
    plain, spec = engines
    prompt = plain.engine.tokenizer.apply_chat_template(GROUNDED_CHATS[0])
    params = SamplingParams(max_tokens=32, temperature=0)
    before = spec.engine.stats().spec_decoding.num_accepted_tokens
    out = prefill_then_decode(plain.engine, spec.engine, "split", prompt, params)
    assert out.outputs[0].token_ids == plain.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert spec.engine.stats().spec_decoding.num_accepted_tokens > before


def _acceptance(llm, run):
    """``run()``'s result and the fraction of the drafts proposed meanwhile that were accepted."""
    before = llm.engine.stats().spec_decoding
    out = run()
    after = llm.engine.stats().spec_decoding
    return out, (after.num_accepted_tokens - before.num_accepted_tokens) / (after.num_draft_tokens - before.num_draft_tokens)


@pytest.mark.slow
def test_draft_model_is_exact_with_itself_and_with_random_weights_as_draft(engines, drafted):
    """Greedy and seeded ``n = 2`` answers with a draft model equal plain decoding's; the target
    as its own draft has nearly every draft accepted, a random-weight draft nearly none."""
    plain, _ = engines
    greedy = SamplingParams(max_tokens=40, temperature=0)
    seeded = SamplingParams(max_tokens=24, temperature=0.8, seed=7, n=2)
    want = _tokens(plain.chat(GROUNDED_CHATS, greedy, use_tqdm=False))
    want_seeded = _tokens(plain.chat(GROUNDED_CHATS[:1], seeded, use_tqdm=False))
    rates = []
    for llm in drafted:
        got, rate = _acceptance(llm, lambda: _tokens(llm.chat(GROUNDED_CHATS, greedy, use_tqdm=False)))
        assert got == want
        assert _tokens(llm.chat(GROUNDED_CHATS[:1], seeded, use_tqdm=False)) == want_seeded
        rates.append(rate)
    assert rates[0] > 0.9 and rates[1] < 0.1, rates


@pytest.mark.slow
def test_a_draft_model_catches_up_on_a_prompt_prefilled_elsewhere(engines, drafted):
    """A decode engine given a request's prompt KV by a prefill engine runs the prompt through
    its draft first: the target as its own draft then has its drafts accepted."""
    plain, _ = engines
    spec = drafted[0]
    prompt = plain.engine.tokenizer.apply_chat_template(GROUNDED_CHATS[1])
    params = SamplingParams(max_tokens=32, temperature=0)
    out, rate = _acceptance(spec, lambda: prefill_then_decode(plain.engine, spec.engine, "split", prompt, params))
    assert out.outputs[0].token_ids == plain.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert rate > 0.9


def test_a_draft_models_kv_shares_the_pool_and_its_vocabulary_is_the_targets():
    """Under a KV memory budget a block holds the target's KV and the draft's: a draft of the
    target's shape halves the blocks. A draft of another vocabulary is refused."""
    config = dict(model="smollm2-135m", load_format="dummy", block_size=16, kv_cache_memory_bytes=32 << 20)
    alone = LLM(**config).engine.num_blocks
    drafted = LLM(**config, speculative_config={"method": "draft_model", "model": "smollm2-135m"}).engine
    assert drafted.num_blocks == alone // 2
    assert drafted.proposer.runner.kv_cache.tensor.shape[0] == drafted.num_blocks
    with pytest.raises(ValueError, match="speculative_config.model: the draft's vocabulary has 1000 tokens"):
        LLM(**config, speculative_config={"method": "draft_model", "model": {**RANDOM_DRAFT, "vocab_size": 1000}})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_verifications_replay_the_decode_graphs_and_stay_exact():
    """float32 on the GPU: speculation's greedy answers equal plain decoding's, and every step
    of decodes and verifications replays a decode CUDA graph (one row per verified token)."""
    config = dict(device="cuda", dtype="float32", block_size=16, quantization="none", gpu_memory_utilization=0.3)
    plain, spec = LLM(**config), LLM(**config, speculative_config={**NGRAM, "disable_by_batch_size": 8})
    params = SamplingParams(max_tokens=48, temperature=0)
    prompts = [plain.engine.tokenizer.apply_chat_template(chat) for chat in GROUNDED_CHATS]
    want = _tokens(plain.generate(prompts, params, use_tqdm=False))
    free = spec.engine.num_free_blocks
    for i, prompt in enumerate(prompts):
        spec.engine.add_request(f"r{i}", prompt, params)
    answers, verify_graphs = {}, []
    while spec.engine.has_unfinished_requests:
        out = spec.engine.step()
        if out.stats is not None and out.stats.num_verifies:
            verify_graphs.append(out.stats.cuda_graph_size)
        answers.update((o.request_id, [c.token_ids for c in o.outputs]) for o in out.outputs if o.finished)
    assert [answers[f"r{i}"] for i in range(len(prompts))] == want
    # (the steps beside a prompt's chunk run the paged prefill path)
    assert verify_graphs and sum(size is not None for size in verify_graphs) >= 0.8 * len(verify_graphs)
    assert spec.engine.num_free_blocks == free


@pytest.mark.slow
def test_async_scheduling_overlaps_the_steps_that_do_not_speculate_and_stays_exact(engines):
    """Three chats over a rule of two: the first steps overlap (no drafts), the rest speculate,
    each after the step ahead of it, once the short chat has finished; the answers are plain
    decoding's."""
    plain, _ = engines
    llm = LLM(**EXACT, async_scheduling=True, speculative_config={**NGRAM, "disable_by_batch_size": 2})
    engine = llm.engine
    params = [SamplingParams(max_tokens=n, temperature=0) for n in (8, 40, 40)]
    prompts = [engine.tokenizer.apply_chat_template(chat) for chat in GROUNDED_CHATS]
    want = _tokens(plain.generate(prompts, params, use_tqdm=False))
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, p)
    answers, overlapped, verified_in_overlap = {}, 0, 0
    while engine.has_unfinished_requests:
        out = engine.step()
        overlapped += engine.has_steps_in_flight and len(engine.scheduler.running) > 2
        if out.stats is not None and out.stats.num_verifies and len(engine.scheduler.running) > 2:
            verified_in_overlap += 1
        answers.update((o.request_id, [c.token_ids for c in o.outputs]) for o in out.outputs if o.finished)
    assert [answers[f"r{i}"] for i in range(3)] == want
    assert overlapped > 3 and verified_in_overlap == 0
    assert engine.stats().spec_decoding.num_accepted_tokens > 0
    assert engine.num_free_blocks == 256


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_a_draft_model_drafts_in_its_own_decode_graphs_and_stays_exact():
    """float32 on the GPU, the target as its own draft: the draft's runner has decode graphs,
    greedy answers equal plain decoding's, nearly every draft is accepted and no block leaks."""
    config = dict(device="cuda", dtype="float32", block_size=16, quantization="none", gpu_memory_utilization=0.2)
    plain = LLM(**config)
    spec = LLM(**config, speculative_config={**DRAFT, "model": str(default_gguf_path()), "disable_by_batch_size": 8})
    assert spec.engine.proposer.runner.graphs is not None
    params = SamplingParams(max_tokens=48, temperature=0)
    free = spec.engine.num_free_blocks
    got, rate = _acceptance(spec, lambda: _tokens(spec.chat(GROUNDED_CHATS, params, use_tqdm=False)))
    assert got == _tokens(plain.chat(GROUNDED_CHATS, params, use_tqdm=False))
    assert rate > 0.9
    assert spec.engine.num_free_blocks == free
