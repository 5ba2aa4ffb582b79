"""Each process's settings: exactly the flags it reads, named once, documented.

Every process's flags are listed here, reviewed; a flag a process does not read (a setting in
the wrong class, as ``--lease-s`` once was on the prefill worker) fails twice: against the list,
and against that process's code, where each of its settings must be read off its settings.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.settings import RequestLimits, WorkerSettings, env_name, from_args, settings_fields
from decode_worker.settings import DecodeWorkerSettings
from engine.config import EngineConfig
from gateway.settings import GatewaySettings

ROOT = Path(__file__).resolve().parents[2]

SHARED = {"listen", "model", "redis_url", "redis_key_prefix", "registry_ttl_s", "metrics_port", "health_port",
          "drain_timeout_s", "tls_dir", "insecure", "redis_password", "redis_tls_ca", "reflection", "log_level",
          "max_n", "max_logprobs", "max_stop", "max_stop_len", "max_stop_token_ids", "max_logit_bias",
          "max_bad_words", "max_structured_output_bytes", "keepalive_time_s",
          "keepalive_timeout_s"}
ENGINE = {"block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_blocks",
          "kv_cache_memory_bytes", "gpu_memory_utilization", "enable_prefix_caching", "dtype", "quantization",
          "kv_cache_dtype", "device", "seed", "cuda_graph_batch_sizes", "cuda_graph_token_sizes", "enforce_eager",
          "batch_invariant", "tensor_parallel_size", "async_scheduling", "speculative_config"}
WORKER = SHARED | ENGINE | {"advertise", "worker_id", "heartbeat_interval_s", "load_format", "kv_transport",
                            "kv_verify_checksums", "engine_hang_timeout_s"}
GATEWAY = SHARED | {"chat_split_special_tokens", "static_prefill", "static_decode", "refresh_interval_s",
                    "admit_wait_s", "local_prefill_max_tokens", "prefill_placement", "slo_ttft_s", "slo_itl_s",
                    "slo_tpot_s", "prefill_timeout_s_per_token", "max_request_bytes", "max_prompt_bytes",
                    "tokenizer_threads", "tokenizer_queue", "hop_timeout_s", "decode_stall_timeout_s",
                    "max_retries", "outlier_consecutive_failures", "outlier_base_ejection_s",
                    "outlier_max_ejection_s", "quarantine_s", "health_probe_interval_s", "health_probe_timeout_s", "api_keys",
                    "api_keys_file", "allow_open", "http_addr"}

# (module run as the process, its settings class, the reviewed settings, the code that reads them)
PROCESSES = {
    "gateway": ("gateway", GatewaySettings, GATEWAY, ["gateway/*.py", "cluster/settings.py"]),
    "prefill": ("prefill_worker", WorkerSettings, WORKER,
                ["prefill_worker/*.py", "cluster/prefill_service.py", "cluster/worker.py", "cluster/settings.py"]),
    "decode": ("decode_worker", DecodeWorkerSettings, WORKER | {"lease_s", "stream_interval", "serves_prefill",
                                                                "kv_spot_check_rate"},
               ["decode_worker/*.py", "cluster/prefill_service.py", "cluster/worker.py", "cluster/settings.py"]),
}
# The nested models are handed on whole; their fields are read where they go.
NESTED = {"engine": (EngineConfig, ["engine/**/*.py"]), "limits": (RequestLimits, ["cluster/translate.py"])}
# What a setting is read off in a process's code: its settings object, or inside a settings
# class, ``self``.
SETTINGS_OBJECTS = {"settings", "s", "self.settings", "self"}


def reads(patterns: list[str], objects: set[str]) -> set[str]:
    """Attribute names read off one of ``objects`` (source text of the expression) in the files."""
    names = set()
    for pattern in patterns:
        for path in ROOT.glob(pattern):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and ast.unparse(node.value) in objects:
                    names.add(node.attr)
    return names


def flags_of(module: str) -> set[str]:
    """The flags ``python -m module --help`` lists (the boolean ``--no-`` forms and ``--help`` left out)."""
    out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return {f for f in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", out.stdout)} - {"--help"} - {
        f for f in re.findall(r"--no-[a-z0-9-]+", out.stdout)}


@pytest.mark.parametrize("process", PROCESSES)
def test_each_process_offers_exactly_its_reviewed_flags(process):
    module, cls, expected, _ = PROCESSES[process]
    assert set(settings_fields(cls)) == expected
    assert flags_of(module) == {f"--{name.replace('_', '-')}" for name in expected}


@pytest.mark.parametrize("process", PROCESSES)
def test_each_setting_of_a_process_is_read_by_that_process(process):
    _, cls, _, code = PROCESSES[process]
    read = reads(code, SETTINGS_OBJECTS)
    unread = {name for name, path in settings_fields(cls).items() if path[0] not in read}
    assert not unread, f"{process} offers settings it never reads: {sorted(unread)}"


@pytest.mark.parametrize("field", NESTED)
def test_each_field_of_a_nested_model_is_read_where_the_model_goes(field):
    model, code = NESTED[field]
    read = reads(code, {"config", "self.config", "limits", "self.limits"})
    assert {f.name for f in dataclasses.fields(model)} <= read


@pytest.mark.parametrize("process", PROCESSES)
def test_docs_name_every_setting_of_each_process(process):
    _, cls, _, _ = PROCESSES[process]
    docs = (ROOT / "docs/deployment.md").read_text()
    missing = [env_name(cls, name) for name in settings_fields(cls) if f"`{env_name(cls, name)}`" not in docs]
    assert not missing, f"docs/deployment.md does not name {missing}"


def test_a_nested_setting_has_its_flat_name_everywhere_and_flags_win(monkeypatch):
    monkeypatch.setenv("TANDEM_BLOCK_SIZE", "64")
    monkeypatch.setenv("TANDEM_MAX_N", "3")
    monkeypatch.setenv("TANDEM_LEASE_S", "7")
    from_env = DecodeWorkerSettings()
    assert (from_env.engine.block_size, from_env.limits.max_n, from_env.lease_s) == (64, 3, 7.0)
    assert WorkerSettings(block_size=32, num_blocks=8).engine == EngineConfig(block_size=32, num_blocks=8)
    flags = from_args(DecodeWorkerSettings, ["--block-size", "32", "--max-n", "5"], "decode", "")
    assert (flags.engine.block_size, flags.engine.num_blocks, flags.limits.max_n) == (32, None, 5)
    assert (env_name(WorkerSettings, "block_size"), env_name(GatewaySettings, "listen")) == \
        ("TANDEM_BLOCK_SIZE", "TANDEM_GATEWAY_ADDR")


def test_a_nested_setting_may_not_shadow_another():
    class Shadowing(WorkerSettings):
        block_size: int = 16

    with pytest.raises(TypeError, match="block_size"):
        settings_fields(Shadowing)
