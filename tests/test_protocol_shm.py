"""System shared memory through the official tritonclient, over HTTP and gRPC, against
two API processes of one host and a worker serving a stand-in of Triton's ``simple``.

The flow is that of Triton's ``simple_http_shm_client.py`` / ``simple_grpc_shm_client.py``
examples (one input region holding both inputs, one output region receiving both
outputs), then the cases of Triton's ``L0_shared_memory`` QA test that apply. Never
import ``api.proto`` here (see tests/test_protocol_grpc.py).
"""

from __future__ import annotations

import base64
import re
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from tests.conftest import Stack
from tests.procs import RedisServer, free_port
from tests.protocol_stack import PROTOCOL_MODELS, http_host

MAX_REGIONS = 6
INPUT0 = np.arange(16, dtype=np.int32).reshape(1, 16)
INPUT1 = np.ones((1, 16), dtype=np.int32)
SIZE = INPUT0.nbytes  # 64
SLOW_MS = 2000


@pytest.fixture(scope="module")
def stack(redis_server: RedisServer, logdir: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Two API processes sharing the gRPC port (SO_REUSEPORT) and one worker."""
    repository = tmp_path_factory.mktemp("shm-repo")
    shutil.copytree(PROTOCOL_MODELS / "simple", repository / "simple")
    shutil.copytree(PROTOCOL_MODELS / "simple", repository / "simple_slow")
    config = repository / "simple_slow" / "config.yaml"
    config.write_text(config.read_text().replace("delay_ms: 0", f"delay_ms: {SLOW_MS}"))
    made = Stack(redis_server.url, repository, logdir,
                 extra_env={"CONVEYOR_GRPC_PORT": str(free_port()),
                            "CONVEYOR_GRPC_REUSEPORT": "1",
                            "CONVEYOR_ALLOW_CLIENT_SHM": "1",
                            "CONVEYOR_SHM_MAX_REGIONS": str(MAX_REGIONS)})
    made.add_api()
    made.add_api()
    made.add_worker()
    try:
        made.wait_ready(timeout=90)
        yield made
    finally:
        made.stop()


Client = Any
"""tritonclient.http's or tritonclient.grpc's InferenceServerClient."""


@pytest.fixture(params=["http", "grpc"])
def protocol(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def client(stack: Stack, protocol: str) -> Iterator[Client]:
    made: Client = (httpclient.InferenceServerClient(http_host(stack)) if protocol == "http"
                    else grpcclient.InferenceServerClient(
                        f"127.0.0.1:{stack.extra_env['CONVEYOR_GRPC_PORT']}"))
    made.unregister_system_shared_memory()
    yield made
    made.unregister_system_shared_memory()
    made.close()


class Regions:
    """Shared memory regions this test created (tritonclient's helpers); destroyed after it."""

    def __init__(self) -> None:
        self.handles: list[Any] = []

    def create(self, size: int) -> tuple[str, str, Any]:
        """(region name, key, handle) of a new region of ``size`` bytes."""
        name = f"r{uuid.uuid4().hex[:10]}"
        handle = shm.create_shared_memory_region(name, f"/conveyor-{name}", size)
        self.handles.append(handle)
        return name, f"/conveyor-{name}", handle

    def destroy(self) -> None:
        for handle in self.handles:
            shm.destroy_shared_memory_region(handle)


@pytest.fixture
def regions() -> Iterator[Regions]:
    made = Regions()
    yield made
    made.destroy()


def module(protocol: str) -> Any:
    return httpclient if protocol == "http" else grpcclient


def names(status: Any) -> list[str]:
    """Region names of a status answer: a list over HTTP, a message over gRPC."""
    if isinstance(status, list):
        return sorted(r["name"] for r in status)
    return sorted(status.regions)


def tensors(protocol: str, in_region: str, out_region: str, *, output_offset: int = 0,
            output_size: int = SIZE) -> tuple[list[Any], list[Any]]:
    """INPUT0 at 0 and INPUT1 at SIZE of ``in_region``; OUTPUT0 at ``output_offset`` and
    OUTPUT1 at ``output_offset + SIZE`` of ``out_region``."""
    lib = module(protocol)
    inputs = [lib.InferInput("INPUT0", [1, 16], "INT32"), lib.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_shared_memory(in_region, SIZE)
    inputs[1].set_shared_memory(in_region, SIZE, offset=SIZE)
    outputs = [lib.InferRequestedOutput(name, **({"binary_data": True} if protocol == "http"
                                                  else {}))
               for name in ("OUTPUT0", "OUTPUT1")]
    outputs[0].set_shared_memory(out_region, output_size, offset=output_offset)
    outputs[1].set_shared_memory(out_region, output_size, offset=output_offset + SIZE)
    return inputs, outputs


def filled_input_region(client: Client, regions: Regions) -> str:
    name, key, handle = regions.create(2 * SIZE)
    shm.set_shared_memory_region(handle, [INPUT0, INPUT1])
    client.register_system_shared_memory(name, key, 2 * SIZE)
    return name


def test_the_shm_client_example(stack: Stack, client: Client, protocol: str,
                                regions: Regions) -> None:
    in_name = filled_input_region(client, regions)
    out_name, out_key, out_handle = regions.create(2 * SIZE)
    client.register_system_shared_memory(out_name, out_key, 2 * SIZE)
    assert names(client.get_system_shared_memory_status()) == sorted([in_name, out_name])
    inputs, outputs = tensors(protocol, in_name, out_name)
    result = client.infer("simple", inputs, outputs=outputs)
    for index, (name, expected) in enumerate([("OUTPUT0", INPUT0 + INPUT1),
                                              ("OUTPUT1", INPUT0 - INPUT1)]):
        output = result.get_output(name)
        datatype, shape = ((output["datatype"], output["shape"]) if protocol == "http"
                           else (output.datatype, list(output.shape)))
        assert (datatype, shape) == ("INT32", [1, 16])
        sent = (output.get("data", output.get("parameters")) if protocol == "http"
                else result.get_response().raw_output_contents[index])
        assert not sent  # the data is in the region only
        got = shm.get_contents_as_numpy(out_handle, np.int32, shape, offset=index * SIZE)
        np.testing.assert_array_equal(got, expected)
    status = client.get_system_shared_memory_status(out_name)
    if protocol == "http":
        assert status == [{"name": out_name, "key": out_key, "offset": 0,
                           "byte_size": 2 * SIZE}]
    else:
        assert status.regions[out_name].key == out_key
        assert status.regions[out_name].byte_size == 2 * SIZE
    client.unregister_system_shared_memory(out_name)
    assert names(client.get_system_shared_memory_status()) == [in_name]
    client.unregister_system_shared_memory()
    assert names(client.get_system_shared_memory_status()) == []


def test_inputs_mixed_with_raw_data(client: Client, protocol: str, regions: Regions) -> None:
    in_name = filled_input_region(client, regions)
    out_name, out_key, out_handle = regions.create(2 * SIZE)
    client.register_system_shared_memory(out_name, out_key, 2 * SIZE)
    inputs, outputs = tensors(protocol, in_name, out_name)
    inputs[1] = module(protocol).InferInput("INPUT1", [1, 16], "INT32")
    inputs[1].set_data_from_numpy(INPUT1 * 5)
    client.infer("simple", inputs, outputs=outputs)
    np.testing.assert_array_equal(
        shm.get_contents_as_numpy(out_handle, np.int32, [1, 16]), INPUT0 + 5)


def test_a_region_is_seen_by_every_api_process(stack: Stack, regions: Regions) -> None:
    first, second = (httpclient.InferenceServerClient(url.removeprefix("http://"))
                     for _, url in stack.apis)
    try:
        in_name = filled_input_region(first, regions)
        out_name, out_key, out_handle = regions.create(2 * SIZE)
        first.register_system_shared_memory(out_name, out_key, 2 * SIZE)
        assert names(second.get_system_shared_memory_status()) == sorted([in_name, out_name])
        inputs, outputs = tensors("http", in_name, out_name)
        second.infer("simple", inputs, outputs=outputs)
        np.testing.assert_array_equal(
            shm.get_contents_as_numpy(out_handle, np.int32, [1, 16]), INPUT0 + INPUT1)
        second.unregister_system_shared_memory()
        assert names(first.get_system_shared_memory_status()) == []
        with pytest.raises(InferenceServerException, match="Unable to find shared memory"):
            first.infer("simple", inputs, outputs=outputs)
    finally:
        first.close()
        second.close()


def test_a_region_unregistered_during_inference_still_gets_its_outputs(
        stack: Stack, regions: Regions) -> None:
    """As Triton: requests in flight keep the regions they use; new ones no longer find them."""
    client = httpclient.InferenceServerClient(http_host(stack), concurrency=2)
    try:
        in_name = filled_input_region(client, regions)
        out_name, out_key, out_handle = regions.create(2 * SIZE)
        client.register_system_shared_memory(out_name, out_key, 2 * SIZE)
        inputs, outputs = tensors("http", in_name, out_name)
        pending = client.async_infer("simple_slow", inputs, outputs=outputs)
        time.sleep(SLOW_MS / 2500)  # the request holds its regions: its model is running
        client.unregister_system_shared_memory()
        assert names(client.get_system_shared_memory_status()) == []
        pending.get_result()
        np.testing.assert_array_equal(
            shm.get_contents_as_numpy(out_handle, np.int32, [1, 16]), INPUT0 + INPUT1)
        with pytest.raises(InferenceServerException, match="Unable to find shared memory"):
            client.infer("simple", inputs, outputs=outputs)
    finally:
        client.close()


def test_registration_errors(client: Client, regions: Regions) -> None:
    name, key, _ = regions.create(SIZE)
    client.register_system_shared_memory(name, key, SIZE)
    with pytest.raises(InferenceServerException, match=f"shared memory region '{name}' "
                                                       "already in manager"):
        client.register_system_shared_memory(name, key, SIZE)
    other, other_key, _ = regions.create(SIZE)
    for byte_size, offset in [(SIZE + 1, 0), (SIZE, 1), (1, SIZE), (0, SIZE + 1)]:
        with pytest.raises(InferenceServerException,
                           match=r"failed to register shared memory region.*invalid args"):
            client.register_system_shared_memory(other, other_key, byte_size, offset=offset)
    prefix = "triton_python_backend_shm_region_"
    for bad in (f"{prefix}_k", f"/{prefix}_k", f"///{prefix}_k"):
        with pytest.raises(InferenceServerException,
                           match=f"cannot register shared memory region 'x' with key '{bad}' as "
                                 f"the key contains the reserved prefix '{prefix}'"):
            client.register_system_shared_memory("x", bad, 10000)
    for bad in ("/", "///", "/../etc/passwd"):
        with pytest.raises(InferenceServerException,
                           match=f"cannot register shared memory region 'x' - invalid shm key "
                                 f"'{bad}'"):
            client.register_system_shared_memory("x", bad, 10000)
    assert names(client.get_system_shared_memory_status()) == [name]
    with pytest.raises(InferenceServerException,
                       match="Unable to find system shared memory region: 'x'"):
        client.get_system_shared_memory_status("x")
    client.unregister_system_shared_memory("never-registered")  # not an error, as in Triton


def test_registrations_are_bounded(client: Client, regions: Regions) -> None:
    for _ in range(MAX_REGIONS):
        name, key, _ = regions.create(8)
        client.register_system_shared_memory(name, key, 8)
    name, key, _ = regions.create(8)
    with pytest.raises(InferenceServerException, match="regions are registered already"):
        client.register_system_shared_memory(name, key, 8)
    assert len(names(client.get_system_shared_memory_status())) == MAX_REGIONS


def test_inference_errors(client: Client, protocol: str, regions: Regions) -> None:
    in_name = filled_input_region(client, regions)
    out_name, out_key, _ = regions.create(2 * SIZE)
    client.register_system_shared_memory(out_name, out_key, 2 * SIZE)

    def fails(match: str, **where: Any) -> None:
        inputs, outputs = tensors(protocol, where.pop("in_name", in_name),
                                  where.pop("out_name", out_name), **where)
        with pytest.raises(InferenceServerException, match=match):
            client.infer("simple", inputs, outputs=outputs)

    fails("Unable to find shared memory region: 'nope'", in_name="nope")
    fails("Unable to find shared memory region: 'nope'", out_name="nope")
    # HTTP: offsets that overflow a signed int64 (OUTPUT1's is 2**64 - 32, as in Triton's
    # test); gRPC's int64 cannot carry them
    fails("Invalid offset for shared memory region",
          output_offset=2**64 - 32 - SIZE if protocol == "http" else 2 * SIZE)
    fails("Invalid offset \\+ byte size for shared memory region", output_offset=1)
    fails("should be at least 64 bytes to hold the results", output_size=32)
    if protocol == "http":
        fails("Integer overflow detected: byte_size", output_offset=32,
              output_size=2**64 - 32)
    big, big_key, _ = regions.create(2 * SIZE)
    client.register_system_shared_memory(big, big_key, 2 * SIZE)
    inputs, outputs = tensors(protocol, in_name, out_name)
    inputs[1] = module(protocol).InferInput("INPUT1", [1, 16], "INT32")
    inputs[1].set_shared_memory(big, 2 * SIZE)
    mismatch = "input byte size mismatch for input 'INPUT1' for model 'simple'. Expected 64, got 128"
    with pytest.raises(InferenceServerException, match=re.escape(mismatch)):
        client.infer("simple", inputs, outputs=outputs)


def test_cuda_shared_memory_lists_nothing_and_only_a_register_is_refused(
        client: Client, protocol: str, regions: Regions) -> None:
    """Triton's shm client examples first unregister every CUDA region and read the CUDA
    status; a name answers as in Triton for a region it holds no CUDA registration of."""
    client.unregister_cuda_shared_memory()
    client.unregister_cuda_shared_memory("never-registered")  # not an error, as in Triton
    status = client.get_cuda_shared_memory_status()
    assert status == [] if protocol == "http" else not status.regions
    not_found = "404" if protocol == "http" else "StatusCode.NOT_FOUND"
    with pytest.raises(InferenceServerException,
                       match="Unable to find cuda shared memory region: 'x'") as missing:
        client.get_cuda_shared_memory_status("x")
    assert missing.value.status() == not_found
    name = filled_input_region(client, regions)
    with pytest.raises(InferenceServerException,
                       match=f"The region named '{name}' is registered as system shared "
                             "memory, not CUDA shared memory") as other_kind:
        client.get_cuda_shared_memory_status(name)
    assert other_kind.value.status() == not_found
    client.unregister_cuda_shared_memory(name)  # a system region is not a CUDA one: it stays
    assert names(client.get_system_shared_memory_status()) == [name]
    with pytest.raises(InferenceServerException,
                       match="CUDA shared memory is not supported") as refused:
        client.register_cuda_shared_memory("c", base64.b64encode(bytes(64)).decode(), 0, 64)
    assert refused.value.status() == ("501" if protocol == "http"
                                      else "StatusCode.UNIMPLEMENTED")


def test_server_metadata_lists_the_extension(client: Client, protocol: str) -> None:
    metadata = client.get_server_metadata()
    extensions = metadata["extensions"] if protocol == "http" else list(metadata.extensions)
    assert "system_shared_memory" in extensions
