"""End to end through real processes: 2 prefill + 2 decode workers and a gateway on loopback,
the real default model, the shared Redis under a test-only key prefix.

Checks what a client sees: greedy output equal to the offline engine's, 32 concurrent mixed
streams all correct and spread over both decode workers with every block back afterwards,
cancellation freeing blocks within a second, prefix-aware routing.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from engine import SamplingParams
from engine.llm import LLM
from protos.tandem.v1 import gateway_pb2

from tests.helpers.cluster import SP, collect, free_blocks, settled_free_blocks, shared_redis_cluster, stats, wait_free_blocks

pytestmark = pytest.mark.slow
PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three prime numbers:",
    "def fibonacci(n):",
    "Explain in one sentence why the sky is blue.",
    "Once upon a time, in a small village,",
    "The quick brown fox",
    "Translate 'good morning' into Spanish:",
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, redis_url, kv_transport):
    with shared_redis_cluster(tmp_path_factory.mktemp("cluster"), "e2e", redis_url, num_prefill=2, num_decode=2,
                              kv_transport=kv_transport) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def stub(cluster):
    return cluster.stub


@pytest.fixture(scope="module")
def offline_llm() -> LLM:
    return LLM(max_model_len=2048, kv_cache_memory_bytes=64 << 20)


@pytest.fixture(scope="module")
def offline(offline_llm):
    """Greedy reference outputs of the in-process engine: prompt -> (token ids, text)."""
    outs = offline_llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)
    return {p: (list(o.outputs[0].token_ids), o.outputs[0].text) for p, o in zip(PROMPTS, outs)}


def _greedy(prompt: str, max_tokens: int = 24, **kw) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(prompt=prompt, sampling=SP(max_tokens=max_tokens, temperature=0, **kw))


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (``/proc/<pid>/stat``, fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _process_tree(pid: int) -> list[int]:
    """``pid`` and every live process under it (a worker's engine core)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    tree = [pid]
    for parent in tree:
        tree += [child for child, p in parents.items() if p == parent]
    return tree


def test_an_idle_cluster_uses_almost_no_cpu(cluster):
    """No process spins while nothing is asked of it (NIXL's progress thread took a core per
    worker): over 10 s of a started cluster (heartbeats every 0.5 s) each process costs under
    1.5 CPU-s, a worker's engine core included. Measured 0.33-0.56 per process on a 2-core CI
    machine; a spinning thread costs 10 on a free core and still 4 when all five processes spin
    on two cores."""
    trees = {child.name: _process_tree(child.proc.pid) for child in cluster.children()}
    assert all(len(trees[name]) >= 2 for name in trees if name != "gateway"), trees  # engine cores
    pids = {f"{name}:{pid}": pid for name, tree in trees.items() for pid in tree}
    before = {name: _cpu_seconds(pid) for name, pid in pids.items()}
    time.sleep(10)
    used = {name: round(_cpu_seconds(pid) - before[name], 2) for name, pid in pids.items()}
    assert max(used.values()) < 1.5, used


def test_greedy_output_equals_offline_engine(stub, offline):
    for prompt in PROMPTS[:3]:
        out = collect(stub, _greedy(prompt))
        sample = out["samples"][0]
        assert (sample["token_ids"], sample["text"]) == offline[prompt], prompt
        assert out["usage"].completion_tokens == len(sample["token_ids"])
        assert sample["finish"] in (gateway_pb2.FINISH_REASON_STOP, gateway_pb2.FINISH_REASON_LENGTH)


def test_32_concurrent_streams_correct_spread_and_no_leak(cluster, stub, offline):
    before = free_blocks(cluster)
    busy: dict[str, int] = {}
    done = threading.Event()

    def watch() -> None:  # which decode workers hold requests during the burst
        while not done.is_set():
            for name, w in cluster.workers.items():
                if name.startswith("decode"):
                    s = stats(cluster, w.address, "decode")
                    busy[name] = max(busy.get(name, 0), s.num_running + s.num_waiting)
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    jobs = [(PROMPTS[i % len(PROMPTS)], 8 + (i * 5) % 17) for i in range(32)]  # mixed prompt and output lengths
    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(lambda job: collect(stub, _greedy(job[0], job[1])), jobs))
    done.set()
    watcher.join()
    for (prompt, max_tokens), out in zip(jobs, results):
        ref_ids = offline[prompt][0]
        got = out["samples"][0]["token_ids"]
        assert got == ref_ids[: len(got)] and len(got) == min(max_tokens, len(ref_ids)), (prompt, max_tokens)
    assert all(busy.get(f"decode-{i}", 0) > 0 for i in range(2)), busy
    # Every block comes back (a leak would wait for a 30 s lease at best); the last Aborts of 32
    # streams may take seconds on busy cores.
    assert wait_free_blocks(cluster, before, within_s=15) == before


