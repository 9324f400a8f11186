"""Large outputs uploaded to the API process (``CONVEYOR_TENSOR_TRANSPORT=fetch`` on one
host, against a real redis-server, an API process and a Celery worker) in every form a
client takes them: FP16, BYTES and UINT8 outputs beside a small one, all or a subset, as
binary or as JSON over HTTP and as ``raw_output_contents`` over gRPC, each byte-exact and
its own request's; and the outputs did not come back through Redis."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.conftest import MakeStack
from tests.image_stack import ROW, add_model, image_config, image_model
from tests.procs import free_port

pytestmark = pytest.mark.integration

MODEL = image_model('{"copy": x.copy(), "half": x.view(np.float16).copy(), '
                    '"words": np.array([[row.tobytes()] for row in x], dtype=object), '
                    '"total": x.sum(axis=1, dtype=np.int64).reshape(-1, 1)}')
CONFIG = image_config({"copy": ("UINT8", ROW), "half": ("FP16", ROW // 2),
                       "words": ("BYTES", 1), "total": ("INT64", 1)})


def _expected(image: np.ndarray) -> dict[str, bytes]:
    return {"copy": image.tobytes(), "half": image.tobytes(), "words": image.tobytes(),
            "total": image.sum(axis=1, dtype=np.int64).tobytes()}


def _got(name: str, array: np.ndarray | None) -> bytes:
    assert array is not None, name
    if name == "words":
        return b"".join(bytes(v) for v in array.reshape(-1))
    return array.tobytes()


def test_every_output_form_is_byte_exact_by_reference(make_stack: MakeStack,
                                                       tmp_path: Path) -> None:
    grpc_port = free_port()
    stack = make_stack(add_model(tmp_path / "repo", "forms", MODEL, CONFIG),
                       CONVEYOR_TENSOR_TRANSPORT="fetch", CONVEYOR_TENSOR_ARENA_MB="0",
                       CONVEYOR_GRPC_PORT=str(grpc_port))
    url = stack.add_api()
    stack.add_worker()
    stack.wait_ready()
    r = stack.redis()
    rng = np.random.default_rng(21)
    images = [rng.integers(0, 256, (rows, ROW), dtype=np.uint8) for rows in (1, 2, 1)]
    http = httpclient.InferenceServerClient(url.removeprefix("http://"), network_timeout=60)
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    sent = 0
    before = int(r.info("stats")["total_net_input_bytes"])
    for image in images:
        want = _expected(image)
        given = httpclient.InferInput("image", list(image.shape), "UINT8")
        given.set_data_from_numpy(image, binary_data=True)
        for names, binary in ((list(want), True), (["half"], True), (["copy", "total"], False)):
            result = http.infer("forms", [given], outputs=[
                httpclient.InferRequestedOutput(n, binary_data=binary) for n in names])
            assert {o["name"] for o in result.get_response()["outputs"]} == set(names)
            for name in names:
                assert _got(name, result.as_numpy(name)) == want[name], (names, name, binary)
            sent += sum(len(want[n]) for n in names)
        grpc_input = grpcclient.InferInput("image", list(image.shape), "UINT8")
        grpc_input.set_data_from_numpy(image)
        for names in (list(want), ["words", "total"]):
            got = grpc.infer("forms", [grpc_input], outputs=[
                grpcclient.InferRequestedOutput(n) for n in names])
            for name in names:
                assert _got(name, got.as_numpy(name)) == want[name], (names, name)
            sent += sum(len(want[n]) for n in names)
    read = int(r.info("stats")["total_net_input_bytes"]) - before
    http.close()
    grpc.close()
    assert read < sent / 4, f"Redis read {read:,} bytes for {sent:,} of outputs"
