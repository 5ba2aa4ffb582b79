"""The step-overhead benchmark times what it names: a decode step of the running batch, then a
mixed step whose prompt chunk is prefilled and finished within it, and leaves the engine as it
found it."""

from bench.step_overhead import step_costs
from engine import LLM


def test_decode_and_mixed_steps_are_timed_and_the_engine_is_left_empty():
    llm = LLM("smollm2-135m", load_format="dummy", enforce_eager=True, max_num_batched_tokens=64)
    free = llm.engine.num_free_blocks
    metrics = step_costs(llm, batch=2, chunk=32, repeats=2)
    for kind in ("decode", "mixed"):
        assert 0 < metrics[f"{kind}_launch_min_ms"] <= metrics[f"{kind}_launch_ms"] <= metrics[f"{kind}_step_ms"]
    assert not llm.engine.has_unfinished_requests
    assert llm.engine.num_free_blocks == free
    stats = llm.engine.stats().step_totals
    assert stats["mixed"].steps >= 2  # each chunk rode a decode step of the batch
