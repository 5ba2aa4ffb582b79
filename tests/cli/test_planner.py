"""The P:D planner (cli/planner.py): its rates file is what the result files measured, its
workloads are the serving benchmark's, its predictions follow the queueing model it documents,
its choices move the way the workload does, and it refuses objectives no layout can meet."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from bench.serving import make_workload
from cli.planner import (
    WORKLOADS, ImpossibleObjectives, Layout, Objectives, PoolRates, Rates, layouts, parse_workload, plan, predict,
)
from tests.helpers.paths import ROOT

RATES_FILE = ROOT / "deploy" / "plan" / "llama-3-8b-h200.json"
RESULTS = ROOT / "bench" / "results"


def newest_record(benchmark: str, tag: str) -> dict[str, float]:
    """The metrics of ``benchmark``'s newest result file tagged ``tag`` (a file's name is the
    benchmark, its tag and its UTC stamp, so the names sort by time)."""
    return json.loads(max((RESULTS / benchmark).glob(f"{benchmark}-{tag}-*.json")).read_text())["metrics"]


@pytest.fixture(scope="module")
def rates() -> Rates:
    return Rates.load(RATES_FILE)


def named_record(rates: Rates, figure: str) -> dict[str, float]:
    """The metrics of the result file the rates file names as ``figure``'s source (the source's
    text starts with the file's path)."""
    path = rates.sources[figure].split(":", 1)[0]
    return json.loads((ROOT / path).read_text())["metrics"]


def test_the_rates_file_holds_what_the_result_files_it_names_measured(rates):
    tp1, tp2 = rates.tensor_parallel[1], rates.tensor_parallel[2]
    serving = named_record(rates, "tensor_parallel.1.prefill_tokens_per_s")
    busy_s = serving["service_prefill_prefill_steps"] * serving["service_prefill_prefill_step_ms"] / 1e3
    # 64 long prompts of 3072-4096 tokens went to the prefill worker: 3584 on average
    assert serving["placements_remote"] == 64
    assert tp1.prefill_tokens_per_s == pytest.approx(64 * 3584 / busy_s, rel=1e-4)
    steps = named_record(rates, "tensor_parallel.*.decode_step_s")
    for pool, tp in ((tp1, 1), (tp2, 2)):
        assert pool.decode_step_s == {b: pytest.approx(steps[f"tp{tp}_decode_step_ms_b{b}"] / 1e3) for b in (1, 8, 32, 128)}
    kernel = named_record(rates, "tensor_parallel.1.decode_s_per_context_token")["long_tail_us_64_uniform2000_own"]
    assert tp1.decode_s_per_context_token == pytest.approx(kernel * 1e-6 / (64 * 2000) * 32, rel=1e-3)
    assert tp2.decode_s_per_context_token == pytest.approx(tp1.decode_s_per_context_token / 2)
    throughput = named_record(rates, "tensor_parallel.1.kv_cache_tokens")
    assert tp1.kv_cache_tokens == throughput["kv_cache_blocks"] * 16
    assert rates.sizes("prefill") == [1] and rates.sizes("decode") == [1, 2]


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_the_workloads_are_the_serving_benchmarks(name):
    requests = make_workload(name, 400, vocab_size=128_256)
    classes = WORKLOADS[name].classes
    for cls in classes:
        lo, hi = cls.prompt_tokens
        mine = [r for r in requests if r.max_tokens == cls.output_tokens]
        assert len(mine) / len(requests) == pytest.approx(cls.fraction, abs=0.01)
        assert all(lo <= len(r.prompt) <= hi for r in mine)
        assert min(len(r.prompt) for r in mine) < lo + (hi - lo) / 4 and max(len(r.prompt) for r in mine) > hi - (hi - lo) / 4
    assert sum(c.fraction for c in classes) == pytest.approx(1.0)


