"""The attacks of issue 11 on the workers themselves, over real gRPC on loopback: a caller that
skips the gateway gets the gateway's caps from every worker, and one request's bad parameters
never fail another request's stream."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from protos.tandem.v1 import gateway_pb2, worker_pb2

from tests.helpers.workers import instance_tls, pair

pytestmark = pytest.mark.slow


def prompt_ids(count: int, seed: int) -> list[int]:
    return [(1000 * seed + 7 * i) % 40000 + 100 for i in range(count)]


async def local_decode(p, request_id: str, prompt: list[int], sampling: gateway_pb2.SamplingParams) -> list[int]:
    """Admit, then Decode with local prefill; returns the tokens of sample 0."""
    admit = await p.decode.stub.Admit(worker_pb2.AdmitRequest(request_id=request_id, prompt_token_ids=prompt))
    tokens = []
    async for msg in p.decode.stub.Decode(worker_pb2.DecodeRequest(
            request_id=request_id, reservation_id=admit.reservation_id, prompt_token_ids=prompt,
            sampling=sampling, local_prefill=True)):
        tokens.extend(msg.token_ids)
    return tokens


async def refused(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        result = call()
        if hasattr(result, "__aiter__"):
            async for _ in result:
                pass
        else:
            await result
    return err.value


@pytest.mark.parametrize("max_logprobs", [20, 10**6])
def test_logprobs_bomb_is_refused_and_other_streams_finish(engines, max_logprobs):
    """With the default cap the servicer refuses it; with a cap raised past the vocabulary the
    engine refuses it when the request is added, before it can share a step with anyone."""
    async def main():
        async with pair(engines, max_logprobs=max_logprobs) as p:
            legit = gateway_pb2.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
            streams = [asyncio.create_task(local_decode(p, f"ok{i}", prompt_ids(30, i), legit)) for i in range(3)]
            await asyncio.sleep(0.3)  # the legitimate streams are running
            bomb = gateway_pb2.SamplingParams(max_tokens=24, logprobs=100000)
            err = await refused(lambda: local_decode(p, "bomb", prompt_ids(30, 9), bomb))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.details().startswith(("sampling.logprobs", "logprobs")), err.details()
            assert [len(t) for t in await asyncio.gather(*streams)] == [24, 24, 24]

    asyncio.run(main())


def test_unbounded_n_is_refused_by_the_prefill_worker(engines):
    async def main():
        async with pair(engines) as p:
            dest = worker_pb2.KVDestination(address=p.decode.address, reservation_id="r")
            for n in (2048, 9):
                err = await refused(lambda: p.prefill.stub.Prefill(worker_pb2.PrefillRequest(
                    request_id="n", prompt_token_ids=[1, 2, 3], destination=dest,
                    sampling=gateway_pb2.SamplingParams(n=n))))
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("sampling.n")
        async with pair(engines, max_n=4096) as p:  # a cap raised too far: the engine's own bound holds
            err = await refused(lambda: local_decode(p, "n2", [1, 2, 3], gateway_pb2.SamplingParams(n=2048)))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_num_seqs" in err.details()

    asyncio.run(main())


def test_seed_out_of_range_with_n2_is_refused_naming_the_field(engines):
    async def main():
        async with pair(engines) as p:
            sampling = gateway_pb2.SamplingParams(n=2, seed=2**64 - 1)
            dest = worker_pb2.KVDestination(address=p.decode.address, reservation_id="r")
            calls = [
                lambda: p.prefill.stub.Prefill(worker_pb2.PrefillRequest(
                    request_id="s", prompt_token_ids=[1, 2, 3], destination=dest, sampling=sampling)),
                lambda: p.decode.stub.Decode(worker_pb2.DecodeRequest(
                    request_id="s", reservation_id="r", prompt_token_ids=[1, 2, 3], first_token_ids=[4, 5],
                    sampling=sampling)),
            ]
            for call in calls:
                err = await refused(call)
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert err.details().startswith("sampling.seed"), err.details()

    asyncio.run(main())


def test_admit_grants_the_workers_own_lease_whatever_the_caller_asks(engines):
    """``AdmitRequest`` has no lease field; one smuggled in (field 3 = 2^32 - 1, the 49-day lease
    of the issue) is ignored and the worker's ``lease_s`` is granted."""
    async def main():
        async with pair(engines, lease_s=2.0) as p:
            raw = worker_pb2.AdmitRequest(request_id="lease", prompt_token_ids=prompt_ids(20, 1)).SerializeToString()
            raw += bytes([3 << 3]) + _varint(2**32 - 1)  # field 3, varint
            admit = p.decode.channel.unary_unary(
                "/tandem.v1.DecodeWorker/Admit", request_serializer=lambda b: b,
                response_deserializer=worker_pb2.AdmitResponse.FromString)
            response = await admit(raw)
            assert response.lease_ms == 2000
            assert (await p.decode.stub.Abort(worker_pb2.AbortRequest(request_id="lease"))).found

    asyncio.run(main())


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def test_lease_setting_is_bounded():
    from decode_worker.settings import DecodeWorkerSettings
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="lease_s"):
        DecodeWorkerSettings(lease_s=2**32 / 1000)


