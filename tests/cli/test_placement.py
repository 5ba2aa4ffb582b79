"""Workers placed on a host's GPUs: each worker on as many consecutive GPUs as its tensor-parallel
size, round robin, with its device and size in its environment (and, where asked, a decode
worker's serving prefill)."""

from __future__ import annotations

import pytest

from cli.launcher import LocalCluster, gpu_placement


@pytest.mark.parametrize("workers, gpus, expected", [
    ([("prefill-0", 1), ("decode-0", 1)], 2, {"prefill-0": 0, "decode-0": 1}),
    ([("prefill-0", 2), ("decode-0", 2)], 4, {"prefill-0": 0, "decode-0": 2}),
    ([("prefill-0", 1), ("decode-0", 2)], 2, {"prefill-0": 0, "decode-0": 0}),  # ranks never wrap past the last GPU
    ([("prefill-0", 2), ("prefill-1", 2), ("decode-0", 4)], 8, {"prefill-0": 0, "prefill-1": 2, "decode-0": 4}),
    ([("a", 1), ("b", 1), ("c", 1)], 2, {"a": 0, "b": 1, "c": 0}),  # more workers than GPUs share them
])
def test_each_worker_takes_consecutive_gpus(workers, gpus, expected) -> None:
    assert gpu_placement(workers, gpus) == expected


def test_a_worker_wider_than_the_host_is_refused() -> None:
    with pytest.raises(ValueError, match="decode-0 has tensor_parallel_size=4, more than the 2 GPUs"):
        gpu_placement([("decode-0", 4)], 2)


def test_the_cluster_gives_each_worker_its_device_and_size() -> None:
    cluster = LocalCluster(num_prefill=1, num_decode=2, gpus=4, prefill_tp=2, decode_tp=1,
                           worker_env={"decode-1": {"TANDEM_DEVICE": "cuda:3"}})
    assert cluster.worker_env == {
        "prefill-0": {"TANDEM_TENSOR_PARALLEL_SIZE": "2", "TANDEM_DEVICE": "cuda:0"},
        "decode-0": {"TANDEM_TENSOR_PARALLEL_SIZE": "1", "TANDEM_DEVICE": "cuda:2"},
        "decode-1": {"TANDEM_TENSOR_PARALLEL_SIZE": "1", "TANDEM_DEVICE": "cuda:3"},  # what the caller set wins
    }


def test_each_cpu_pool_shares_the_hosts_cores_unless_the_user_set_the_threads(monkeypatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    cluster = LocalCluster(num_prefill=1, num_decode=3)
    assert cluster.worker_env["prefill-0"]["OMP_NUM_THREADS"] == "8"
    assert {cluster.worker_env[f"decode-{i}"]["OMP_NUM_THREADS"] for i in range(3)} == {"2"}
    assert LocalCluster(num_prefill=9, num_decode=8).worker_env["decode-7"]["OMP_NUM_THREADS"] == "1"
    assert LocalCluster(num_prefill=9, num_decode=8).worker_env["prefill-8"]["OMP_NUM_THREADS"] == "1"
    assert "OMP_NUM_THREADS" not in LocalCluster(num_prefill=1, num_decode=1, gpus=2).worker_env["decode-0"]
    assert "OMP_NUM_THREADS" not in LocalCluster(env={"OMP_NUM_THREADS": "4"}).worker_env["decode-0"]
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert "OMP_NUM_THREADS" not in LocalCluster().worker_env["prefill-0"]


def test_decode_workers_serve_prefill_when_asked_and_a_workers_own_setting_wins() -> None:
    cluster = LocalCluster(num_prefill=1, num_decode=2, gpus=3, decode_serves_prefill=True,
                           worker_env={"decode-1": {"TANDEM_SERVES_PREFILL": "0"}})
    assert [cluster.worker_env[n].get("TANDEM_SERVES_PREFILL") for n in ("prefill-0", "decode-0", "decode-1")] == \
        [None, "1", "0"]
    assert "TANDEM_SERVES_PREFILL" not in LocalCluster(num_prefill=0, num_decode=2, gpus=2).worker_env["decode-0"]