def test_a_workload_is_named_or_spelt_out_and_a_bad_one_is_refused():
    assert parse_workload("long") is WORKLOADS["long"]
    mix = parse_workload("0.25:100-200:64,0.75:1000:8")
    assert [(c.fraction, c.prompt_tokens, c.output_tokens) for c in mix.classes] == [(0.25, (100, 200), 64),
                                                                                     (0.75, (1000, 1000), 8)]
    with pytest.raises(ValueError, match="FRACTION:MIN-MAX:OUTPUT"):
        parse_workload("lots")
    with pytest.raises(ValueError, match="sum to 0.5"):
        parse_workload("0.5:100:10")
    with pytest.raises(ValueError, match="prompt tokens 1 <= min <= max"):
        parse_workload("1:300-200:10")


def test_a_rates_file_with_a_wrong_field_is_refused_naming_it(tmp_path):
    bad = json.loads(RATES_FILE.read_text())
    bad["tensor_parallel"]["1"]["prefill_tokens_per_s"] = -1
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="prefill_tokens_per_s"):
        Rates.load(tmp_path / "bad.json")
    del bad["tensor_parallel"]["1"]
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="decode is measured at TP 2, prefill at no TP size up to it"):
        Rates.load(tmp_path / "bad.json")


def test_every_layout_of_the_gpus_is_a_candidate(rates):
    assert set(layouts(4, rates)) == {
        Layout(0, 0, 4, 1), Layout(0, 0, 2, 2),  # colocated
        Layout(3, 1, 1, 1), Layout(2, 1, 2, 1), Layout(1, 1, 3, 1), Layout(2, 1, 1, 2)}
    assert all(layout.gpus == 5 for layout in layouts(5, rates))
    chosen = plan(4, WORKLOADS["interference"], rates, Objectives(0.5, 0.02))
    assert {c.layout for c in chosen.candidates} == set(layouts(4, rates))
    assert chosen.best.per_gpu_rps == max(c.per_gpu_rps for c in chosen.candidates)
    assert chosen.best.per_gpu_rps == pytest.approx(chosen.best.goodput_rps / 4)
    assert [c.per_gpu_rps for c in chosen.candidates] == sorted((c.per_gpu_rps for c in chosen.candidates), reverse=True)


def fast_decode_rates(prefill_tokens_per_s: float = 30_000) -> Rates:
    """One prefill pace, decode steps too short to matter (0.1 ms at any batch up to 128)."""
    return Rates(model="m", gpu="g", max_num_batched_tokens=2048, max_num_seqs=256, tensor_parallel={
        1: PoolRates(prefill_tokens_per_s=prefill_tokens_per_s, decode_step_s={1: 1e-4, 128: 1e-4})})


def test_a_prefill_workers_goodput_is_the_rate_where_its_queue_keeps_the_attainment():
    """3000-token prompts at 30k tokens/s: service S = 0.1 s. The module's M/G/1 model with a
    deterministic service gives P(TTFT <= T) = 1 - ρ exp(-2 (1 - ρ) (T - S) / S), ρ = λ S: at
    T = 0.5 s and 90% the utilization solves ρ exp(-8 (1 - ρ)) = 0.1."""
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if mid * math.exp(-8 * (1 - mid)) <= 0.1 else (low, mid)
    workload = parse_workload("1:3000:64")
    one = predict(Layout(1, 1, 1, 1), workload, fast_decode_rates(), Objectives(0.5, 0.04))
    assert one.goodput_rps == pytest.approx(low / 0.1, rel=1e-3) and one.bound == "TTFT"
    two = predict(Layout(2, 1, 1, 1), workload, fast_decode_rates(), Objectives(0.5, 0.04))
    assert two.goodput_rps == pytest.approx(2 * low / 0.1, rel=1e-3)  # two queues, each its half of the rate
    assert two.per_gpu_rps == pytest.approx(2 * low / 0.1 / 3, rel=1e-3)


def test_the_choices_on_two_gpus_go_the_way_the_serving_runs_went(rates):
    """On two H200s, interference at 0.5 s / 20 ms: a prefill and a decode worker served more than
    two colocated workers; on long at 1 s / 40 ms two colocated workers served far more than the
    split (measured on two H100s: no H200 run of long has been made)."""
    interference = newest_record("serving_2gpu", "h200x2-now-interference")
    assert interference["goodput_rps_disagg"] > interference["goodput_rps_colocated"]
    assert plan(2, WORKLOADS["interference"], rates, Objectives(0.5, 0.02)).best.layout == Layout(1, 1, 1, 1)
    long = newest_record("serving_2gpu", "h100x2-long")
    assert long["goodput_rps_colocated_ttft1s_tpot40ms"] > 1.5 * long["goodput_rps_disagg_ttft1s_tpot40ms"]
    assert plan(2, WORKLOADS["long"], rates, Objectives(1.0, 0.04)).best.layout == Layout(0, 0, 2, 1)