@pytest.mark.parametrize("request_id", ["x" * (1 << 20), "a\nb 2026-11-23 INFO forged", ""])
def test_request_id_is_capped_in_length_and_charset(engines, request_id):
    async def main():
        async with pair(engines) as p:
            dest = worker_pb2.KVDestination(address=p.decode.address, reservation_id="r")
            calls = [
                lambda: p.decode.stub.Admit(worker_pb2.AdmitRequest(request_id=request_id, prompt_token_ids=[1, 2])),
                lambda: p.decode.stub.Abort(worker_pb2.AbortRequest(request_id=request_id)),
                lambda: p.decode.stub.Decode(worker_pb2.DecodeRequest(
                    request_id=request_id, reservation_id="r", prompt_token_ids=[1, 2], local_prefill=True)),
                lambda: p.prefill.stub.Prefill(worker_pb2.PrefillRequest(
                    request_id=request_id, prompt_token_ids=[1, 2], destination=dest)),
                lambda: p.prefill.stub.Abort(worker_pb2.AbortRequest(request_id=request_id)),
            ]
            for call in calls:
                err = await refused(call)
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert err.details().startswith("request_id") and len(err.details()) < 200, err.details()[:300]

    asyncio.run(main())


def test_malformed_protobuf_on_a_worker_is_invalid_argument(engines):
    async def main():
        async with pair(engines) as p:
            transfer = p.decode.channel.stream_unary("/tandem.v1.DecodeWorker/TransferKV",
                                                     request_serializer=lambda b: b, response_deserializer=lambda b: b)
            err = await refused(lambda: transfer(iter([b"\xff\xff\xff\xff"])))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "DecodeError" not in err.details()

    asyncio.run(main())


def test_a_reservation_is_claimed_only_for_the_prompt_and_salt_it_was_admitted_for(engines):
    """KV pushed into a reservation enters the prefix cache under the admitted prompt's hashes:
    a Decode naming another prompt or another tenant's salt cannot claim it."""
    async def main():
        async with pair(engines) as p:
            prompt = prompt_ids(40, 3)
            admit = await p.decode.stub.Admit(worker_pb2.AdmitRequest(
                request_id="bind", prompt_token_ids=prompt, cache_salt="alice"))
            for other_prompt, salt in ((prompt_ids(40, 4), "alice"), (prompt, "bob"), (prompt, "")):
                err = await refused(lambda: p.decode.stub.Decode(worker_pb2.DecodeRequest(
                    request_id="bind", reservation_id=admit.reservation_id, prompt_token_ids=other_prompt,
                    cache_salt=salt, sampling=gateway_pb2.SamplingParams(max_tokens=2), local_prefill=True)))
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert err.details().startswith("prompt_token_ids"), err.details()
            tokens = await asyncio.wait_for(_claim(p, admit, prompt, "alice"), 60)
            assert len(tokens) == 2
            salted = await p.decode.stub.Admit(worker_pb2.AdmitRequest(
                request_id="bind2", prompt_token_ids=prompt, cache_salt="bob"))
            assert salted.num_cached_blocks == 0  # alice's blocks are not bob's
            same = await p.decode.stub.Admit(worker_pb2.AdmitRequest(
                request_id="bind3", prompt_token_ids=prompt, cache_salt="alice"))
            assert same.num_cached_blocks == 2
            for rid in ("bind2", "bind3"):
                await p.decode.stub.Abort(worker_pb2.AbortRequest(request_id=rid))

    asyncio.run(main())


async def _claim(p, admit, prompt, salt) -> list[int]:
    tokens = []
    async for msg in p.decode.stub.Decode(worker_pb2.DecodeRequest(
            request_id="bind", reservation_id=admit.reservation_id, prompt_token_ids=prompt, cache_salt=salt,
            sampling=gateway_pb2.SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), local_prefill=True)):
        tokens.extend(msg.token_ids)
    return tokens


