"""The shared memory registry (api.shared_memory) as several API processes of one host use
it: two registries over one Redis stand for two processes. Also what a region does when
it is unregistered or its object shrinks while a request uses it."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from api.kserve import InferRequest
from api.shared_memory import SharedMemory
from api.shm_params import ShmRef
from api.shm_region import Region, Registration, host_scope
from batching.envelope import Tensor
from batching.errors import InvalidInput, RegionNotFound
from batching.keys import Keys
from tests.unit.memory_dispatch import MemoryDispatcher
from tests.unit.shm_objects import Objects, made_objects


@pytest.fixture
def objects() -> Iterator[Objects]:
    yield from made_objects()


KEYS = Keys("unit")


def registry(dispatcher: MemoryDispatcher, host: str = "h") -> SharedMemory:
    return SharedMemory(dispatcher, KEYS, enabled=True, max_regions=8, max_bytes=1024,
                        interval_s=60, host=host)


def request(x_region: str, y_region: str) -> InferRequest:
    """echo's shapes: x FP32 [1, 4] from ``x_region``, y into ``y_region``."""
    return InferRequest(id=None, inputs=[Tensor("x", "FP32", (1, 4), b"")], rows=1,
                        outputs=["y"], shm_inputs={0: ShmRef(x_region, 16)},
                        shm_outputs={"y": ShmRef(y_region, 16)})


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_a_region_registered_through_one_process_serves_in_another(objects: Objects) -> None:
    x = np.arange(4, dtype=np.float32)
    in_key, out_key, other_key = (objects.make(16, x.tobytes()), objects.make(16),
                                  objects.make(16, (x + 10).tobytes()))

    async def run() -> None:
        dispatcher = MemoryDispatcher(KEYS)
        first, second = registry(dispatcher), registry(dispatcher)
        await first.register("in", in_key, 0, 16)
        await first.register("out", out_key, 0, 16)
        assert await second.status("") == await first.status("")
        parsed = request("in", "out")
        binding = await second.bind(parsed, "m")
        assert binding is not None
        np.testing.assert_array_equal(parsed.inputs[0].array(), x.reshape(1, 4))
        await binding.write([Tensor.from_array("y", x.reshape(1, 4) * 3)])
        binding.close()
        np.testing.assert_array_equal(
            np.frombuffer(objects.path(out_key).read_bytes(), np.float32), x * 3)
        # registered again under the same name with another object: the second process
        # follows at its next use
        await first.unregister("in")
        await first.register("in", other_key, 0, 16)
        again = request("in", "out")
        bound = await second.bind(again, "m")
        assert bound is not None
        bound.close()
        np.testing.assert_array_equal(again.inputs[0].array(), (x + 10).reshape(1, 4))
        await first.unregister("")
        with pytest.raises(RegionNotFound, match="Unable to find shared memory region: 'in'"):
            await second.bind(request("in", "out"), "m")
        await first.close()
        await second.close()
        await dispatcher.close()

    asyncio.run(run())


def test_the_sweep_closes_what_other_processes_unregistered(objects: Objects) -> None:
    key = objects.make(16)

    async def run() -> None:
        dispatcher = MemoryDispatcher(KEYS)
        first, second = registry(dispatcher), registry(dispatcher)
        before = open_fds()
        await first.register("in", key, 0, 16)
        binding = await second.bind(request("in", "in"), "m")  # opens it in the second process too
        assert binding is not None
        binding.close()
        assert len(open_fds() - before) == 2
        await first.unregister("in")
        assert len(open_fds() - before) == 1
        await second.sweep()
        assert open_fds() == before
        await first.close()
        await second.close()
        await dispatcher.close()

    asyncio.run(run())


def test_hosts_do_not_see_each_others_regions(objects: Objects) -> None:
    async def run() -> None:
        dispatcher = MemoryDispatcher(KEYS)
        here, there = registry(dispatcher, "a"), registry(dispatcher, "b")
        await here.register("in", objects.make(16), 0, 16)
        assert await there.status("") == []
        await here.close()
        await there.close()
        await dispatcher.close()

    asyncio.run(run())
    assert host_scope() == host_scope() and ":" in host_scope()


def test_unregistered_while_in_use_closes_after_the_last_user(objects: Objects) -> None:
    key = objects.make(16)
    before = open_fds()
    region = Region("r", Registration(key, 0, 16, "t"))
    with region._using():
        region.retire()
        assert len(open_fds() - before) == 1  # still open for the running read
    assert open_fds() == before
    with pytest.raises(RegionNotFound, match="Unable to find shared memory region: 'r'"):
        region.read(ShmRef("r", 16))
    with pytest.raises(RegionNotFound):
        region.write(ShmRef("r", 16), b"x" * 16)
    region.retire()  # twice is harmless


def test_a_request_in_flight_writes_into_a_region_unregistered_meanwhile(
        objects: Objects) -> None:
    in_key, out_key = objects.make(16), objects.make(16)

    async def run() -> None:
        dispatcher = MemoryDispatcher(KEYS)
        shm = registry(dispatcher)
        before = open_fds()
        await shm.register("in", in_key, 0, 16)
        await shm.register("out", out_key, 0, 16)
        binding = await shm.bind(request("in", "out"), "m")
        assert binding is not None
        await shm.unregister("")  # while the request is queued
        assert len(open_fds() - before) == 1  # "out" stays open for it; "in" is closed
        await binding.write([Tensor("y", "FP32", (1, 4), b"\x01" * 16)])
        binding.close()
        assert open_fds() == before
        assert objects.path(out_key).read_bytes() == b"\x01" * 16
        with pytest.raises(RegionNotFound):
            await shm.bind(request("in", "out"), "m")
        await shm.close()
        await dispatcher.close()

    asyncio.run(run())


def test_an_object_that_shrank_fails_the_request_not_the_process(objects: Objects) -> None:
    key = objects.make(64, b"a" * 64)
    region = Region("r", Registration(key, 0, 64, "t"))
    os.truncate(objects.path(key), 8)
    with pytest.raises(InvalidInput, match="fewer bytes than it was registered with"):
        region.read(ShmRef("r", 32))
    with pytest.raises(InvalidInput, match="fewer bytes than it was registered with"):
        region.write(ShmRef("r", 32), b"b" * 32)
    region.retire()


def test_a_read_only_object_serves_inputs_only(objects: Objects,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    key = objects.make(16, b"r" * 16)
    objects.path(key).chmod(0o400)
    real_open = os.open

    def open_as_owner(path: Path, flags: int, *args: int) -> int:
        """What a non-root owner of a 0400 object gets (the tests may run as root)."""
        if flags & os.O_RDWR:
            raise PermissionError(13, "Permission denied")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", open_as_owner)
    region = Region("r", Registration(key, 0, 16, "t"))
    monkeypatch.undo()
    assert region.read(ShmRef("r", 4)) == b"rrrr"
    with pytest.raises(InvalidInput, match="read-only"):
        region.write(ShmRef("r", 4), b"wwww")
    region.retire()


def test_inputs_read_from_regions_are_bounded(objects: Objects) -> None:
    async def run() -> None:
        dispatcher = MemoryDispatcher(KEYS)
        small = SharedMemory(dispatcher, KEYS, enabled=True, max_regions=8, max_bytes=8,
                             interval_s=60, host="h")
        await small.register("in", objects.make(16), 0, 16)
        with pytest.raises(Exception, match="more than the 8 a request may carry"):
            await small.bind(request("in", "in"), "m")
        await small.close()
        await dispatcher.close()

    asyncio.run(run())
