"""KV transfer bandwidth between two worker processes: NIXL against the gRPC stream.

One request's blocks move from a "prefill" pool in this process to a reservation in a "decode"
pool in a second process, through Tandem's own data plane (``KVTransferClient`` →
``DecodeWorker.TransferKV`` → ``KVTransferServicer``/``KVReceiver``, with NIXL reads or the bytes in
the stream), for 16, 256 and 2048 blocks of Llama-3-8B's shape (32 layers x 8 KV heads x 128 x
16 tokens, bf16: 2 MiB a block; ``--kv-cache-dtype fp8_e4m3``: float8 e4m3, 1 MiB a block). The
time runs from opening the transfer to the receiver's acknowledgement; the median of several repetitions is reported. In the same run, a plain copy
of the same bytes in one process from ``--device`` to ``--peer-device`` (device-to-device or
peer-to-peer on GPUs, ``memcpy`` on the CPU) is the ceiling. The sending pool sits on
``--device``, the receiving one on ``--peer-device`` (default: the same GPU, shared by both
processes, or host memory; ``--device cuda:0 --peer-device cuda:1`` measures GPU to GPU).

Heterogeneous tensor parallelism: a comma-separated list of devices makes a pool of one
tensor-parallel rank per device, each holding its share of the 8 KV heads (all allocated by its
process, as a worker's rank 0 allocates them): ``--device cuda:0,cuda:1 --peer-device cuda:0``
moves KV from a TP=2 prefill worker to a TP=1 decode worker (each decode rank reads its heads
from the prefill ranks that hold them; the gRPC stream carries whole blocks).

Metrics (``kv_transfer``): ``nixl_gbps_{16,256,2048}_blocks``, ``grpc_gbps_...``, ``copy_gbps``
(GB/s = 1e9 bytes/s of KV moved), and where a transfer's time goes, medians in ms:
``{transport}_open_ms_{n}_blocks`` (the stream's opening message: off the time to first token
in a worker, which opens it before the prefill), ``..._send_ms_...`` (the blocks announced or
written) and ``..._finish_ms_...`` (until the receiver's acknowledgement: with NIXL the read
itself); the workload names both sides' devices (their TP sizes). ``{transport}_ready_ms_{n}_blocks``
and ``..._ready_gbps_...`` time what a request's first token waits for in a worker: a transfer
whose blocks become ready 10 ms after its stream opened (as a prefill worker opens it before it
computes), from the blocks ready to the acknowledgement. Every transfer carries end-to-end
digests (the sender computes them, the receiver checks them where the blocks landed: in the
times above); ``digest_ms_{n}_blocks`` is that digest work alone (both sides' kernels and host
copies, timed on the sending pool), and ``digest_overhead_fraction_{n}_blocks`` its share of the
transfer's time (NIXL's, else gRPC's, from opening to acknowledgement).

Usage: ``python -m bench.kv_transfer [--device cuda|cpu] [--peer-device cuda:1] [--repeats 5]
[--transports nixl] [--kv-cache-dtype fp8_e4m3]``
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time

import grpc
import torch

from bench.common import REPO_ROOT, machine, write_result
from bench.stats import median
from engine.config import KV_CACHE_DTYPES
from engine.runner.devices import resolve_kv_cache_dtype
from engine.runner.kv_cache import KVCache
from engine.loading.model_config import ModelConfig
from engine.loading.presets import PRESETS
from engine.parallel.tensor_parallel import shard_config
from kvtransfer import (
    GRPC_MESSAGE_OPTIONS, KVTransferServicer, KVTransferClient, KVDestination, KVPool, KVReceiver, ReservationTable,
)
from kernels.reference import NONFINITE_BITS
from kvtransfer.digest import pool_digests, verify_landed
from kvtransfer.nixl import NixlAgent
from protos.tandem.v1 import worker_pb2, worker_pb2_grpc

BLOCK_COUNTS = (16, 256, 2048)
BLOCK_SIZE = 16
# A worker opens the stream before its prefill, which lasts milliseconds and more: the ``ready``
# transfers wait this long between opening and sending, so their opening has landed first.
_PREFILL_S = 0.01
TRANSPORTS = ("nixl", "grpc")


def make_pool(devices: str, num_blocks: int, kv_cache_dtype: str = "auto") -> KVPool:
    """A pool of Llama-3-8B-shaped blocks in bfloat16 or ``kv_cache_dtype`` (an
    ``engine.config.KV_CACHE_DTYPES`` setting), one tensor-parallel rank per device of the
    comma-separated ``devices``, filled with random bytes."""
    ranks = devices.split(",")
    shard = shard_config(ModelConfig.from_hf_dict(PRESETS["llama-3-8b"]), len(ranks))
    dtype = resolve_kv_cache_dtype(kv_cache_dtype, torch.bfloat16)[1]
    tensors = [KVCache(shard, num_blocks, BLOCK_SIZE, dtype, device).tensor for device in ranks]
    for tensor in tensors:
        fill_finite_random(tensor)
    return KVPool(tensors)


def fill_finite_random(tensor: torch.Tensor) -> None:
    """Random bytes, NaN and infinity made finite (a receiver refuses non-finite KV): where every
    exponent bit is set, the lowest of them is cleared. Block by block, to bound the temporaries."""
    _, mask = NONFINITE_BITS[tensor.dtype]
    low_bit = mask & -mask
    for block in tensor.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[tensor.element_size()]):
        block.view(torch.uint8).random_(0, 256)
        block.sub_(((block & mask) == mask).to(block.dtype) * low_bit)


class ReceiverServicer(worker_pb2_grpc.DecodeWorkerServicer):
    """The decode side of the data plane, without an engine: Admit reserves blocks from a free
    list in id order (as a fresh pool allocates), TransferKV receives."""

    def __init__(self, pool: KVPool, nixl: NixlAgent, verify_checksums: bool = False) -> None:
        self.free = list(range(pool.num_blocks))
        self.table = ReservationTable(self.free.extend)
        self.receiver = KVTransferServicer(KVReceiver(pool, self.table, nixl=nixl, verify_checksums=verify_checksums))

    async def Admit(self, request, context):  # noqa: N802
        count = len(request.prompt_token_ids) // BLOCK_SIZE
        self.free.sort()
        blocks = self.free[:count]
        del self.free[:count]
        reservation = self.table.reserve(request.request_id, blocks)
        return worker_pb2.AdmitResponse(reservation_id=reservation.reservation_id, num_blocks=count,
                                        kv_transports=self.receiver.receiver.transports)

    async def TransferKV(self, request_iterator, context):  # noqa: N802
        response, _ = await self.receiver.transfer_kv(request_iterator, context)
        return response

    async def Abort(self, request, context):  # noqa: N802
        self.table.release_request(request.request_id, "done")
        return worker_pb2.AbortResponse(found=True)


async def serve(devices: str, num_blocks: int, verify_checksums: bool, kv_cache_dtype: str) -> None:
    pool = make_pool(devices, num_blocks, kv_cache_dtype)
    server = grpc.aio.server(options=GRPC_MESSAGE_OPTIONS)
    nixl = NixlAgent(f"bench-rx-{os.getpid()}", pool)
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(ReceiverServicer(pool, nixl, verify_checksums), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"PORT {port}", flush=True)
    await server.wait_for_termination()


def copy_gbps(device: str, peer_device: str, nbytes: int) -> float:
    """Bytes per second of one plain copy of ``nbytes`` from ``device`` to ``peer_device`` (the
    median of several), in GB/s."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty(nbytes, dtype=torch.uint8, device=peer_device)
    times = []
    for _ in range(6):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return nbytes / median(times[1:]) / 1e9