def test_kv_goes_only_to_a_registered_decode_worker_over_mtls(engines, tmp_path, redis_url, key_prefix):
    """Workers with a TLS directory: plaintext callers are refused, and a prefill worker sends KV
    only to an address the registry lists as a live decode worker (the issue's SSRF)."""
    from cluster.registry import ClusterNamespace, Role, WorkerInfo, WorkerRegistry, redis_client
    from cluster.server import ServerScaffold
    from cluster.tls import CLUSTER_NAME, TlsFiles, init_certs, server_credentials
    from protos.tandem.v1 import worker_pb2_grpc

    init_certs(str(tmp_path))
    gateway_cert = TlsFiles.load(str(tmp_path), "gateway", "tls_dir").channel_credentials()

    async def main():
        async with pair(engines, instance_tls(tmp_path, Role.PREFILL, "prefill-0"),
                        instance_tls(tmp_path, Role.DECODE, "decode-0"), redis_url=redis_url,
                        redis_key_prefix=key_prefix, heartbeat_interval_s=0.2) as p:
            registry = WorkerRegistry(redis_client(redis_url), ClusterNamespace(key_prefix, 3.0))
            while not await registry.live_workers(Role.DECODE):
                await asyncio.sleep(0.05)
            await registry.client.aclose()
            err = await refused(lambda: p.decode.stub.GetStats(worker_pb2.GetStatsRequest(), timeout=3))
            assert err.code() == grpc.StatusCode.UNAVAILABLE  # the fixture's plaintext channel
            options = [("grpc.ssl_target_name_override", CLUSTER_NAME)]
            async with grpc.aio.secure_channel(p.decode.address, gateway_cert, options=options) as dch, \
                    grpc.aio.secure_channel(p.prefill.address, gateway_cert, options=options) as pch:
                decode, prefill = worker_pb2_grpc.DecodeWorkerStub(dch), worker_pb2_grpc.PrefillWorkerStub(pch)
                prompt = prompt_ids(40, 5)
                sampling = gateway_pb2.SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
                admit = await decode.Admit(worker_pb2.AdmitRequest(request_id="kv", prompt_token_ids=prompt))
                for address in ("127.0.0.1:6379", "169.254.169.254:80"):
                    err = await refused(lambda: prefill.Prefill(worker_pb2.PrefillRequest(
                        request_id="kv", prompt_token_ids=prompt, sampling=sampling,
                        destination=worker_pb2.KVDestination(address=address, reservation_id=admit.reservation_id))))
                    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
                    assert err.details().startswith("destination.address")
                # decode-0's stolen key and the Redis password register a second decode worker:
                # the prefill worker sends it no KV (the certificate there names decode-0)
                fake = ServerScaffold(["tandem.v1.Test"], reflection=False)
                fake_port = fake.bind("127.0.0.1:0", "listen", server_credentials(
                    str(tmp_path / "instances" / "decode-0"), "decode", True, "tls_dir"))
                await fake.start()
                registry = WorkerRegistry(redis_client(redis_url), ClusterNamespace(key_prefix, 30.0))
                await registry.heartbeat(WorkerInfo("evil-decode", Role.DECODE, f"127.0.0.1:{fake_port}",
                                                    p.decode.server.servicer.config))
                err = await refused(lambda: prefill.Prefill(worker_pb2.PrefillRequest(
                    request_id="kv", prompt_token_ids=prompt, sampling=sampling,
                    destination=worker_pb2.KVDestination(address=f"127.0.0.1:{fake_port}",
                                                         reservation_id=admit.reservation_id))))
                assert err.code() == grpc.StatusCode.PERMISSION_DENIED, err
                assert err.details().startswith("destination.address")
                await registry.deregister("evil-decode", Role.DECODE)
                await registry.client.aclose()
                await fake.stop(0)
                pre = await prefill.Prefill(worker_pb2.PrefillRequest(
                    request_id="kv", prompt_token_ids=prompt, sampling=sampling,
                    destination=worker_pb2.KVDestination(
                        address=p.decode.address, reservation_id=admit.reservation_id, layout=admit.layout,
                        num_cached_blocks=admit.num_cached_blocks, kv_transports=admit.kv_transports)))
                tokens = [m.token_ids async for m in decode.Decode(worker_pb2.DecodeRequest(
                    request_id="kv", reservation_id=admit.reservation_id, prompt_token_ids=prompt,
                    first_token_ids=[t.token_id for t in pre.first_tokens], sampling=sampling))]
                assert sum(len(t) for t in tokens) == 2  # the first token came from the prefill worker
                # a cluster certificate of the wrong role: KV only from prefill workers, Prefill
                # only from the gateway
                stream = decode.TransferKV()
                await stream.done_writing()
                err = await refused(lambda: stream)
                assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "prefill" in err.details()
            prefill_cert = TlsFiles.load(str(tmp_path), "prefill", "tls_dir").channel_credentials()
            async with grpc.aio.secure_channel(p.prefill.address, prefill_cert, options=options) as pch:
                err = await refused(lambda: worker_pb2_grpc.PrefillWorkerStub(pch).Prefill(
                    worker_pb2.PrefillRequest(request_id="kv2", prompt_token_ids=prompt)))
                assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "gateway" in err.details()

    asyncio.run(main())


