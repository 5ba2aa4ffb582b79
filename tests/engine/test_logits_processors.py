"""The logit processing before sampling equals transformers' own logits processors (and OpenAI's
presence and frequency formulas) on the same logits; its per-sequence state is built once and
kept up to date on the device, and freed with the sequence."""

import math

import pytest
import torch
from transformers.generation.logits_process import (MinNewTokensLengthLogitsProcessor, NoBadWordsLogitsProcessor,
                                                    RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor)

from engine.core.sequence import Sequence
from engine.runner.grammar import Grammars
from engine.runner.logits_processors import LogitsProcessors
from engine.runner.sampler import SamplingBatch, sample
from engine.sampling_params import SamplingParams

VOCAB = 64
EOS = 3


def _processors() -> LogitsProcessors:
    return LogitsProcessors(VOCAB, torch.device("cpu"), [EOS], Grammars(None, VOCAB, [EOS]))


def _seq(prompt: list[int], output: list[int], params: SamplingParams, index: int = 0) -> Sequence:
    return Sequence(f"r{id(params)}-{index}", index, prompt + output, len(prompt), params, 0)


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _processed(processors: LogitsProcessors, seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
    batch = processors.batch(seqs)
    out = logits.clone()
    positions = torch.tensor([s.num_tokens for s in seqs], dtype=torch.int64)
    batch.apply(out, positions, None)
    return out


def _openai(logits: torch.Tensor, output: list[int], frequency: float, presence: float) -> torch.Tensor:
    counts = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=VOCAB).float()
    return logits - frequency * counts - presence * (counts > 0).float()


def test_repetition_penalty_equals_transformers_over_prompt_and_output():
    processors = _processors()
    cases = [([5, 6, 7], [7, 8, 8], 1.3), ([9], [], 2.0), ([1, 2], [40, 41, 1], 0.7)]
    seqs = [_seq(p, o, SamplingParams(repetition_penalty=r)) for p, o, r in cases]
    logits = _logits(len(cases))
    out = _processed(processors, seqs, logits)
    for row, (prompt, output, penalty) in enumerate(cases):
        hf = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([prompt + output]), logits[row:row + 1].clone())
        torch.testing.assert_close(out[row], hf[0])


def test_presence_and_frequency_follow_openai_over_the_output_only():
    processors = _processors()
    cases = [([5, 6, 7], [7, 8, 8, 8], 0.5, 1.5), ([9, 9], [2], -1.0, 0.3), ([1], [], 2.0, 2.0)]
    seqs = [_seq(p, o, SamplingParams(frequency_penalty=f, presence_penalty=pr)) for p, o, f, pr in cases]
    logits = _logits(len(cases), seed=1)
    out = _processed(processors, seqs, logits)
    for row, (_, output, frequency, presence) in enumerate(cases):
        torch.testing.assert_close(out[row], _openai(logits[row], output, frequency, presence))


def test_all_three_penalties_apply_repetition_first():
    processors = _processors()
    prompt, output = [4, 5], [5, 6, 6]
    seq = _seq(prompt, output, SamplingParams(repetition_penalty=1.5, frequency_penalty=0.4, presence_penalty=0.2))
    logits = _logits(1, seed=2)
    out = _processed(processors, [seq], logits)
    hf = RepetitionPenaltyLogitsProcessor(1.5)(torch.tensor([prompt + output]), logits.clone())
    torch.testing.assert_close(out[0], _openai(hf[0], output, 0.4, 0.2))


def test_counts_grow_on_the_device_from_sampled_tokens():
    """After joining, a sequence's counts come only from the tokens each step records: the
    host's token list is not read again (under async scheduling it lags)."""
    processors = _processors()
    params = SamplingParams(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.1)
    seqs = [_seq([10, 11], [12], params, 0), _seq([20], [], params, 1)]
    batch = processors.batch(seqs)
    history = [[12], []]
    for step_tokens in ([13, 20], [13, 21], [12, 20]):
        processors.record(batch, torch.tensor(step_tokens))
        for h, t in zip(history, step_tokens):
            h.append(t)
    logits = _logits(2, seed=3)
    out = logits.clone()
    batch.apply(out, torch.tensor([6, 4]), None)
    for row, (prompt, output) in enumerate([([10, 11], history[0]), ([20], history[1])]):
        hf = RepetitionPenaltyLogitsProcessor(1.2)(torch.tensor([prompt + output]), logits[row:row + 1].clone())
        torch.testing.assert_close(out[row], _openai(hf[0], output, 0.5, 0.1))


