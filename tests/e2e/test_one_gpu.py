"""A prefill and a decode worker on one GPU, as real processes (static mode, no Redis): both
publish the same GPU, so the gateway's adaptive placement prefills every prompt on the decode
worker (``local_shared``: a transfer between two processes that time-slice one GPU buys no
isolation), and the greedy tokens of concurrent streams equal the offline engine's, each step's
outputs handed to the worker's event loop while its next step runs on the GPU."""

from __future__ import annotations

import os
import random
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from engine import LLM, SamplingParams
from protos.tandem.v1 import gateway_pb2
from tests.helpers.models import save_tiny_llama

from tests.helpers.cluster import SP, collect, free_blocks, gateway_stub, start_cluster, wait_free_blocks

pytestmark = [pytest.mark.slow, pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

MAX_TOKENS = 24
VOCAB_SIZE = 512
_rng = random.Random(1)
PROMPTS = [[_rng.randrange(VOCAB_SIZE) for _ in range(length)] for length in (40, 75, 23, 300, 130, 61)]


def placements(cluster) -> dict[str, float]:
    """The gateway's ``tandem_gateway_placements_total`` by kind."""
    with urllib.request.urlopen(f"http://127.0.0.1:{cluster.metrics_ports['gateway']}/metrics", timeout=5) as page:
        text = page.read().decode()
    return {sample.labels["kind"]: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name == "tandem_gateway_placements_total"}


def test_a_prefill_worker_on_the_decode_workers_gpu_is_left_idle_and_tokens_equal_offline(tmp_path):
    model = save_tiny_llama(tmp_path / "model", vocab_size=VOCAB_SIZE, num_hidden_layers=4,
                            max_position_embeddings=4096)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    llm = LLM(model, dtype="float32", device="cuda", gpu_memory_utilization=0.2)
    offline = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    del llm
    torch.cuda.empty_cache()
    cluster = start_cluster(tmp_path, f"test-one-gpu-{os.getpid()}-{time.monotonic_ns()}", None, num_prefill=1,
                            num_decode=1, kv_transport="grpc", gpus=1,
                            env={"TANDEM_MODEL": model, "TANDEM_DTYPE": "float32",
                                 "TANDEM_GPU_MEMORY_UTILIZATION": "0.2", "TANDEM_PREFILL_PLACEMENT": "adaptive"})
    try:
        start = free_blocks(cluster)
        channel, stub = gateway_stub(cluster)
        with channel, ThreadPoolExecutor(len(PROMPTS)) as pool:
            requests = [gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=prompt),
                                                    sampling=SP(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
                        for prompt in PROMPTS]
            answers = list(pool.map(lambda r: collect(stub, r)["samples"][0]["token_ids"], requests))
        assert answers == offline
        assert placements(cluster) == {"local_shared": len(PROMPTS)}
        assert wait_free_blocks(cluster, start, within_s=10) == start
    finally:
        cluster.stop()
