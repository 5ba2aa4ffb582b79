"""The clusters whose behaviour depends on how KV moves (the request path, the failures) run once
with each KV transport: NIXL over host memory, and the gRPC stream."""

import pytest


@pytest.fixture(scope="module", params=["nixl", "grpc"])
def kv_transport(request) -> str:
    return request.param