def test_min_tokens_equals_transformers_min_new_tokens():
    processors = _processors()
    cases = [([1, 2, 3], [], 2, [7]), ([1, 2, 3], [9], 2, []), ([1, 2, 3], [9, 9], 2, [7]), ([4], [5, 6], 4, [EOS])]
    seqs = [_seq(p, o, SamplingParams(min_tokens=m, stop_token_ids=stops)) for p, o, m, stops in cases]
    logits = _logits(len(cases), seed=4)
    out = _processed(processors, seqs, logits)
    for row, (prompt, output, min_tokens, stops) in enumerate(cases):
        hf = MinNewTokensLengthLogitsProcessor(len(prompt), min_tokens, [EOS, *stops])
        expected = hf(torch.tensor([prompt + output]), logits[row:row + 1].clone())
        torch.testing.assert_close(out[row], expected[0])
    assert out[0, 7] == -math.inf and out[2, 7] != -math.inf


def test_min_tokens_leaves_eos_alone_when_ignoring_it():
    processors = _processors()
    seq = _seq([1], [], SamplingParams(min_tokens=3, ignore_eos=True, stop_token_ids=[8]))
    logits = _logits(1, seed=5)
    out = _processed(processors, [seq], logits)
    assert out[0, EOS] == logits[0, EOS] and out[0, 8] == -math.inf


def test_bad_words_equal_transformers_over_the_output():
    processors = _processors()
    words = [[30], [31, 32], [33, 34, 35], [36, 32]]
    outputs = [[], [31], [5, 33, 34], [33, 36], [31, 33, 34]]
    params = SamplingParams(bad_words_token_ids=words)
    seqs = [_seq([1, 31], o, params, i) for i, o in enumerate(outputs)]
    logits = _logits(len(outputs), seed=6)
    out = _processed(processors, seqs, logits)
    for row, output in enumerate(outputs):
        hf = NoBadWordsLogitsProcessor(words)(torch.tensor([[0, 0, 0] + output]), logits[row:row + 1].clone())
        torch.testing.assert_close(out[row], hf[0])
    assert out[1, 32] == -math.inf and out[3, 32] == -math.inf and out[2, 35] == -math.inf
    assert out[0, 32] == logits[0, 32]  # the prompt's 31 does not start a word: the output does


def test_bad_words_follow_the_tokens_recorded_after_joining():
    processors = _processors()
    seq = _seq([1], [5], SamplingParams(bad_words_token_ids=[[33, 34, 35]]))
    batch = processors.batch([seq])
    for token in (33, 34):
        processors.record(batch, torch.tensor([token]))
    logits = _logits(1, seed=7)
    out = logits.clone()
    batch.apply(out, torch.tensor([4]), None)
    assert out[0, 35] == -math.inf
    processors.record(batch, torch.tensor([35]))
    out = logits.clone()
    batch.apply(out, torch.tensor([5]), None)
    torch.testing.assert_close(out, logits)


def test_logit_bias_equals_transformers_sequence_bias():
    processors = _processors()
    bias = {4: 5.0, 9: -100.0, 63: 0.25}
    seq = _seq([1], [2], SamplingParams(logit_bias=bias))
    logits = _logits(1, seed=8)
    out = _processed(processors, [seq], logits)
    hf = SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])(torch.tensor([[1, 2]]), logits.clone())
    torch.testing.assert_close(out, hf)


def test_rows_without_processing_are_untouched_and_a_plain_batch_has_none():
    processors = _processors()
    plain = SamplingParams(temperature=0)
    assert processors.batch([_seq([1], [], plain), _seq([2], [3], plain, 1)]) is None
    seqs = [_seq([1], [2], plain), _seq([1], [2], SamplingParams(repetition_penalty=2.0, logit_bias={5: 1.0}), 1),
            _seq([4], [], plain, 2)]
    logits = _logits(3, seed=9)
    out = _processed(processors, seqs, logits)
    torch.testing.assert_close(out[[0, 2]], logits[[0, 2]])
    assert not torch.equal(out[1], logits[1])


def test_sampling_draws_from_processed_logits_but_reports_the_models_logprobs():
    processors = _processors()
    seqs = [_seq([1], [], SamplingParams(temperature=0, logprobs=3, logit_bias={17: 100.0})),
            _seq([1], [], SamplingParams(temperature=0, logprobs=3), 1)]
    logits = _logits(2, seed=10)
    positions = torch.tensor([1, 1])
    batch = SamplingBatch.from_sequences(seqs, positions, processors.batch(seqs))
    out = sample(logits.clone(), batch, (0, 0))
    assert out.token_ids[0] == 17 and out.token_ids[1] == logits[1].argmax()
    reference = logits.log_softmax(-1)
    torch.testing.assert_close(out.logprobs, reference.gather(1, out.token_ids[:, None]).squeeze(1))
    top = reference.topk(3, dim=-1)
    torch.testing.assert_close(out.top_logprobs, top.values)
    assert torch.equal(out.top_ids, top.indices)
    # without top-N: a ban (the sampled token's logit untouched) and a penalty (moved)
    banned = int(logits[0].argmax())
    seqs = [_seq([1], [], SamplingParams(temperature=0, bad_words_token_ids=[[banned]])),
            _seq([1], [4], SamplingParams(temperature=0, frequency_penalty=2.0), 1)]
    batch = SamplingBatch.from_sequences(seqs, positions, processors.batch(seqs))
    out = sample(logits.clone(), batch, (0, 0))
    assert out.token_ids[0] != banned and out.top_ids is None
    torch.testing.assert_close(out.logprobs, reference.gather(1, out.token_ids[:, None]).squeeze(1))


