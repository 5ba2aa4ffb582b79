"""The engine's disaggregation hooks: prefill on one engine, blocks copied, decode on another."""

import pytest

from engine import EngineConfig, EngineCore, SamplingParams
from engine.core.block_pool import NoFreeBlocksError
from tests.helpers.engine import prefill_then_decode, run_until_finished

pytestmark = pytest.mark.slow
PROMPTS = ["The history of the printing press began", "List three prime numbers and explain why"]


@pytest.fixture(scope="module")
def engines():
    return EngineCore(None, EngineConfig(num_blocks=64)), EngineCore(None, EngineConfig(num_blocks=64))


@pytest.mark.parametrize(
    "params",
    [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
     SamplingParams(max_tokens=16, temperature=0.8, seed=11, n=2)],
)
def test_prefill_then_decode_equals_one_engine(engines, params):
    prefill, decode = engines
    free = (prefill.num_free_blocks, decode.num_free_blocks)
    for i, prompt in enumerate(PROMPTS):
        split = prefill_then_decode(prefill, decode, f"d{i}", prompt, params)
        prefill.add_request(f"ref{i}", prompt, params)
        reference = run_until_finished(prefill, f"ref{i}")
        assert [c.token_ids for c in split.outputs] == [c.token_ids for c in reference.outputs]
        assert [c.finish_reason for c in split.outputs] == [c.finish_reason for c in reference.outputs]
    assert (prefill.num_free_blocks, decode.num_free_blocks) == free


def test_reserve_refuses_when_full_and_frees(engines):
    _, decode = engines
    free = decode.num_free_blocks
    with pytest.raises(NoFreeBlocksError):
        decode.reserve_blocks(list(range(100, 100 + 16 * (free + 1))))
    blocks, cached = decode.reserve_blocks(list(range(200, 240)))
    assert decode.num_free_blocks == free - 3 and cached == 0
    decode.free_blocks(blocks)
    assert decode.num_free_blocks == free


def test_the_next_turn_reuses_what_the_decode_worker_holds(engines):
    """No resends: blocks the decode engine received and decoded are in its prefix cache, so a
    chat's next turn (previous prompt + answer + a question) reserves them as cached."""
    prefill, decode = engines
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    ids = prefill.tokenize(PROMPTS[0] + " in the fifteenth century, when")
    turn1 = prefill_then_decode(prefill, decode, "turn1", ids, params)
    history = ids + turn1.outputs[0].token_ids
    turn2 = history + prefill.tokenize(" And then what happened?")
    blocks, cached = decode.reserve_blocks(turn2)
    # every full block of the history but the last one (its last token's KV was never computed)
    assert cached == (len(history) - 1) // 16, (cached, len(history))
    decode.free_blocks(blocks)


def test_first_token_can_finish_the_request(engines):
    prefill, decode = engines
    free = decode.num_free_blocks
    ids = prefill.tokenize("Hello")
    blocks, _ = decode.reserve_blocks(ids)
    eos = next(iter(decode.eos_token_ids))
    out = decode.add_prefilled_request("eos", ids, [eos], SamplingParams(max_tokens=8), blocks)
    assert out.finished and out.outputs[0].finish_reason == "stop"
    assert decode.num_free_blocks == free and "eos" not in decode.requests


def test_block_hashes_handed_in_key_the_prefix_cache_as_the_engines_own(engines):
    """A caller hashes the prompt off the engine thread (the engine core's client does, on its event loop)
    and hands the hashes to ``reserve_blocks`` and ``add_prefilled_request``: the blocks join the
    prefix cache under the keys the engine computes itself; a wrong count is refused, nothing taken."""
    _, decode = engines
    ids = decode.tokenize(" ".join([PROMPTS[1]] * 8))
    hashes = decode.block_hashes(ids, "tenant")
    assert len(hashes) == len(ids) // 16 >= 3
    free = decode.num_free_blocks
    with pytest.raises(ValueError, match="block_hashes"):
        decode.reserve_blocks(ids, "tenant", hashes[:-1])
    assert decode.num_free_blocks == free
    blocks, cached = decode.reserve_blocks(ids, "tenant", hashes)
    assert cached == 0
    params = SamplingParams(max_tokens=1, temperature=0)
    with pytest.raises(ValueError, match="block_hashes"):
        decode.add_prefilled_request("hashed", ids, [1], params, blocks, "tenant", hashes + hashes[:1])
    assert decode.add_prefilled_request("hashed", ids, [1], params, blocks, "tenant", hashes).finished
    again, cached = decode.reserve_blocks(ids, "tenant")
    assert cached == len(hashes)
    decode.free_blocks(again)
    assert decode.num_free_blocks == free
