"""api/proto: the committed generated code is current, and the wire matches tritonclient's.

Both checks compile ``inference.proto`` with ``grpc_tools.protoc`` in a subprocess and
never import ``api.proto`` here: its ``inference.*`` symbols would collide with the ones
``tritonclient.grpc`` registers in the same default descriptor pool.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from tritonclient.grpc import service_pb2

from tests.procs import ROOT

PROTO = "api/proto/inference.proto"
GENERATED = ["api/proto/inference_pb2.py", "api/proto/inference_pb2.pyi",
             "api/proto/inference_pb2_grpc.py"]


def protoc(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", str(ROOT), *args, PROTO],
                   check=True, cwd=ROOT)


def test_committed_generated_code_is_current(tmp_path: Path) -> None:
    protoc(f"--python_out={tmp_path}", f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}")
    for name in GENERATED:
        fresh = (tmp_path / name).read_text()
        assert (ROOT / name).read_text() == fresh, (
            f"{name} is stale: regenerate it with python -m grpc_tools.protoc -I . --python_out=. "
            f"--pyi_out=. --grpc_python_out=. {PROTO} (grpcio-tools as pinned in pyproject)")


def ours(tmp_path: Path) -> descriptor_pool.DescriptorPool:
    descriptors = tmp_path / "inference.pb"
    protoc(f"--descriptor_set_out={descriptors}")
    pool = descriptor_pool.DescriptorPool()
    for file in descriptor_pb2.FileDescriptorSet.FromString(descriptors.read_bytes()).file:
        pool.Add(file)
    return pool


def kind(field: FieldDescriptor) -> tuple[int, bool, str]:
    target = field.message_type or field.enum_type
    return field.type, field.is_repeated, target.full_name if target else ""


def compare(mine: Descriptor, theirs: Descriptor) -> None:
    for field in mine.fields:
        twin = theirs.fields_by_name.get(field.name)
        assert twin is not None, f"{mine.full_name}.{field.name} is not in tritonclient's"
        assert field.number == twin.number, f"{mine.full_name}.{field.name} number"
        assert kind(field) == kind(twin), f"{mine.full_name}.{field.name} type"
        if field.enum_type:
            assert {v.name: v.number for v in field.enum_type.values}.items() <= {
                v.name: v.number for v in twin.enum_type.values}.items()
    for nested in mine.nested_types:
        compare(nested, theirs.nested_types_by_name[nested.name])


def test_messages_and_methods_match_tritonclient(tmp_path: Path) -> None:
    pool = ours(tmp_path)
    service = pool.FindServiceByName("inference.GRPCInferenceService")
    theirs = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert len(service.methods) == 18
    for method in service.methods:
        twin = theirs.methods_by_name[method.name]
        assert method.input_type.full_name == twin.input_type.full_name
        assert method.output_type.full_name == twin.output_type.full_name
        assert (method.client_streaming, method.server_streaming) == (
            twin.client_streaming, twin.server_streaming)
    file = pool.FindFileByName(PROTO)
    triton = descriptor_pool.Default()
    for message in file.message_types_by_name.values():
        compare(message, triton.FindMessageTypeByName(message.full_name))
