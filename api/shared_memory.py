"""Triton's system shared memory extension: the registry of regions, and tensors by region.

Registrations live in one Redis hash per host (``Keys.shm_regions``, keyed by
:func:`api.shm_region.host_scope`): field = region name, value = its key, offset, byte
size and a token unique to the registration. Every API process of the host (``uvicorn
--workers N``) therefore sees a region registered through any of them, and no process of
another host does. Each process opens a region's object itself, the first time it uses
it, and keeps the descriptor while the registration (same token) stands; an unregistered
or replaced region is dropped at its next use or within one sweep interval, and closed
once no request holds it.

Registration is off unless ``allow_client_shm`` (Triton's ``--allow-client-shm``); the
status then lists nothing and a tensor naming a region finds none. Registrations are
bounded by ``shm_max_regions`` and the input bytes one request reads from regions by
``max_request_bytes``, as a body would be.

Inputs are read when the request is bound (:meth:`SharedMemory.bind`), before it is
queued; outputs are written when the reply comes (:meth:`Binding.write`). The binding
holds its output regions open until it is closed, so a region unregistered meanwhile
still receives that request's outputs (as in Triton) and is closed after.

CUDA shared memory cannot be registered; its status (:meth:`SharedMemory.cuda_status`)
lists nothing and its unregister has nothing to do.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import orjson

from api.binary import tensor_from_buffer
from api.periodic import Periodic
from api.shm_params import ShmRef
from api.shm_region import Region, Registration, check_region_name, host_scope
from batching.envelope import Tensor
from batching.errors import (
    AlreadyExists,
    InvalidInput,
    PayloadTooLarge,
    RegionNotFound,
    TooManyRegions,
    Unavailable,
    Unsupported,
)
from batching.keys import Keys
from batching.redis_errors import REDIS_FAILED

if TYPE_CHECKING:
    import redis.asyncio as aioredis

    from api.dispatch_port import DispatchPort
    from api.kserve import InferRequest

CUDA_UNSUPPORTED = ("CUDA shared memory is not supported by conveyor: use system shared "
                    "memory (/v2/systemsharedmemory)")
"""The answer to a CUDA register; its status lists nothing and its unregister does nothing."""
DISABLED = ("Client shared memory is disabled. Start the server with "
            "CONVEYOR_ALLOW_CLIENT_SHM=true to enable.")
THREAD_BYTES = 1024 * 1024
"""Reads and writes of at least this many bytes run off the event loop."""


def _text(value: bytes | str) -> str:
    return value if isinstance(value, str) else value.decode()


def not_found(name: str) -> RegionNotFound:
    return RegionNotFound(f"Unable to find shared memory region: '{name}'")


class SharedMemory:
    def __init__(self, dispatcher: DispatchPort, keys: Keys, *, enabled: bool, max_regions: int,
                 max_bytes: int, interval_s: float, host: str | None = None) -> None:
        self.enabled = enabled
        self._dispatcher = dispatcher
        self._hash = keys.shm_regions(host or host_scope())
        self._max_regions = max_regions
        self._max_bytes = max_bytes
        self._local: dict[str, Region] = {}
        """The regions this process has open, by name."""
        self._loop = Periodic("conveyor-shm-sweep", interval_s, self.sweep)

    @property
    def _redis(self) -> aioredis.Redis:
        return self._dispatcher.redis

    async def start(self) -> None:
        self._loop.start()

    async def close(self) -> None:
        await self._loop.close()
        self._drop(list(self._local))

    async def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        """Raises :class:`AlreadyExists`, :class:`TooManyRegions` or :class:`InvalidInput`
        (a bad key, an object that cannot be opened, a span past its end)."""
        self._require_enabled()
        check_region_name(name)
        registration = Registration(key, offset, byte_size, uuid.uuid4().hex)
        region = Region(name, registration)
        value = orjson.dumps({"key": key, "offset": offset, "byte_size": byte_size,
                              "token": registration.token})
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.hsetnx(self._hash, name, value)
                pipe.hlen(self._hash)
                added, count = await pipe.execute()
            if added and count > self._max_regions:
                await self._redis.hdel(self._hash, name)
        except REDIS_FAILED as exc:
            region.retire()
            raise Unavailable(f"Redis is unreachable: {exc}") from None
        if not added:
            region.retire()
            raise AlreadyExists(f"shared memory region '{name}' already in manager")
        if count > self._max_regions:
            region.retire()
            raise TooManyRegions(f"failed to register shared memory region '{name}': "
                                 f"{self._max_regions} regions are registered already, the "
                                 "most this server takes (CONVEYOR_SHM_MAX_REGIONS)")
        self._replace(name, region)

    async def unregister(self, name: str) -> None:
        """Unregister ``name``, or every region when ``name`` is empty; an unknown name
        is not an error (as in Triton)."""
        self._require_enabled()
        try:
            if name:
                await self._redis.hdel(self._hash, name)
            else:
                await self._redis.delete(self._hash)
        except REDIS_FAILED as exc:
            raise Unavailable(f"Redis is unreachable: {exc}") from None
        self._drop([name] if name else list(self._local))

    async def status(self, name: str) -> list[dict[str, Any]]:
        """Triton's status list: ``name``'s region, or every region when empty."""
        found = await self._registrations([name] if name else None) if self.enabled else {}
        if name and name not in found:
            raise RegionNotFound(f"Unable to find system shared memory region: '{name}'")
        return [{"name": n, "key": r.key, "offset": r.offset, "byte_size": r.byte_size}
                for n, r in sorted(found.items())]

    async def cuda_status(self, name: str) -> list[dict[str, Any]]:
        """Triton's CUDA status list: no region ever, as none can be registered; a named
        one is not found, with Triton's words for a system region of that name."""
        if not name:
            return []
        if self.enabled and await self._registrations([name]):
            raise RegionNotFound(f"The region named '{name}' is registered as system shared "
                                 "memory, not CUDA shared memory")
        raise RegionNotFound(f"Unable to find cuda shared memory region: '{name}'")

    async def bind(self, request: InferRequest, model: str) -> Binding | None:
        """Read the request's inputs from their regions and hold its output regions; None
        when the request names no region (``model`` names the model in the messages)."""
        if not request.shm_inputs and not request.shm_outputs:
            return None
        refs = [*request.shm_inputs.values(), *request.shm_outputs.values()]
        regions = await self._regions({ref.region for ref in refs})
        for ref in refs:
            regions[ref.region].check(ref)
        total = sum(ref.byte_size for ref in request.shm_inputs.values())
        if total > self._max_bytes:
            raise PayloadTooLarge(f"the inputs read from shared memory hold {total} bytes, "
                                  f"more than the {self._max_bytes} a request may carry")
        for index, ref in request.shm_inputs.items():
            region = regions[ref.region]
            data = (await asyncio.to_thread(region.read, ref) if ref.byte_size >= THREAD_BYTES
                    else region.read(ref))
            spec = request.inputs[index]
            request.inputs[index] = tensor_from_buffer(spec.name, spec.datatype, spec.shape, data,
                                                       model)
        return Binding({name: (regions[ref.region], ref)
                        for name, ref in request.shm_outputs.items()})

    async def sweep(self) -> None:
        """Close the regions unregistered or replaced through other API processes."""
        if self._local:
            current = await self._registrations(None)
            self._drop([name for name, region in self._local.items()
                        if current.get(name) != region.registration])

    async def _regions(self, names: Iterable[str]) -> dict[str, Region]:
        """The open regions of ``names``, each opened here first if need be."""
        wanted = sorted(names)
        current = await self._registrations(wanted) if self.enabled else {}
        found: dict[str, Region] = {}
        for name in wanted:
            registration = current.get(name)
            if registration is None:
                self._drop([name])
                raise not_found(name)
            region = self._local.get(name)
            if region is None or region.registration != registration:
                region = Region(name, registration)
                self._replace(name, region)
            found[name] = region
        return found

    async def _registrations(self, names: list[str] | None) -> dict[str, Registration]:
        """The recorded registrations of ``names`` (None: all), by name."""
        raw: dict[str, bytes | str | None]
        try:
            if names is None:
                raw = {_text(field): value
                       for field, value in (await self._redis.hgetall(self._hash)).items()}
            else:
                values: list[bytes | str | None] = await self._redis.hmget(self._hash, names)
                raw = dict(zip(names, values, strict=True))
        except REDIS_FAILED as exc:
            raise Unavailable(f"Redis is unreachable: {exc}") from None
        found = {}
        for name, value in raw.items():
            if value is not None:
                doc = orjson.loads(value)
                found[name] = Registration(doc["key"], doc["offset"], doc["byte_size"],
                                           doc["token"])
        return found

    def _require_enabled(self) -> None:
        if not self.enabled:
            raise Unsupported(DISABLED)

    def _replace(self, name: str, region: Region) -> None:
        old = self._local.pop(name, None)
        if old is not None and old is not region:
            old.retire()
        self._local[name] = region

    def _drop(self, names: Iterable[str]) -> None:
        for name in names:
            region = self._local.pop(name, None)
            if region is not None:
                region.retire()


class Binding:
    """A request's output regions, held open from its binding until :meth:`close`."""

    def __init__(self, outputs: dict[str, tuple[Region, ShmRef]]) -> None:
        self._outputs = outputs
        self._held: list[Region] = []
        try:
            for region in {id(r): r for r, _ in outputs.values()}.values():
                region.hold()
                self._held.append(region)
        except RegionNotFound:
            self.close()
            raise

    def close(self) -> None:
        """Let the regions go (one unregistered meanwhile is closed now)."""
        held, self._held = self._held, []
        for region in held:
            region.release()

    async def write(self, outputs: list[Tensor]) -> None:
        """Write each output the request asked for by region into its region."""
        for tensor in outputs:
            target = self._outputs.get(tensor.name)
            if target is None:
                continue
            region, ref = target
            if len(tensor.raw) > ref.byte_size:
                raise InvalidInput(
                    f"shared memory size specified with the request for output "
                    f"'{tensor.name}' ({ref.byte_size} bytes) should be at least "
                    f"{len(tensor.raw)} bytes to hold the results")
            if len(tensor.raw) >= THREAD_BYTES:
                await asyncio.to_thread(region.write, ref, tensor.raw)
            else:
                region.write(ref, tensor.raw)