async def measure(address: str, pool: KVPool, nixl: NixlAgent, repeats: int, block_counts: tuple[int, ...],
                  verify_checksums: bool, transports: tuple[str, ...]) -> dict[str, float]:
    channel = grpc.aio.insecure_channel(address, options=GRPC_MESSAGE_OPTIONS)
    stub = worker_pb2_grpc.DecodeWorkerStub(channel)
    block_nbytes = pool.layout.block_nbytes
    metrics, transfer_s = {}, {}
    for transport in transports:
        sender = KVTransferClient(lambda _: channel, transports=[transport], nixl=nixl,
                                  verify_checksums=verify_checksums)

        async def one_transfer(rid: str, count: int, prefill_s: float) -> tuple[float, float, float]:
            """One transfer of ``count`` blocks whose blocks are ready ``prefill_s`` after the
            stream opens: the ``(open, send, finish)`` seconds, the pause left out."""
            admit = await stub.Admit(worker_pb2.AdmitRequest(request_id=rid, prompt_token_ids=[0] * count * BLOCK_SIZE))
            destination = KVDestination(address, admit.reservation_id, kv_transports=tuple(admit.kv_transports))
            start = time.perf_counter()
            async with sender.open(destination, rid) as stream:
                opened = time.perf_counter()
                await asyncio.sleep(prefill_s)
                ready = time.perf_counter()
                await stream.send(pool, 0, list(range(count)))
                sent = time.perf_counter()
                await stream.finish()
            done = time.perf_counter()
            await stub.Abort(worker_pb2.AbortRequest(request_id=rid))
            return opened - start, sent - ready, done - sent

        for count in block_counts:
            phases, ready = [], []
            for repeat in range(repeats + 1):  # the first is a warm-up (connection, registration)
                phases.append(await one_transfer(f"{transport}-{count}-{repeat}", count, 0.0))
                ready.append(sum((await one_transfer(f"{transport}-{count}-{repeat}-ready", count, _PREFILL_S))[1:]))
            nbytes = count * block_nbytes
            transfer_s[transport, count] = median(map(sum, phases[1:]))
            metrics[f"{transport}_gbps_{count}_blocks"] = round(nbytes / transfer_s[transport, count] / 1e9, 3)
            for i, phase in enumerate(("open", "send", "finish")):
                metrics[f"{transport}_{phase}_ms_{count}_blocks"] = round(
                    median(p[i] for p in phases[1:]) * 1e3, 3)
            metrics[f"{transport}_ready_ms_{count}_blocks"] = round(median(ready[1:]) * 1e3, 3)
            metrics[f"{transport}_ready_gbps_{count}_blocks"] = round(nbytes / median(ready[1:]) / 1e9, 3)
            print(f"{transport:>5} {count:>5} blocks: {metrics[f'{transport}_gbps_{count}_blocks']:8.2f} GB/s, "
                  f"{metrics[f'{transport}_ready_gbps_{count}_blocks']:8.2f} from ready", flush=True)
    await channel.close()
    for count in block_counts:  # over the fastest transport measured: the largest share
        digest_s = digest_seconds(pool, count, repeats)
        metrics[f"digest_ms_{count}_blocks"] = round(digest_s * 1e3, 3)
        metrics[f"digest_overhead_fraction_{count}_blocks"] = round(
            digest_s / transfer_s[next(t for t in TRANSPORTS if t in transports), count], 4)
    return metrics


