"""The step-overhead benchmark times what it names: a decode step of the running batch, then a
mixed step whose whole prompt chunk is computed (none of it served by the prefix cache, also
when one engine is measured again) and finished within it, and leaves the engine as it found it."""

from bench.step_overhead import step_costs
from engine import LLM


def test_decode_and_mixed_steps_are_timed_and_the_engine_is_left_empty():
    llm = LLM("smollm2-135m", load_format="dummy", enforce_eager=True, max_num_batched_tokens=64)
    free = llm.engine.num_free_blocks
    for seed in (0, 2):  # a second measurement of the same shape on the same engine
        metrics = step_costs(llm, batch=2, chunk=32, repeats=2, seed=seed)
        for kind in ("decode", "mixed"):
            assert 0 < metrics[f"{kind}_launch_min_ms"] <= metrics[f"{kind}_launch_ms"] <= metrics[f"{kind}_step_ms"]
        assert metrics["decode_step_tokens"] == 2
        assert metrics["mixed_step_tokens"] == 2 + 32
        assert not llm.engine.has_unfinished_requests
        assert llm.engine.num_free_blocks == free
    assert llm.engine.stats().step_totals["mixed"].steps >= 4  # each chunk rode a decode step of the batch
