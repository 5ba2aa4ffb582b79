"""What a worker publishes of its KV cache: an fp8 worker and a bfloat16 one of the same model
disagree on the KV dtype and the hash seed, so no pool takes both."""

from cluster.worker import published_config
from engine import EngineConfig, LLMEngine
from tests.engine.model_helpers import save_tiny_llama


def test_an_fp8_worker_publishes_its_kv_dtype_and_differs_from_a_bfloat16_one(tmp_path):
    model = save_tiny_llama(tmp_path)
    configs = [published_config(LLMEngine(model, EngineConfig(device="cpu", dtype="bfloat16", num_blocks=8,
                                                              kv_cache_dtype=kv)), ["grpc"])
               for kv in ("auto", "fp8_e4m3")]
    assert [c.kv_cache_dtype for c in configs] == ["bfloat16", "fp8_e4m3"]
    assert configs[0].differences(configs[1]) == ["kv_cache_dtype", "hash_seed"]


def test_the_step_token_budget_is_published_and_workers_may_differ_in_it(tmp_path):
    model = save_tiny_llama(tmp_path)
    configs = [published_config(LLMEngine(model, EngineConfig(device="cpu", num_blocks=8,
                                                              max_num_batched_tokens=budget)), ["grpc"])
               for budget in (256, 2048)]
    assert [c.max_num_batched_tokens for c in configs] == [256, 2048]
    assert configs[0].differences(configs[1]) == [] and configs[0].pool_key() == configs[1].pool_key()