@pytest.mark.parametrize("gpus", [4, 8])
@pytest.mark.parametrize("slo", [(0.5, 0.02), (1.0, 0.04)])
def test_a_more_prefill_heavy_workload_gets_more_prefill_workers(rates, gpus, slo):
    """The interference mix with a growing share of long prompts (3072-4096 tokens, 8 outputs)
    beside decode-heavy requests (128-256 tokens, 256 outputs)."""
    chosen = [plan(gpus, parse_workload(f"{1 - f:g}:128-256:256,{f:g}:3072-4096:8"), rates, Objectives(*slo)).best.layout
              for f in (0.1, 0.3, 0.5, 0.7, 0.9)]
    counts = [layout.prefill_workers for layout in chosen]
    assert counts == sorted(counts) and counts[0] < counts[-1], chosen


@pytest.mark.parametrize("gpus", [4, 8])
@pytest.mark.parametrize("slo", [(0.5, 0.02), (1.0, 0.04)])
def test_longer_outputs_get_more_decode_workers(rates, gpus, slo):
    chosen = [plan(gpus, parse_workload(f"1:1024-3072:{tokens}"), rates, Objectives(*slo)).best.layout
              for tokens in (8, 32, 128, 512, 1024)]
    counts = [layout.decode_workers * layout.decode_tp for layout in chosen]
    assert counts == sorted(counts) and counts[0] < counts[-1], chosen


def test_a_tpot_only_the_faster_tensor_parallel_decode_meets_is_planned_with_it():
    rates = Rates(model="m", gpu="g", max_num_batched_tokens=2048, max_num_seqs=256, tensor_parallel={
        1: PoolRates(prefill_tokens_per_s=40_000, decode_step_s={1: 0.005, 128: 0.0094}),
        2: PoolRates(prefill_tokens_per_s=70_000, decode_step_s={1: 0.0026, 128: 0.005})})
    chosen = plan(4, WORKLOADS["random"], rates, Objectives(1.0, 0.004))
    assert chosen.best.layout.decode_tp == 2
    assert all(c.goodput_rps == 0 for c in chosen.candidates if c.layout.decode_tp == 1)


def test_impossible_objectives_are_refused_saying_which_and_why(rates):
    with pytest.raises(ImpossibleObjectives, match=r"TPOT <= 2 ms: the fastest decode step measured takes 5.02 ms"):
        plan(4, WORKLOADS["random"], rates, Objectives(1.0, 0.002))
    with pytest.raises(ImpossibleObjectives, match=r"TTFT <= 0.05 s for 90% .* a 4096-token prompt takes 0.108 s"):
        plan(4, WORKLOADS["long"], rates, Objectives(0.05, 0.04))
    with pytest.raises(ValueError, match="no layout fits 1 GPUs"):
        plan(1, WORKLOADS["long"], rates.model_copy(update={"tensor_parallel": {2: rates.tensor_parallel[2],
                                                                                1: PoolRates(prefill_tokens_per_s=1)}}),
             Objectives(1.0, 0.04))


def tandem_plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli", "plan", *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)


def test_tandem_plan_refuses_impossible_objectives_in_one_line():
    out = tandem_plan("--gpus", "4", "--workload", "long", "--ttft", "0.05", "--tpot", "0.04")
    assert out.returncode == 1 and "Traceback" not in out.stderr
    [line] = out.stderr.strip().splitlines()
    assert "TTFT <= 0.05 s" in line
    usage = tandem_plan("--gpus", "4", "--workload", "long", "--ttft", "0", "--tpot", "0.04")
    assert usage.returncode == 2 and "--ttft" in usage.stderr
