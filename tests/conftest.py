"""Test-wide setup: Triton runs under its CPU interpreter when no GPU is present; Redis fixtures
(the shared Redis at 127.0.0.1:6379 under a unique test-only key prefix, deleted afterwards,
and private ``redis-server`` processes that a test may kill and restart). Shared helpers live
in ``tests/helpers``, not here."""

import os
import shutil
import uuid

# The tests start and restart worker processes (fork + exec, with a death signal set between
# the two) while their own gRPC channels are open; gRPC's fork handlers then abort the child
# now and then before it execs (SIGABRT: "epoll_wait error: Bad file descriptor"). The children
# exec at once and need none of them. Set before anything imports grpc.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import pytest  # noqa: E402
import redis  # noqa: E402
import torch  # noqa: E402

# The helpers' asserts report their values as the tests' do (before any helper is imported).
pytest.register_assert_rewrite("tests.helpers")

from cli.redis_server import RedisServer  # noqa: E402
from tests.helpers.shared_redis import REDIS_URL, delete_keys  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def key_prefix():
    """A fresh ``test-<uuid>`` key prefix on the shared Redis; its keys are deleted after the test."""
    client = redis.Redis.from_url(REDIS_URL, socket_timeout=2)
    try:
        client.ping()
    except redis.ConnectionError:
        pytest.fail("no Redis at 127.0.0.1:6379: redis-server --daemonize yes --bind 127.0.0.1 "
                    "--port 6379 --save '' --appendonly no")
    prefix = f"test-{uuid.uuid4().hex}"
    client.close()
    yield prefix
    delete_keys(REDIS_URL, prefix)


@pytest.fixture
def private_redis(tmp_path):
    """A started :class:`RedisServer`, killed after the test."""
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not on PATH")
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_url() -> str:
    """URL of the shared Redis (use with ``key_prefix``)."""
    return REDIS_URL
