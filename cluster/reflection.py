"""gRPC server reflection, v1 and v1alpha, with the documentation of Tandem's own files.

Written here rather than taken from grpcio-reflection because that package serves v1alpha
only (current clients such as grpcurl ask v1 first) and builds its file descriptors from the
compiled stubs, which carry no comments, so ``grpcurl describe`` showed no field
documentation. Tandem's files are served from ``protos/tandem/v1/descriptors.binpb`` (compiled
with their source info by ``protos/compile.py``); anything else from the default descriptor
pool.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from importlib.resources import files
from types import ModuleType

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool

from protos import DESCRIPTOR_SET
from protos.grpc.reflection.v1 import reflection_pb2 as v1_pb2
from protos.grpc.reflection.v1 import reflection_pb2_grpc as v1_grpc
from protos.grpc.reflection.v1alpha import reflection_pb2 as v1alpha_pb2
from protos.grpc.reflection.v1alpha import reflection_pb2_grpc as v1alpha_grpc


def _documented_files() -> dict[str, bytes]:
    """File name → serialized ``FileDescriptorProto`` with comments, for Tandem's own files."""
    raw = files("protos").joinpath(DESCRIPTOR_SET.removeprefix("protos/")).read_bytes()
    fds = descriptor_pb2.FileDescriptorSet.FromString(raw)
    return {f.name: f.SerializeToString() for f in fds.file}


class _Reflection:
    """One version of the reflection service over ``pb2`` (v1 and v1alpha messages are alike)."""

    def __init__(self, pb2: ModuleType, service_names: list[str], documented: dict[str, bytes]) -> None:
        self.pb2 = pb2
        self.service_names = sorted(service_names)
        self.documented = documented
        self.pool = descriptor_pool.Default()

    def _file(self, name: str) -> bytes:
        if name in self.documented:
            return self.documented[name]
        proto = descriptor_pb2.FileDescriptorProto()
        self.pool.FindFileByName(name).CopyToProto(proto)
        return proto.SerializeToString()

    def _files(self, name: str) -> list[bytes]:
        """The file and every file it imports, transitively (what a client needs to decode it)."""
        seen, order, todo = set(), [], [name]
        while todo:
            current = todo.pop()
            if current in seen:
                continue
            seen.add(current)
            order.append(self._file(current))
            todo.extend(d.name for d in self.pool.FindFileByName(current).dependencies)
        return order

    def answer(self, request):
        pb2 = self.pb2
        which = request.WhichOneof("message_request")
        try:
            if which == "list_services":
                return pb2.ServerReflectionResponse(
                    original_request=request, list_services_response=pb2.ListServiceResponse(
                        service=[pb2.ServiceResponse(name=n) for n in self.service_names]))
            if which == "file_by_filename":
                found = self._files(request.file_by_filename)
            elif which == "file_containing_symbol":
                found = self._files(self.pool.FindFileContainingSymbol(request.file_containing_symbol).name)
            elif which == "file_containing_extension":
                extension = self.pool.FindExtensionByNumber(
                    self.pool.FindMessageTypeByName(request.file_containing_extension.containing_type),
                    request.file_containing_extension.extension_number)
                found = self._files(extension.file.name)
            elif which == "all_extension_numbers_of_type":
                message = self.pool.FindMessageTypeByName(request.all_extension_numbers_of_type)
                numbers = [e.number for e in self.pool.FindAllExtensions(message)]
                return pb2.ServerReflectionResponse(
                    original_request=request, all_extension_numbers_response=pb2.ExtensionNumberResponse(
                        base_type_name=message.full_name, extension_number=numbers))
            else:
                return self._error(request, grpc.StatusCode.INVALID_ARGUMENT, "no request given")
        except KeyError:
            return self._error(request, grpc.StatusCode.NOT_FOUND, f"{which} not found")
        return pb2.ServerReflectionResponse(
            original_request=request, file_descriptor_response=pb2.FileDescriptorResponse(file_descriptor_proto=found))

    def _error(self, request, code: grpc.StatusCode, message: str):
        return self.pb2.ServerReflectionResponse(
            original_request=request,
            error_response=self.pb2.ErrorResponse(error_code=code.value[0], error_message=message))

    async def ServerReflectionInfo(self, request_iterator, context) -> AsyncIterator:  # noqa: N802
        async for request in request_iterator:
            yield self.answer(request)


def add_reflection(server: grpc.aio.Server, service_names: list[str]) -> None:
    """Serve reflection v1 and v1alpha on ``server``, listing ``service_names`` (plus both
    reflection services themselves)."""
    documented = _documented_files()
    names = [*service_names, "grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"]
    v1_grpc.add_ServerReflectionServicer_to_server(_Reflection(v1_pb2, names, documented), server)
    v1alpha_grpc.add_ServerReflectionServicer_to_server(_Reflection(v1alpha_pb2, names, documented), server)