def test_a_redis_restarted_empty_does_not_make_a_live_decode_worker_an_untrusted_destination(engines, private_redis):
    """The destination check trusts a decode worker a registry read listed within the registry
    TTL: right after Redis lost everything (before the next heartbeat) KV still goes to it,
    while an address never registered stays refused."""
    import redis as redis_sync

    from cluster.registry import ClusterNamespace, Role, WorkerRegistry, redis_client

    async def prefill_to(p, admit, prompt, address: str, request_id: str):
        sampling = gateway_pb2.SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        return await p.prefill.stub.Prefill(worker_pb2.PrefillRequest(
            request_id=request_id, prompt_token_ids=prompt, sampling=sampling,
            destination=worker_pb2.KVDestination(address=address, reservation_id=admit.reservation_id,
                                                 layout=admit.layout, kv_transports=admit.kv_transports)))

    async def main():
        # heartbeats every 2.5 s with a TTL of 3 s: after a flush the registry stays empty a while
        async with pair(engines, redis_url=private_redis.url, redis_key_prefix="ttl", heartbeat_interval_s=2.5,
                        registry_ttl_s=3.0) as p:
            registry = WorkerRegistry(redis_client(private_redis.url), ClusterNamespace("ttl", 3.0))
            while not await registry.live_workers(Role.DECODE):
                await asyncio.sleep(0.05)
            prompt = prompt_ids(40, 6)
            admit = await p.decode.stub.Admit(worker_pb2.AdmitRequest(request_id="a", prompt_token_ids=prompt))
            await prefill_to(p, admit, prompt, p.decode.address, "a")  # the prefill worker reads the registry
            await p.decode.stub.Abort(worker_pb2.AbortRequest(request_id="a"))
            redis_sync.Redis.from_url(private_redis.url).flushall()
            assert not await registry.live_workers(Role.DECODE)
            admit = await p.decode.stub.Admit(worker_pb2.AdmitRequest(request_id="b", prompt_token_ids=prompt))
            err = await refused(lambda: prefill_to(p, admit, prompt, "127.0.0.1:1", "b"))  # a miss: read again
            assert err.code() == grpc.StatusCode.PERMISSION_DENIED
            await asyncio.sleep(0.3)  # past the re-read interval: a miss would read the empty registry
            assert not await registry.live_workers(Role.DECODE)
            response = await prefill_to(p, admit, prompt, p.decode.address, "b")
            assert len(response.first_tokens) == 1
            await p.decode.stub.Abort(worker_pb2.AbortRequest(request_id="b"))
            await registry.client.aclose()

    asyncio.run(main())


def test_logit_processing_and_structured_output_are_checked_by_every_worker(engines):
    """A caller that skips the gateway: a grammar the compiler refuses is refused by Admit before
    a block is reserved, text bad words (the gateway's to tokenize) and caps by Prefill and
    Decode, each naming the field; streams beside them finish."""
    async def main():
        async with pair(engines, max_logit_bias=2) as p:
            free = await p.decode.engine.num_free_blocks()
            bad_grammar = gateway_pb2.SamplingParams(regex="(?<=a)b")
            err = await refused(lambda: p.decode.stub.Admit(worker_pb2.AdmitRequest(
                request_id="g", prompt_token_ids=prompt_ids(30, 5), sampling=bad_grammar)))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("sampling.regex: ")
            assert await p.decode.engine.num_free_blocks() == free
            legit = gateway_pb2.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, frequency_penalty=1.0)
            streams = [asyncio.create_task(local_decode(p, f"ok{i}", prompt_ids(30, i), legit)) for i in range(2)]
            await asyncio.sleep(0.3)
            dest = worker_pb2.KVDestination(address=p.decode.address, reservation_id="r")
            for i, (sampling, field) in enumerate((
                    (gateway_pb2.SamplingParams(bad_words=["x"]), "sampling.bad_words"),
                    (gateway_pb2.SamplingParams(logit_bias={1: 1, 2: 1, 3: 1}), "sampling.logit_bias"),
                    (gateway_pb2.SamplingParams(grammar="root ::= nope"), "sampling.grammar"))):
                err = await refused(lambda: p.prefill.stub.Prefill(worker_pb2.PrefillRequest(
                    request_id="p", prompt_token_ids=[1, 2, 3], destination=dest, sampling=sampling)))
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith(
                    (field, field.removeprefix("sampling."))), err.details()  # the engine's refusal names its own field
                err = await refused(lambda: local_decode(p, f"d{i}", prompt_ids(30, 7), sampling))
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith(
                    (field, field.removeprefix("sampling."))), err.details()
            assert [len(t) for t in await asyncio.gather(*streams)] == [24, 24]

    asyncio.run(main())
