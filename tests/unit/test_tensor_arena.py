"""The shared-memory arena for large inputs (batching/tensor_arena.py) and the API side
that decides when to use it (api/input_arena.py), on a temporary directory standing in
for /dev/shm."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from api.input_arena import InputArena
from batching.envelope import Request, Tensor
from batching.tensor_arena import PREFIX, Arena, ArenaReader, TensorGone, host_token, sweep

KIB = 1024


def test_a_tensor_put_in_the_arena_is_read_in_place_by_reference(tmp_path: Path) -> None:
    arena = Arena(64 * KIB, tmp_path)
    data = np.arange(1000, dtype=np.float32).tobytes()
    ref = arena.put(data)
    assert ref is not None
    view = ArenaReader(tmp_path).view(ref)
    assert bytes(view) == data


def test_a_freed_tensor_is_gone_for_a_late_reader(tmp_path: Path) -> None:
    arena = Arena(64 * KIB, tmp_path)
    ref = arena.put(b"x" * 100)
    assert ref is not None
    arena.free(ref)
    with pytest.raises(TensorGone, match="no longer holds"):
        ArenaReader(tmp_path).view(ref)


def test_space_is_reused_in_order_and_a_full_arena_refuses(tmp_path: Path) -> None:
    arena = Arena(4 * KIB, tmp_path)
    refs = [arena.put(b"a" * 1100) for _ in range(3)]  # with its header, 1,152 bytes each
    assert refs[0] is not None and refs[1] is not None and refs[2] is not None
    assert arena.put(b"b" * 1100) is None  # 3,456 used, 640 left
    arena.free(refs[1])  # freed out of order: waits for the oldest
    assert arena.put(b"b" * 1100) is None
    arena.free(refs[0])  # both given back: the ring wraps to the start
    wrapped = arena.put(b"c" * 2000)
    assert wrapped is not None and wrapped[1] == 0
    assert bytes(ArenaReader(tmp_path).view(wrapped)) == b"c" * 2000
    reader = ArenaReader(tmp_path)
    assert refs[2] is not None and bytes(reader.view(refs[2])) == b"a" * 1100  # untouched


def test_a_reference_this_host_cannot_read_is_refused(tmp_path: Path) -> None:
    reader = ArenaReader(tmp_path)
    with pytest.raises(TensorGone, match="another host"):
        reader.view(["4242-abcdef", 0, 10, 1])
    with pytest.raises(TensorGone, match="bad shared tensor arena name"):
        reader.view(["../../etc/passwd", 0, 10, 1])
    arena = Arena(4 * KIB, tmp_path)
    with pytest.raises(TensorGone, match="out of its arena's bounds"):
        reader.view([arena.name, 0, 8 * KIB, 1])


def test_the_arena_of_a_process_that_is_gone_is_swept(tmp_path: Path) -> None:
    code = ("import sys; from pathlib import Path; from batching.tensor_arena import Arena; "
            "a = Arena(4096, Path(sys.argv[1])); print(a.path)")
    dead = Path(subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True,
                               capture_output=True, text=True).stdout.strip())
    live = Arena(4 * KIB, tmp_path)
    for path in (dead, live.path):
        os.utime(path, (1, 1))  # old enough to be swept
    assert dead.exists() and sweep(tmp_path) == 1
    assert not dead.exists() and live.path.exists()
    fd = os.open(live.path, os.O_RDONLY)
    try:  # its owner still holds it
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
    live.close()
    assert not list(tmp_path.glob(f"{PREFIX}*"))


def test_processes_of_one_shared_memory_read_one_host_token(tmp_path: Path) -> None:
    token = host_token(tmp_path)
    code = "import sys; from pathlib import Path; from batching.tensor_arena import host_token; " \
           "print(host_token(Path(sys.argv[1])))"
    other = subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True,
                           capture_output=True, text=True).stdout.strip()
    assert token and other == token and token.endswith(f":{os.getuid()}")
    elsewhere = tmp_path / "other"
    elsewhere.mkdir()
    assert host_token(elsewhere) != token
    assert host_token(tmp_path / "missing") is None


def _inputs(*sizes: int) -> list[Tensor]:
    return [Tensor.from_array(f"in{i}", np.full(n, i + 1, np.uint8)) for i, n in enumerate(sizes)]


def test_the_api_puts_large_inputs_in_the_arena_only_for_a_model_on_its_memory(
        tmp_path: Path) -> None:
    sharing = {"near": True, "far": False}
    arena = InputArena(64 * KIB, 1000, lambda model, token: sharing[model], tmp_path)
    inputs = _inputs(2000, 10)
    refs = arena.place("near", inputs)
    assert refs is not None and len(refs) == 1
    assert inputs[0].ref == refs[0] and inputs[0].raw == b"" and inputs[1].ref is None
    decoded = Request.decode(Request("r", "q", 0, 0.0, 1, inputs).encode())  # as it travels
    assert decoded.inputs[0].ref == refs[0] and len(decoded.inputs[1].raw) == 10
    assert bytes(ArenaReader(tmp_path).view(refs[0])) == b"\x01" * 2000
    far = _inputs(2000)
    assert arena.place("far", far) is None and len(far[0].raw) == 2000
    assert arena.place("near", _inputs(999)) is None  # below the smallest size
    arena.free(refs)
    with pytest.raises(TensorGone):
        ArenaReader(tmp_path).view(refs[0])


def test_a_full_arena_sends_the_rest_through_redis(tmp_path: Path) -> None:
    arena = InputArena(8 * KIB, 1000, lambda model, token: True, tmp_path)
    inputs = _inputs(5000, 5000)
    refs = arena.place("m", inputs)
    assert refs is not None and len(refs) == 1
    assert inputs[1].ref is None and len(inputs[1].raw) == 5000


def test_no_arena_when_it_is_off_or_cannot_be_made(tmp_path: Path) -> None:
    off = InputArena(0, 1000, lambda model, token: True, tmp_path)
    assert off.place("m", _inputs(5000)) is None
    missing = InputArena(64 * KIB, 1000, lambda model, token: True, tmp_path / "missing")
    assert missing.place("m", _inputs(5000)) is None
    assert not list(tmp_path.glob(f"{PREFIX}*"))