def test_served_prompt_is_tokenized_like_the_offline_engine(stub, offline_llm):
    """One rule for text prompts: the gateway's Tokenize (what Generate sees) equals what the
    offline LLM.generate(text) computes on."""
    for prompt in PROMPTS[:4]:
        served = list(stub.Tokenize(gateway_pb2.TokenizeRequest(prompt=prompt), timeout=10).token_ids)
        [out] = offline_llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
        assert served == out.prompt_token_ids, prompt


def test_n_samples_interleave_with_index_and_stop_string_cuts(stub):
    out = collect(stub, gateway_pb2.GenerateRequest(prompt="Count: one, two, three,",
                                                    sampling=SP(max_tokens=20, n=3, temperature=0.8, seed=7)))
    assert sorted(out["samples"]) == [0, 1, 2]
    assert out["usage"].completion_tokens == sum(len(s["token_ids"]) for s in out["samples"].values())
    out = collect(stub, _greedy("The capital of France is", 24, stop=[" Paris"]))
    sample = out["samples"][0]
    assert " Paris" not in sample["text"] and sample["finish"] == gateway_pb2.FINISH_REASON_STOP


def test_cancel_mid_stream_frees_blocks_on_both_workers_within_a_second(cluster, stub):
    before = settled_free_blocks(cluster, within_s=5)  # (the stop-string test before cuts its stream)
    call = stub.Generate(_greedy("Tell me a very long story about dragons. " * 8, 400, ignore_eos=True), timeout=60)
    for i, _ in enumerate(call):
        if i == 3:
            break
    during = free_blocks(cluster)
    assert any(during[n] < before[n] for n in before if n.startswith("decode")), (before, during)
    call.cancel()
    cancelled_at = time.monotonic()
    after = wait_free_blocks(cluster, before, within_s=1.0)
    assert after == before, (before, after, time.monotonic() - cancelled_at)


def test_shared_long_prefix_goes_to_the_prefill_worker_that_cached_it(cluster, stub):
    for topic in ("astronomy", "cooking", "chess"):
        prefix = f"You are an expert on {topic}. " + " ".join(f"Fact {i} about {topic} is important." for i in range(30))
        first = collect(stub, _greedy(prefix + " Question one?", 2))
        assert first["usage"].cached_prompt_tokens < first["usage"].prompt_tokens
        time.sleep(1.2)  # the worker publishes its cached blocks with its next heartbeat
        second = collect(stub, _greedy(prefix + " Question two, slightly different?", 2))
        # only the prefill worker that computed the prefix can reuse it: routing sent it there
        assert second["usage"].cached_prompt_tokens >= 16 * 10, (topic, second["usage"])


def test_deadline_is_passed_on(stub):
    with pytest.raises(grpc.RpcError) as info:
        collect(stub, _greedy("Write an essay.", 2000, ignore_eos=True), timeout_s=1.0)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_every_process_serves_metrics_on_a_port_of_its_own(cluster):
    """Regression: every process used to bind metrics port 9400, so a second local cluster on
    the machine crashed. The launcher gives each its own free port."""
    import urllib.request

    ports = cluster.metrics_ports
    assert set(ports) == {"gateway", "prefill-0", "prefill-1", "decode-0", "decode-1"}
    assert len(set(ports.values())) == len(ports) and 0 not in ports.values()
    for name, port in ports.items():
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
        assert ("tandem_gateway_requests" if name == "gateway" else "tandem_kv_blocks_free") in text, name
