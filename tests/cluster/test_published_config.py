"""What a worker publishes of its KV cache: an fp8 worker and a bfloat16 one of the same model
disagree on the KV dtype and the hash seed, so no pool takes both."""

import dataclasses
import re
import shutil
import subprocess

import pytest
import torch

from cluster.registry import Role
from cluster.translate import worker_config_from_proto, worker_config_to_proto
from cluster.worker import published_config
from engine import EngineConfig, EngineCore
from engine.core.core_proc import engine_info
from tests.helpers.models import save_tiny_llama


def published(core: EngineCore):
    """What a worker over ``core`` publishes, with the gRPC transport."""
    return published_config(engine_info(core, 1), core.kv_pools, ["grpc"])


def test_an_fp8_worker_publishes_its_kv_dtype_and_differs_from_a_bfloat16_one(tmp_path):
    model = save_tiny_llama(tmp_path)
    configs = [published(EngineCore(model, EngineConfig(device="cpu", dtype="bfloat16", num_blocks=8,
                                                        kv_cache_dtype=kv)))
               for kv in ("auto", "fp8_e4m3")]
    assert [c.kv_cache_dtype for c in configs] == ["bfloat16", "fp8_e4m3"]
    assert configs[0].differences(configs[1]) == ["kv_cache_dtype", "hash_seed"]


def test_the_step_token_budget_is_published_and_workers_may_differ_in_it(tmp_path):
    model = save_tiny_llama(tmp_path)
    configs = [published(EngineCore(model, EngineConfig(device="cpu", num_blocks=8, max_num_batched_tokens=budget)))
               for budget in (256, 2048)]
    assert [c.max_num_batched_tokens for c in configs] == [256, 2048]
    assert configs[0].differences(configs[1]) == [] and configs[0].pool_key() == configs[1].pool_key()


def test_a_cpu_worker_publishes_no_gpu_and_the_gpus_cross_the_wire(tmp_path):
    config = published(EngineCore(save_tiny_llama(tmp_path), EngineConfig(device="cpu", num_blocks=8)))
    assert config.device_ids == ()
    on_gpus = dataclasses.replace(config, device_ids=("GPU-1b2c", "GPU-9f8e"))
    assert worker_config_from_proto(worker_config_to_proto(on_gpus, Role.DECODE)) == on_gpus
    assert on_gpus.pool_key() == config.pool_key()  # workers of a pool run on GPUs of their own


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or shutil.which("nvidia-smi") is None,
                    reason="needs a CUDA GPU and nvidia-smi")
def test_a_gpu_worker_publishes_the_uuid_nvidia_smi_lists(tmp_path):
    config = published(EngineCore(save_tiny_llama(tmp_path), EngineConfig(device="cuda:0", num_blocks=8)))
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True).stdout
    uuids = re.findall(r"UUID: (GPU-[0-9a-f-]+)", listed)
    assert len(config.device_ids) == 1 and config.device_ids[0] in uuids


def test_a_decode_worker_that_also_prefills_says_so_on_the_wire_and_still_joins_the_pool(tmp_path):
    config = published(EngineCore(save_tiny_llama(tmp_path), EngineConfig(device="cpu", num_blocks=8)))
    assert config.serves_prefill is False
    lender = dataclasses.replace(config, serves_prefill=True)
    assert worker_config_from_proto(worker_config_to_proto(lender, Role.DECODE)) == lender
    assert lender.differences(config) == [] and lender.pool_key() == config.pool_key()
