"""Workers of different tensor-parallel sizes, as real processes: a TP=2 prefill worker feeds a
TP=1 decode worker (NIXL) and a TP=1 prefill worker a TP=2 decode worker (the gRPC stream), and
the greedy tokens equal one offline engine's; a rank killed mid-request takes its worker down
(exit status 1) without hanging the request or the cluster, and the blocks come back on the
worker left. A small random Llama saved as an HF directory (heads that 2 divides), on the CPU
(gloo) and on two GPUs (NCCL, each worker's ranks on both), in float32: the ranks' summation
order moves no greedy token."""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import grpc
import pytest
import torch

from engine import LLM, SamplingParams
from protos.tandem.v1 import gateway_pb2
from tests.helpers.models import save_tiny_llama

from tests.helpers.cluster import SP, child_pids, collect, free_blocks, gateway_stub, log_text, start_cluster, wait_free_blocks

pytestmark = pytest.mark.slow

MAX_TOKENS = 24
_rng = random.Random(0)
VOCAB_SIZE = 512
PROMPTS = [[_rng.randrange(VOCAB_SIZE) for _ in range(length)] for length in (40, 75, 23)]
TWO_GPUS = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]


@pytest.fixture(scope="module", params=["cpu", pytest.param("gpu", marks=TWO_GPUS)])
def device(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), vocab_size=VOCAB_SIZE, num_hidden_layers=4,
                           max_position_embeddings=4096)


def model_env(device: str, model: str) -> dict[str, str]:
    return {"TANDEM_MODEL": model, "TANDEM_DTYPE": "float32",
            **({"TANDEM_GPU_MEMORY_UTILIZATION": "0.2"} if device == "gpu" else {})}


@pytest.fixture(scope="module")
def offline(device: str, model: str) -> list[list[int]]:
    llm = LLM(model, dtype="float32", device="cuda" if device == "gpu" else "cpu", gpu_memory_utilization=0.2)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def cluster_of(tmp, device: str, model: str, redis_url: str, prefill_tp: int, decode_tp: int, kv_transport: str):
    return start_cluster(tmp, f"test-tp-{os.getpid()}-{time.monotonic_ns()}", redis_url if device == "cpu" else None,
                         num_prefill=1, num_decode=1, kv_transport=kv_transport, env=model_env(device, model),
                         gpus=2 if device == "gpu" else 0, prefill_tp=prefill_tp, decode_tp=decode_tp)


def request(prompt: list[int], max_tokens: int = MAX_TOKENS) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=prompt),
                                       sampling=SP(max_tokens=max_tokens, temperature=0, ignore_eos=True))


@pytest.mark.parametrize("prefill_tp, decode_tp, kv_transport", [(2, 1, "nixl"), (1, 2, "grpc")],
                         ids=["tp2-prefill-tp1-decode-nixl", "tp1-prefill-tp2-decode-grpc"])
def test_workers_of_different_tp_sizes_equal_the_offline_engine(tmp_path, device, model, redis_url, offline, prefill_tp,
                                                                decode_tp, kv_transport) -> None:
    cluster = cluster_of(tmp_path, device, model, redis_url, prefill_tp, decode_tp, kv_transport)
    try:
        start = free_blocks(cluster)
        channel, stub = gateway_stub(cluster)
        with channel:
            for prompt, expected in zip(PROMPTS, offline):
                assert collect(stub, request(prompt))["samples"][0]["token_ids"] == expected
        assert wait_free_blocks(cluster, start, within_s=5) == start
        assert f"tensor parallel size {max(prefill_tp, decode_tp)}" in log_text(tmp_path, "prefill-0" if prefill_tp > 1
                                                                                 else "decode-0")
    finally:
        cluster.stop()


def test_a_killed_rank_takes_its_worker_down_without_hanging(tmp_path, device, model, redis_url) -> None:
    cluster = cluster_of(tmp_path, device, model, redis_url, prefill_tp=1, decode_tp=2, kv_transport="grpc")
    try:
        start = free_blocks(cluster)
        channel, stub = gateway_stub(cluster)
        outcome: dict = {"tokens": 0}

        def stream() -> None:
            try:
                for message in stub.Generate(request(PROMPTS[0], max_tokens=2000), timeout=120):
                    outcome["tokens"] += len(message.token_ids)
                outcome["code"] = "OK"
            except grpc.RpcError as exc:
                outcome["code"] = exc.code().name
            outcome["ended"] = time.monotonic()

        with channel:
            client = threading.Thread(target=stream)
            client.start()
            deadline = time.monotonic() + 60
            while outcome["tokens"] < 4 and time.monotonic() < deadline:
                time.sleep(0.02)
            decode = cluster.workers["decode-0"]
            (rank_1,) = child_pids(decode.proc.pid)
            os.kill(rank_1, signal.SIGKILL)
            killed_at = time.monotonic()
            client.join(60)
            assert not client.is_alive() and outcome["code"] == "UNAVAILABLE", outcome
            assert outcome["ended"] - killed_at < 30
            assert decode.proc.wait(30) == 1
        assert "tensor-parallel rank 1" in log_text(tmp_path, "decode-0")
        assert wait_free_blocks(cluster, {"prefill-0": start["prefill-0"]}, within_s=5)["prefill-0"] == start["prefill-0"]
    finally:
        cluster.stop()


def test_two_workers_on_two_gpus_equal_the_offline_engine(tmp_path, device, model, offline) -> None:
    """A prefill worker on GPU 0 and a decode worker on GPU 1 (each thread of a worker runs on
    its own GPU, not on the first)."""
    if device == "cpu":
        pytest.skip("placement on GPUs: the CPU is one device (disaggregation on it: tests/e2e/test_cluster.py)")
    cluster = cluster_of(tmp_path, device, model, None, prefill_tp=1, decode_tp=1, kv_transport="nixl")
    try:
        channel, stub = gateway_stub(cluster)
        with channel:
            for prompt, expected in zip(PROMPTS, offline):
                assert collect(stub, request(prompt))["samples"][0]["token_ids"] == expected
        assert "on cuda:1" in log_text(tmp_path, "decode-0")
    finally:
        cluster.stop()
