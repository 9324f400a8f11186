"""One request pipeline for every protocol: validate, enqueue, await the reply, count it."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from api.body import BodyLimits
from api.dispatch import Admission
from api.dispatch_port import DispatchPort
from api.ensemble import Ensembles
from api.health import WorkerWatch
from api.input_arena import InputArena
from api.kserve import InferRequest, Vet
from api.metrics import ApiMetrics
from api.outside_path import OutsidePath
from api.overload import Overload
from api.shared_memory import Binding, SharedMemory, not_found
from batching.config import ModelConfig
from batching.envelope import PATH, VERSION, WHOLE, Reply, Request
from batching.errors import (
    ConveyorError,
    DeadlineExceeded,
    InvalidInput,
    Unavailable,
    from_code,
)
from batching.keys import Keys
from batching.names import (
    no_available_versions,
    requested_version,
    unknown_model,
    unknown_version,
)
from batching.partitions import Spread
from batching.tensor_arena import Ref

log = logging.getLogger(__name__)

UNKNOWN_MODEL = "_unknown"
"""Model label for requests naming no known model (keeps label cardinality bounded)."""


@dataclass(slots=True)
class InferenceService:
    models: dict[str, ModelConfig]
    dispatcher: DispatchPort
    watch: WorkerWatch
    keys: Keys
    metrics: ApiMetrics
    bodies: BodyLimits
    """Request body limits, and the places for large bodies this process shares out."""
    unloaded: set[str] = field(default_factory=set)
    """Models unloaded through the repository API (kept in step by api.repository_control)."""
    broken: dict[str, str] = field(default_factory=dict)
    """Model folders whose configuration failed, with the reason (api.repository_control too)."""
    shm: SharedMemory | None = None
    """System shared memory regions; None: a tensor that names one finds none."""
    overload: Overload = field(default_factory=Overload)
    """Refuses at once what this process can no longer answer in time (api/overload.py)."""
    outside: OutsidePath = field(default_factory=OutsidePath)
    """What its requests spend outside the inference process, which they carry to it."""
    arena: InputArena | None = None
    """Large inputs through shared memory, to inference processes of this host."""
    spread: Spread = field(default_factory=Spread)
    """Which partition of its model each request enters (``queue.partitions``)."""
    ensembles: Ensembles = field(default_factory=Ensembles)
    """Triton ensembles, served over the models here (api/ensemble.py)."""

    def model(self, name: str, version: str = "") -> ModelConfig:
        """The loaded model ``name``, when it serves ``version`` ("": its newest)."""
        return self._resolve(name, version)[0]

    def _resolve(self, name: str, version: str) -> tuple[ModelConfig, str]:
        """:meth:`model`, and the version that answers ("007" asks for version 7)."""
        config = self.models.get(name)  # the registry holds valid names only (api.repository_control)
        if config is None and name in self.ensembles.plans:
            config = self.ensembles.plans[name].config
        if config is None:
            if name in self.unloaded:
                raise no_available_versions(name, "unloaded")
            if name in self.broken:
                raise no_available_versions(name, f"unavailable: {self.broken[name]}")
            raise unknown_model(name)
        number = requested_version(version)
        if number is None:
            return config, config.served_versions[-1]
        if str(number) not in config.served_versions:
            raise unknown_version(name, number)
        return config, str(number)

    async def infer(self, model: str,
                    parse: Callable[[ModelConfig, Vet], Awaitable[InferRequest]],
                    started: float, protocol: str, version: str = "",
                    quiet_since: float | None = None) -> tuple[InferRequest, Reply]:
        """Parse, validate and run one request through Redis and a worker.

        ``started``: the ``time.perf_counter()`` at which the request was read, where its
        timeout starts (its first bytes' read, when the listener says: api/http_guard.py).
        ``parse`` runs only once the model is known, so an unknown model is answered
        before a body is read. It calls the :data:`Vet` it is given with the request's
        parameters before it decodes the tensors, when it can: an overloaded process then
        refuses the request before that (else it is checked once parsed). ``quiet_since``:
        the ``time.perf_counter()`` at which the request's connection last had nothing in
        hand, when the listener knows: its bytes came after, which bounds how long they
        waited unread (api/overload.py).

        Raises the mapped :class:`ConveyorError` on any failure, after counting it.
        """
        if model in self.ensembles.plans:  # its steps are requests of this method
            return await self.ensembles.infer(self, model, parse, started, protocol, version)
        self.metrics.protocol(protocol).inc()
        try:
            config, version = self._resolve(model, version)
        except ConveyorError as exc:
            self._count(UNKNOWN_MODEL, exc.code, started)
            raise
        regions: Binding | None = None
        placed: list[Ref] | None = None
        in_flight = self.metrics.of(model).in_flight
        in_flight.inc()
        unread = None if quiet_since is None else max(0.0, started - quiet_since)
        vetted: float | None = None  # the request's timeout (ms), once vet has checked it

        def vet(parameters: dict[str, Any]) -> None:
            nonlocal vetted
            vetted = timeout_ms_of(parameters, config)
            self.overload.check(model, vetted / 1000.0, unread)

        self.overload.learn(model, config)  # for the listener's refusals (api/http_guard.py)
        try:
            # A request's own timeout can only shorten its model's default: when even that
            # would be answered late, the request is refused before its body is read.
            self.overload.check(model, config.queue.default_timeout_ms / 1000.0, unread,
                                final=False)
            parsed = await parse(config, vet)
            parsed.version = version
            timeout_ms = vetted
            if timeout_ms is None:
                timeout_ms = timeout_ms_of(parsed.parameters, config)
                self.overload.check(model, timeout_ms / 1000.0, unread)
            if not self.watch.model_served(model):
                raise Unavailable(f"model {model!r} has no worker")
            priority = requested_priority(parsed, config.queue.priority_levels,
                                          config.queue.default_priority, "the model's default")
            if parsed.shm_inputs or parsed.shm_outputs:  # one test on the hot path
                regions = await self._bind(parsed, model)
            now_ms = time.time() * 1000.0  # to the µs: queue times are a fraction of a ms
            # The timeout counts from when the request was read (``started``), as Triton's.
            left_ms = timeout_ms - (time.perf_counter() - started) * 1000.0
            if left_ms <= 0.0:
                raise DeadlineExceeded(f"the request's deadline passed before it could be "
                                       f"queued (its timeout: {timeout_ms:g} ms)")
            request = Request(
                id=self.dispatcher.new_id(),
                reply=self.dispatcher.reply_key,
                deadline_ms=int(now_ms + left_ms),
                enq_ms=now_ms,
                prio=priority,
                inputs=parsed.inputs,
                outputs=parsed.outputs,
                params=_params(parsed, config),
            )
            if self.arena is not None:
                placed = self.arena.place(model, request.inputs)
            reserve = self.outside.reserve_us(model)
            if reserve is not None:
                request.params[PATH] = reserve
            part = self.spread.pick(model, config.queue.partitions)
            admission = Admission(self.keys.queue(model, priority, part),
                                  self.keys.rows_waiting(model, part), parsed.rows,
                                  config.queue.partition_rows, model, part)
            reply = await self.dispatcher.submit(admission, request, left_ms / 1000.0)
            if not reply.ok:
                raise from_code(reply.error_code, reply.error)
            if regions is not None:
                await regions.write(reply.outputs)
        except ConveyorError as exc:
            self._count(model, exc.code, started)
            raise
        except Exception as exc:  # a bug, not the client's doing: still answer 500 / INTERNAL
            log.exception("request for model %s failed", model)
            self._count(model, ConveyorError.code, started)
            raise ConveyorError(f"internal error: {type(exc).__name__}: {exc}") from exc
        finally:
            in_flight.dec()
            if regions is not None:
                regions.close()
            if placed is not None and self.arena is not None:
                self.arena.free(placed)
        took = self._count(model, "success", started)
        self.overload.answered(model, took)
        self.outside.observe(model, took, (reply.queue_ms + reply.exec_ms) / 1000.0)
        series = self.metrics.of(model)
        series.queue.observe(reply.queue_ms / 1000.0)
        series.batch_size.observe(reply.batch_rows)
        return parsed, reply

    def model_ready(self, name: str) -> bool:
        """A model has a ready worker; an ensemble, every one of its step models."""
        if name in self.ensembles.plans:
            return self.ensembles.ready(name, self.watch.model_ready)
        return self.watch.model_ready(name)

    async def _bind(self, parsed: InferRequest, model: str) -> Binding | None:
        """Read the inputs given by shared memory region, hold the output regions."""
        if self.shm is None:
            raise not_found([*parsed.shm_inputs.values(), *parsed.shm_outputs.values()][0].region)
        return await self.shm.bind(parsed, model)

    def _count(self, model: str, outcome: str, started: float) -> float:
        """Count the answer and its duration; returns the duration (seconds)."""
        requests, duration = self.metrics.of(model).outcome(outcome)
        requests.inc()
        took = time.perf_counter() - started
        duration.observe(took)
        return took


def timeout_ms_of(parameters: dict[str, Any], config: ModelConfig) -> float:
    """The request's timeout: ``parameters.timeout`` (µs; 0 or absent: none of its own),
    never longer than the model's ``default_timeout_ms``."""
    timeout_ms = float(config.queue.default_timeout_ms)
    asked = parameters.get("timeout")
    if asked is not None:
        if isinstance(asked, bool) or not isinstance(asked, int | float) or asked < 0:
            raise InvalidInput("parameters.timeout must be a non-negative number of µs")
        if asked > 0:
            timeout_ms = min(timeout_ms, asked / 1000.0)
    return timeout_ms


def requested_priority(parsed: InferRequest, levels: int, default: int, default_name: str) -> int:
    """``parameters.priority``: 1 (highest) .. ``levels``; 0 or absent: ``default``
    (``default_name`` says which, in the error)."""
    raw = parsed.parameters.get("priority", 0)
    if not isinstance(raw, int) or isinstance(raw, bool) or not 0 <= raw <= levels:
        raise InvalidInput(f"parameters.priority must be an integer in 0..{levels} "
                           f"(0 = {default_name}), got {raw!r}")
    return raw or default


def _params(parsed: InferRequest, config: ModelConfig) -> dict[str, Any]:
    """What travels with the request to the worker: its cost, its model version (a model
    with version folders), and whether it is one whole unit (no batch dim)."""
    params: dict[str, Any] = _cost(parsed)
    if config.versions:
        params[VERSION] = parsed.version
    if not config.batched:
        params[WHOLE] = 1
    return params


def _cost(parsed: InferRequest) -> dict[str, Any]:
    """``parameters.cost`` (tokens, pixels...) travels to the batch former's cost bound."""
    cost = parsed.parameters.get("cost")
    if cost is None:
        return {}
    if isinstance(cost, bool) or not isinstance(cost, int | float) or cost <= 0:
        raise InvalidInput(f"parameters.cost must be a positive number, got {cost!r}")
    return {"cost": float(cost)}
