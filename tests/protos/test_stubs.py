"""The checked-in stubs are what the .proto sources generate, and they import as a package."""

from pathlib import Path

from protos.compile import REPO_ROOT, compile_stubs, stub_paths


def test_checked_in_stubs_match_proto_sources(tmp_path: Path) -> None:
    compile_stubs(tmp_path)
    for rel in stub_paths():
        fresh, checked_in = tmp_path / rel, REPO_ROOT / rel
        assert checked_in.exists(), f"{rel} is missing: run python -m protos.compile"
        assert fresh.read_bytes() == checked_in.read_bytes(), f"{rel} is stale: run python -m protos.compile"


def test_no_stub_without_a_proto_source() -> None:
    on_disk = {
        p.relative_to(REPO_ROOT).as_posix() for pattern in ("*_pb2.py", "*_pb2.pyi", "*_pb2_grpc.py", "*.binpb")
        for p in (REPO_ROOT / "protos").rglob(pattern)
    }
    assert on_disk == set(stub_paths())


def test_stubs_import_as_package_and_gateway_stands_alone() -> None:
    from protos.tandem.v1 import (  # noqa: F401
        gateway_pb2, gateway_pb2_grpc, kvtransfer_pb2, kvtransfer_pb2_grpc, worker_pb2, worker_pb2_grpc,
    )

    # External clients compile gateway.proto alone: it must import nothing.
    assert list(gateway_pb2.DESCRIPTOR.dependencies) == []
    assert gateway_pb2.DESCRIPTOR.package == "tandem.v1"
    services = {
        "Gateway": (gateway_pb2, {"Generate", "Tokenize", "GetModelInfo"}),
        "DecodeWorker": (worker_pb2, {"Admit", "TransferKV", "Decode", "Abort", "GetStats"}),
        "PrefillWorker": (worker_pb2, {"Prefill", "Abort", "GetStats"}),
    }
    for name, (module, methods) in services.items():
        assert {m.name for m in module.DESCRIPTOR.services_by_name[name].methods} == methods
    assert hasattr(gateway_pb2_grpc, "GatewayStub") and hasattr(worker_pb2_grpc, "DecodeWorkerServicer")


def test_generate_request_round_trips_with_oneof_and_optional_presence() -> None:
    from protos.tandem.v1 import gateway_pb2

    request = gateway_pb2.GenerateRequest(
        chat=gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role="user", content="hi")]),
        sampling=gateway_pb2.SamplingParams(max_tokens=8, temperature=0.0, stop=["\n"]),
    )
    parsed = gateway_pb2.GenerateRequest.FromString(request.SerializeToString())
    assert parsed.WhichOneof("input") == "chat"
    # temperature=0 (greedy) must stay distinguishable from "unset" (default 1.0).
    assert parsed.sampling.HasField("temperature") and not parsed.sampling.HasField("top_p")
    assert parsed == request


def test_vendored_kserve_protos_are_the_descriptors_triton_clients_register() -> None:
    """Registered under the upstream names with the same content, so tritonclient and the
    gateway share one process (a pool refuses the same messages under a second file name)."""
    from google.protobuf import descriptor_pb2
    from tritonclient.grpc import model_config_pb2 as theirs_config, service_pb2 as theirs

    from protos.inference import grpc_service_pb2, model_config_pb2

    def serialized(module) -> bytes:
        proto = descriptor_pb2.FileDescriptorProto()
        module.DESCRIPTOR.CopyToProto(proto)
        return proto.SerializeToString()

    assert (grpc_service_pb2.DESCRIPTOR.name, model_config_pb2.DESCRIPTOR.name) == \
        ("grpc_service.proto", "model_config.proto")
    assert serialized(grpc_service_pb2) == serialized(theirs)
    assert serialized(model_config_pb2) == serialized(theirs_config)