def test_the_mask_applies_row_i_of_the_bitmask_to_row_i_of_the_listed_rows():
    from engine.runner.logits_processors import _mask

    words = -(-VOCAB // 32)
    bitmask = torch.zeros(3, words, dtype=torch.int32)
    bitmask[2, 0] = 0b1010  # row 2 allows tokens 1 and 3
    bitmask[0, 1] = 1  # row 0 (not listed) would allow token 32 only
    logits = _logits(3, seed=13)
    masked = logits.clone()
    _mask(masked, bitmask, torch.tensor([2]))
    torch.testing.assert_close(masked[:2], logits[:2])
    assert torch.isfinite(masked[2]).tolist() == [t in (1, 3) for t in range(VOCAB)]


def test_state_is_freed_with_the_sequence_and_a_reused_slot_refilled():
    processors = _processors()
    params = SamplingParams(frequency_penalty=1.0)
    first = _seq([1], [7, 7], params)
    batch = processors.batch([first])
    processors.record(batch, torch.tensor([7]))
    assert processors.num_sequences == 1
    version = processors.version
    processors.release(first)
    processors.release(first)  # a second release (finish after preemption) is a no-op
    assert processors.num_sequences == 0 and processors.version == version + 1
    assert processors.penalties.num_free == processors.penalties.capacity
    second = _seq([2], [9], params, 1)
    logits = _logits(1, seed=11)
    out = _processed(processors, [second], logits)
    torch.testing.assert_close(out[0], _openai(logits[0], [9], 1.0, 0.0))


def test_slots_grow_past_the_first_allocation():
    processors = _processors()
    params = SamplingParams(presence_penalty=1.0)
    seqs = [_seq([1], [i % VOCAB], params, i) for i in range(20)]
    logits = _logits(20, seed=12)
    out = _processed(processors, seqs, logits)
    for row, seq in enumerate(seqs):
        torch.testing.assert_close(out[row], _openai(logits[row], seq.output_token_ids, 0.0, 1.0))
    assert processors.penalties.capacity >= 20 and processors.num_sequences == 20


@pytest.mark.parametrize("kwargs, field", [
    ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"), ({"logit_bias": {1: 101.0}}, "logit_bias"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"), ({"bad_words_token_ids": [[]]}, "bad_words_token_ids"),
    ({"bad_words_token_ids": [list(range(33))]}, "bad_words_token_ids"),
    ({"num_resumed_tokens": -1}, "num_resumed_tokens"),
])
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**kwargs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_processing_on_cuda_equals_the_cpu_step_after_step():
    """The same batch processed and recorded on both devices, three steps running, and the
    bitmask kernel (xgrammar's Triton one on CUDA, its C++ one on the CPU)."""
    from engine.runner.logits_processors import _mask

    params = [SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2),
              SamplingParams(temperature=0), SamplingParams(bad_words_token_ids=[[30], [31, 32]], min_tokens=3,
                                                            stop_token_ids=[7], logit_bias={5: 2.0, 6: -100.0})]
    results = []
    for device in (torch.device("cpu"), torch.device("cuda")):
        processors = LogitsProcessors(VOCAB, device, [EOS], Grammars(None, VOCAB, [EOS]))
        seqs = [_seq([1, 2, 31], [31], p, i) for i, p in enumerate(params)]
        batch = processors.batch(seqs)
        outs = []
        for step, tokens in enumerate(([31, 4, 31], [5, 5, 9], [8, 8, 31])):
            logits = _logits(3, seed=20 + step).to(device)
            batch.apply(logits, torch.tensor([5 + step] * 3, device=device), None)
            processors.record(batch, torch.tensor(tokens, device=device))
            outs.append(logits.cpu())
        results.append(outs)
    for cpu, cuda in zip(*results):
        torch.testing.assert_close(cuda, cpu)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, -(-VOCAB // 32)), dtype=torch.int32,
                            generator=torch.Generator().manual_seed(3))
    rows = torch.tensor([0, 2])
    masked = [_logits(3, seed=30) for _ in range(2)]
    _mask(masked[0], bitmask, rows)
    on_cuda = masked[1].cuda()
    _mask(on_cuda, bitmask.cuda(), rows.cuda())
    torch.testing.assert_close(on_cuda.cpu(), masked[0])
    assert torch.isinf(masked[0][0]).any() and not torch.isinf(masked[0][1]).any()
