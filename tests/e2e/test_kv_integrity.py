"""No status OK with wrong tokens, real processes on loopback, once per KV transport: one prefill
worker, one decode worker and a gateway, both workers with the KV fault injector of
``tests/helpers/kv_faults`` (its ``sitecustomize`` first on their ``PYTHONPATH``), switched
between requests through a file.

Each fault corrupts every transfer while it is set: a bit flipped in a block where it landed, a
truncated block, a block read from the wrong slot, a prefill worker sending random bytes. The
decode worker refuses the transfer (ABORTED, digests or finiteness) and zeroes the refused
blocks, the gateway retries the request on another path (here: the decode worker prefills it
itself) and the client gets the fault-free tokens; the refusal is counted on the decode worker.
A prefill worker announcing another KV layout ends in a clear error naming it. After each
request both workers are back to their free blocks, and a fault-free request through the
prefill worker gives the fault-free tokens again.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import grpc
import pytest

from protos.tandem.v1 import gateway_pb2

from tests.helpers.cluster import (
    EXACT_RESUME, SP, collect, counter, settled_free_blocks, shared_redis_cluster, wait_free_blocks,
)
from tests.helpers.paths import ROOT

pytestmark = pytest.mark.slow
INJECTOR = ROOT / "tests" / "helpers" / "kv_faults"
# One prefill chunk (the default budget is larger): the prefill reads its own blocks before the
# ``random`` fault overwrites them on their way out.
REQUEST = gateway_pb2.GenerateRequest(
    prompt=" ".join(f"Step {i}: the river carries sand to the sea." for i in range(12)),
    sampling=SP(max_tokens=12, temperature=0, ignore_eos=True))
RETRIED = ["flip", "truncate", "wrong_slot", "random"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, redis_url, kv_transport):
    tmp = tmp_path_factory.mktemp(f"kv-integrity-{kv_transport}")
    fault_file = tmp / "fault"
    fault_file.write_text("")
    injected = {"PYTHONPATH": os.pathsep.join(filter(None, [str(INJECTOR), os.environ.get("PYTHONPATH", "")])),
                "KV_FAULT_FILE": str(fault_file)}
    # A fixed split (every prompt prefilled by the prefill worker while it is not avoided): under
    # adaptive placement a faulted request was often prefilled locally and met no transfer.
    with shared_redis_cluster(tmp, "kv-integrity", redis_url, num_prefill=1, num_decode=1, kv_transport=kv_transport,
                              env={"TANDEM_ENABLE_PREFIX_CACHING": "false", "TANDEM_PREFILL_PLACEMENT": "static",
                                   "TANDEM_LOCAL_PREFILL_MAX_TOKENS": "0", **EXACT_RESUME},
                              worker_env={"prefill-0": injected, "decode-0": injected}) as cluster:
        cluster.fault_file = fault_file
        yield cluster


def integrity_failures(cluster) -> float:
    return counter(cluster, "decode-0", "tandem_kv_integrity_failures")


def routed_through_the_prefill_worker(cluster, clean_tokens: list[int], within_s: float = 60.0) -> None:
    """Send the request, fault-free, until its KV comes from the prefill worker again (after a
    failure the gateway may avoid that worker for a while and have the decode worker prefill)."""
    deadline = time.monotonic() + within_s
    while True:
        transfers = counter(cluster, "decode-0", "tandem_kv_transfers", status="OK")
        assert collect(cluster.stub, REQUEST)["samples"][0]["token_ids"] == clean_tokens
        if counter(cluster, "decode-0", "tandem_kv_transfers", status="OK") > transfers:
            return
        assert time.monotonic() < deadline, "the gateway does not route to the prefill worker again"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def clean_tokens(cluster) -> list[int]:
    out = collect(cluster.stub, REQUEST)
    assert integrity_failures(cluster) == 0 and counter(cluster, "decode-0", "tandem_kv_transfers", status="OK") == 1
    return out["samples"][0]["token_ids"]


def with_fault(cluster, fault: str, clean_tokens: list[int], met: Callable[[object], bool],
               tries: int = 5) -> object:
    """Run the request with ``fault`` set until ``met(outcome)`` (the gateway may have had the
    decode worker prefill it instead, with no transfer to meet the fault: its answer must be
    right too); returns that outcome (the output, or the ``grpc.RpcError``)."""
    for _ in range(tries):
        routed_through_the_prefill_worker(cluster, clean_tokens)
        cluster.fault_file.write_text(fault)
        try:
            outcome = collect(cluster.stub, REQUEST)
        except grpc.RpcError as exc:
            outcome = exc
        finally:
            cluster.fault_file.write_text("")
        if met(outcome):
            return outcome
        assert not isinstance(outcome, grpc.RpcError), outcome
        assert outcome["samples"][0]["token_ids"] == clean_tokens
    raise AssertionError(f"{tries} requests with fault {fault!r} met no transfer")


@pytest.mark.parametrize("fault", RETRIED)
def test_corrupted_kv_is_caught_and_the_request_served_right_elsewhere(cluster, clean_tokens, fault):
    start = settled_free_blocks(cluster, within_s=10)
    refused = integrity_failures(cluster)
    out = with_fault(cluster, fault, clean_tokens, lambda outcome: integrity_failures(cluster) > refused)
    assert not isinstance(out, grpc.RpcError), out
    assert out["samples"][0]["token_ids"] == clean_tokens
    assert integrity_failures(cluster) == refused + 1
    assert wait_free_blocks(cluster, start, within_s=10) == start


def test_a_peer_of_another_kv_layout_is_a_clear_error(cluster, clean_tokens):
    start = settled_free_blocks(cluster, within_s=10)
    error = with_fault(cluster, "layout", clean_tokens, lambda outcome: isinstance(outcome, grpc.RpcError))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "dtype" in error.details() or "layout" in error.details(), error.details()
    assert wait_free_blocks(cluster, start, within_s=10) == start
    routed_through_the_prefill_worker(cluster, clean_tokens)  # the fault gone, all is well
