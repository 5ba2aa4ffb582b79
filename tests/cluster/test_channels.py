"""Channels between Tandem processes: keepalive fails the calls of a frozen peer (SIGSTOP)
within about keepalive time + timeout, servers accept the pings, and a reset channel connects
afresh while calls on the old one finish. A real server in a child process."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap
import time

import grpc
import pytest

from cluster.channels import ChannelCache, client_keepalive_options
from protos.grpc.health.v1 import health_pb2, health_pb2_grpc

SERVER = textwrap.dedent("""
    import asyncio
    from cluster.channels import server_keepalive_options
    from cluster.health import SERVING
    from cluster.server import ServerScaffold

    async def main():
        scaffold = ServerScaffold(["test.Service"], server_keepalive_options(0.5, 0.5), reflection=True)
        port = scaffold.bind("127.0.0.1:0", "test")
        await scaffold.start()
        await scaffold.health.set_all(SERVING)
        print(port, flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
""")


@pytest.fixture
def server():
    proc = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE)
    proc.address = f"127.0.0.1:{int(proc.stdout.readline())}"
    yield proc
    proc.send_signal(signal.SIGCONT)
    proc.kill()
    proc.wait()


def test_a_frozen_peer_fails_open_calls_within_keepalive_time_plus_timeout(server):
    async def main():
        channels = ChannelCache(client_keepalive_options(0.5, 0.5))
        watch = health_pb2_grpc.HealthStub(channels.get(server.address)).Watch(health_pb2.HealthCheckRequest())
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        await asyncio.sleep(2)  # pings with no data for a while: the server accepts them, the call lives
        server.send_signal(signal.SIGSTOP)
        frozen_at = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await asyncio.wait_for(watch.read(), 10)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - frozen_at < 2.5
        await channels.close()

    asyncio.run(main())


def test_reset_gives_a_fresh_channel_and_lets_calls_on_the_old_one_finish(server):
    async def main():
        channels = ChannelCache(client_keepalive_options(0.5, 0.5))
        old = channels.get(server.address)
        watch = health_pb2_grpc.HealthStub(old).Watch(health_pb2.HealthCheckRequest())
        await watch.read()
        channels.reset(server.address)
        fresh = channels.get(server.address)
        assert fresh is not old and channels.get(server.address) is fresh
        answer = await health_pb2_grpc.HealthStub(fresh).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
        assert not watch.done()  # the old channel's call is still open
        await channels.close()
        assert watch.done()

    asyncio.run(main())
