"""The KV transfer benchmark between two processes moves the right bytes: with ``verify_checksums``
the receiving process checks a CRC-32 of every transfer's blocks against the sender's (a
mismatch fails the run with ``DATA_LOSS``), over NIXL and over the gRPC stream. On the GPU this is
the check that UCX's CUDA IPC reads (``UCX_CUDA_IPC_ENABLE_GET_ZCOPY``) land where they should."""

import pytest
import torch

from bench.kv_transfer import transfer_metrics

pytestmark = pytest.mark.slow
GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=GPU)])
def test_both_transports_move_blocks_bit_exact_between_two_processes(device: str) -> None:
    metrics = transfer_metrics(device, device, repeats=1, block_counts=(3, 16), verify_checksums=True)
    for transport in ("nixl", "grpc"):
        for count in (3, 16):
            assert metrics[f"{transport}_gbps_{count}_blocks"] > 0
            assert all(metrics[f"{transport}_{phase}_ms_{count}_blocks"] > 0
                       for phase in ("open", "send", "finish", "ready"))
            assert metrics[f"{transport}_ready_gbps_{count}_blocks"] > 0


TWO_GPUS = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]


@pytest.mark.parametrize("device, peer_device", [
    ("cpu,cpu", "cpu"), ("cpu", "cpu,cpu"),
    pytest.param("cuda:0,cuda:1", "cuda:0", marks=TWO_GPUS), pytest.param("cuda:0", "cuda:0,cuda:1", marks=TWO_GPUS),
    pytest.param("cuda:0", "cuda:1", marks=TWO_GPUS),
], ids=["tp2-tp1-cpu", "tp1-tp2-cpu", "tp2-tp1-gpu", "tp1-tp2-gpu", "gpu0-gpu1"])
def test_heterogeneous_tensor_parallel_transfers_are_bit_exact(device: str, peer_device: str) -> None:
    """A TP=2 prefill pool (each rank half of the KV heads) into a TP=1 decode pool and the
    reverse, and GPU to GPU: the receiver's CRC-32 of the whole blocks equals the sender's."""
    metrics = transfer_metrics(device, peer_device, repeats=1, block_counts=(3, 16), verify_checksums=True)
    for transport in ("nixl", "grpc"):
        assert metrics[f"{transport}_gbps_16_blocks"] > 0