def digest_seconds(pool: KVPool, count: int, repeats: int) -> float:
    """Median seconds of one transfer's digest work for ``count`` blocks, timed alone on the
    sending pool's devices: the sender's digests (``pool_digests``) and the receiver's check
    (``verify_landed``: the same kernel over the same bytes, and the comparison), each ending in
    its host copy of the digests."""
    ids = list(range(count))
    verify_landed(pool, ids, pool_digests(pool, ids), "the benchmark's blocks")  # warm-up: Triton compiles
    times = []
    for _ in range(max(repeats, 3)):
        start = time.perf_counter()
        verify_landed(pool, ids, pool_digests(pool, ids), "the benchmark's blocks")
        times.append(time.perf_counter() - start)
    return median(times)


def transfer_metrics(device: str, peer_device: str, repeats: int = 5,
                     block_counts: tuple[int, ...] = BLOCK_COUNTS, verify_checksums: bool = False,
                     transports: tuple[str, ...] = TRANSPORTS, kv_cache_dtype: str = "auto") -> dict[str, float]:
    """Run the receiving process on ``peer_device`` and measure ``transports`` and the copy
    ceiling (the metrics named in the module's docstring).

    Args:
        verify_checksums: over NIXL too, the receiver checks a CRC-32 of every chunk's blocks
            against the sender's (the gRPC stream always does): a transfer that moved wrong
            bytes fails with ``DATA_LOSS``. Slower (both sides copy the blocks to the host).

    Raises:
        StatusError: a transfer failed (``DATA_LOSS``: the bytes differ).
        SystemExit: the receiving process did not start.
    """
    num_blocks = max(block_counts)
    receiver = subprocess.Popen([sys.executable, "-m", "bench.kv_transfer", "--serve", "--device", peer_device,
                                 "--block-counts", str(num_blocks), "--kv-cache-dtype", kv_cache_dtype]
                                + ["--verify"] * verify_checksums,
                                stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT)
    try:
        line = receiver.stdout.readline()
        while line and not line.startswith("PORT "):
            line = receiver.stdout.readline()
        if not line:
            raise SystemExit("the receiving process did not start")
        address = f"127.0.0.1:{line.split()[1]}"
        pool = make_pool(device, num_blocks, kv_cache_dtype)
        nixl = NixlAgent(f"bench-tx-{os.getpid()}", pool)
        metrics = asyncio.run(measure(address, pool, nixl, repeats, block_counts, verify_checksums, transports))
        nixl.close()
    finally:
        receiver.terminate()
        receiver.wait(30)
    block_nbytes = pool.layout.block_nbytes
    del pool
    metrics["copy_gbps"] = round(copy_gbps(device.split(",")[0], peer_device.split(",")[0],
                                           max(block_counts) * block_nbytes), 3)
    if 256 in block_counts and {"nixl", "grpc"} <= set(transports):
        metrics["nixl_over_grpc_256_blocks"] = round(metrics["nixl_gbps_256_blocks"] / metrics["grpc_gbps_256_blocks"], 3)
    return metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="the sending pool's device, or one per tensor-parallel rank, comma-separated")
    parser.add_argument("--peer-device", default=None, help="the receiving pool's device(s) (default: --device)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--block-counts", default=",".join(map(str, BLOCK_COUNTS)),
                        help="blocks per transfer, comma-separated (each pool holds the largest)")
    parser.add_argument("--transports", default=",".join(TRANSPORTS), help="comma-separated: nixl, grpc")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    parser.add_argument("--verify", action="store_true", help="check a CRC-32 of every transfer (slower; "
                                                              "not written under bench/results)")
    parser.add_argument("--serve", action="store_true", help="(internal) run the receiving process")
    args = parser.parse_args()
    block_counts = tuple(int(c) for c in args.block_counts.split(","))
    if args.serve:
        asyncio.run(serve(args.device, max(block_counts), args.verify, args.kv_cache_dtype))
        return
    peer_device = args.peer_device or args.device
    transports = tuple(args.transports.split(","))
    metrics = transfer_metrics(args.device, peer_device, args.repeats, block_counts, args.verify, transports,
                               args.kv_cache_dtype)
    if args.verify:
        return
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else None
    layout = make_pool("cpu", 1, args.kv_cache_dtype).layout
    sender_tp, receiver_tp = len(args.device.split(",")), len(peer_device.split(","))
    dtype_name = resolve_kv_cache_dtype(args.kv_cache_dtype, torch.bfloat16)[0]
    workload = {"block_shape": list(layout.block_shape), "dtype": dtype_name, "block_bytes": layout.block_nbytes,
                "block_counts": list(block_counts), "repeats": args.repeats, "transports": list(transports),
                "device": args.device, "peer_device": peer_device, "sender_tensor_parallel_size": sender_tp,
                "receiver_tensor_parallel_size": receiver_tp, "processes": 2}
    keys = {"gpu": gpu} if gpu else {"machine": machine()}
    tag = (gpu.lower().replace(" ", "-") if gpu else "cpu") + (f"-tp{sender_tp}to{receiver_tp}"
                                                               if (sender_tp, receiver_tp) != (1, 1) else
                                                               "-peer" if peer_device != args.device else "") \
        + ("-fp8" if args.kv_cache_dtype == "fp8_e4m3" else "")
    write_result("kv_transfer", metrics, workload, tag=tag, model="llama-3-8b", **keys)


if __name__ == "__main__":
    main()
