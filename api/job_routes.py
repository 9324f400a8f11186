"""Async jobs over HTTP: ``/v1/jobs`` (see docs/jobs.md).

``POST /v1/jobs`` validates the inputs against the model's signature like an infer
request (any number of rows, up to ``job_max_bytes`` of body), stores the job in Redis
and sends its Celery task to ``cv.jobs``; ``GET`` reads the job's record or result;
``DELETE`` cancels it; ``GET /v1/jobs`` lists the most recent ones. The job's chunks
then travel the same streams as interactive requests, at the job's priority (by default
the model's lowest); a job on an ensemble, each step model's streams in turn.

With API keys, a job belongs to the key that submitted it (the job stores the key's
digest): another key, unless it is an admin key, gets a 404 for it, as for a job that
does not exist, and does not see it listed.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, cast

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from api.auth import PRINCIPAL, Principal
from api.body import LargeBody, content_length, read_body
from api.kserve import InferRequest, json_object, parse_document, render
from api.service import InferenceService, requested_priority
from batching.callbacks import AllowList, check_callback
from batching.envelope import Reply, Tensor
from batching.errors import ConveyorError, InvalidInput, ModelNotFound, Unavailable
from batching.job_record import (
    FINISHED,
    TRANSITION_LUA,
    UNFINISHED,
    WAKE,
    JobRecord,
    JobState,
    count_move,
    join_chunks,
    pack_tensors,
    unpack_tensors,
)
from batching.redis_errors import REDIS_FAILED
from batching.repository_scan import as_text
from batching.settings import Settings
from conveyor.celery_client import celery_app, send_job

log = logging.getLogger(__name__)

JOB_ID = re.compile(r"^[0-9a-f]{32}$")
MAX_JOB_ROWS = 2**31
"""Rows are bounded by the body size (``job_max_bytes``), not by the model's batch size."""
HEADER_LENGTH = "inference-header-content-length"
BINARY_TYPE = "application/octet-stream"
LISTED = 1000
"""Most recent jobs each listing keeps (per owner, and of every job for admin keys)."""
PAGE = 100
"""Jobs ``GET /v1/jobs`` answers by default (``limit``, at most :data:`LISTED`)."""


def jobs_router(service: InferenceService, settings: Settings) -> APIRouter:
    """The ``/v1/jobs`` routes, over the API's Redis connection and models."""
    router = APIRouter(prefix="/v1/jobs", tags=["jobs"])
    keys = service.keys
    transition = service.dispatcher.redis.register_script(TRANSITION_LUA)
    callback_hosts = AllowList.parse(settings.callback_hosts)
    tasks = celery_app(settings)

    def record_key(job_id: str) -> str:
        if not JOB_ID.match(job_id):
            raise ModelNotFound(f"unknown job {job_id!r}")
        return keys.job(job_id)

    async def load(job_id: str, request: Request) -> JobRecord:
        """The job, if the caller may see it: another owner's job is as unknown as none."""
        with _redis_guard():
            raw = await service.dispatcher.redis.hgetall(record_key(job_id))
        record = JobRecord.from_hash(job_id, raw) if raw else None
        if record is None or not _sees(_principal(request), record):
            raise ModelNotFound(f"unknown job {job_id!r} (or its result expired)")
        return record

    @router.post("", status_code=202)
    async def submit(request: Request) -> Response:
        async with service.bodies.claim() as claim:  # a large body holds a place until parsed
            body = await _read_body(request, claim, settings.job_max_bytes)
            header, binary = _split(body, request.headers.get(HEADER_LENGTH))
            # A large body is parsed in a thread, once, so other clients are not stalled.
            doc = await asyncio.to_thread(json_object, header) if claim.held else json_object(header)
            model = doc.get("model")
            if not isinstance(model, str):
                raise InvalidInput("'model' must name the model to run")
            config = service.model(model)
            plan = service.ensembles.plans.get(model)
            if plan is not None and any(step.when is not None for step in plan.steps):
                raise InvalidInput(f"ensemble {model!r} has conditional steps: a job runs "
                                   "every step on every chunk, so it takes none")
            if not config.batched:
                raise InvalidInput(f"model {model!r} has no batch dim (max_batch_size 0): a "
                                   "job feeds its rows in chunks, so it needs one")
            job_config = replace(config, max_batch_size=MAX_JOB_ROWS)
            parsed = (await asyncio.to_thread(parse_document, doc, binary, job_config)
                      if claim.held else parse_document(doc, binary, job_config))
            if parsed.shm_inputs or parsed.shm_outputs:
                raise InvalidInput("shared memory tensors are not supported by jobs: send the "
                                   "data in the body")
        record = JobRecord(
            id=uuid.uuid4().hex, model=model, state=JobState.PENDING, total=parsed.rows,
            priority=requested_priority(parsed, config.queue.priority_levels,
                                        config.queue.priority_levels,
                                        f"the lowest, {config.queue.priority_levels}"),
            chunk_rows=min(settings.job_chunk_rows or config.max_batch_size,
                           config.max_batch_size),
            # A job's chunks enter partition 0, against its share of the limit.
            max_queue_rows=config.queue.partition_rows, created_at=time.time(),
            outputs=parsed.outputs, callback_url=await _callback_url(parsed, callback_hosts),
            owner=_owner(_principal(request)), ensemble=plan is not None)
        await _store(record, pack_tensors(parsed.inputs))
        try:
            await asyncio.to_thread(send_job, tasks, record.id)
        except Exception as exc:  # the broker is Redis: unreachable, most likely
            await _forget(record.id)
            raise Unavailable(f"could not queue the job: {exc}") from None
        status_url = f"/v1/jobs/{record.id}"
        return JSONResponse({"id": record.id, "status_url": status_url}, status_code=202,
                            headers={"Location": status_url})

    async def _store(record: JobRecord, inputs: bytes) -> None:
        ttl = settings.job_result_ttl_s
        pipe = service.dispatcher.redis.pipeline(transaction=False)
        pipe.set(keys.job_input(record.id), inputs, ex=ttl)
        pipe.hset(keys.job(record.id), mapping=cast(Mapping[Any, str], record.to_hash()))
        pipe.expire(keys.job(record.id), ttl)
        pipe.sadd(keys.jobs_active(), record.id)
        count_move(pipe, keys.jobs_counted(), None, JobState.PENDING)
        for listing in {keys.jobs_listed(""), keys.jobs_listed(record.owner)}:
            pipe.zadd(listing, {record.id: record.created_at})
            pipe.zremrangebyscore(listing, "-inf", record.created_at - ttl)
            pipe.zremrangebyrank(listing, 0, -LISTED - 1)
            pipe.expire(listing, ttl)
        with _redis_guard():
            await pipe.execute()

    async def _forget(job_id: str) -> None:
        try:
            pipe = service.dispatcher.redis.pipeline(transaction=False)
            pipe.delete(keys.job(job_id), keys.job_input(job_id))
            pipe.srem(keys.jobs_active(), job_id)
            count_move(pipe, keys.jobs_counted(), JobState.PENDING, None)
            await pipe.execute()
        except REDIS_FAILED as exc:
            log.warning("could not remove unqueued job %s: %s", job_id, exc)

    @router.get("")
    async def listing(request: Request, limit: int = PAGE, offset: int = 0) -> dict[str, Any]:
        """The caller's jobs (an admin key's, or without keys: every job), newest first."""
        if not 0 < limit <= LISTED or not 0 <= offset < LISTED:
            raise InvalidInput(f"limit must be in 1..{LISTED} and offset in 0..{LISTED - 1} "
                               "(a listing holds the latest jobs only)")
        principal = _principal(request)
        listed = keys.jobs_listed("" if principal is None or principal.admin
                                  else principal.digest)
        redis = service.dispatcher.redis
        with _redis_guard():
            ids = [as_text(i) for i in await redis.zrevrange(listed, offset, offset + limit - 1)
                   if isinstance(i, bytes | str)]
            pipe = redis.pipeline(transaction=False)
            for job_id in ids:
                pipe.hgetall(keys.job(job_id))
            records = await pipe.execute()
            gone = [job_id for job_id, raw in zip(ids, records, strict=True) if not raw]
            if gone:
                await redis.zrem(listed, *gone)
        return {"jobs": [JobRecord.from_hash(job_id, raw).view()
                         for job_id, raw in zip(ids, records, strict=True) if raw]}

    @router.get("/{job_id}")
    async def status(job_id: str, request: Request) -> dict[str, Any]:
        return (await load(job_id, request)).view()

    @router.get("/{job_id}/result")
    async def result(job_id: str, request: Request, binary_data_output: bool = False) -> Response:
        """All rows in order, as a KServe v2 response; binary tensors if asked for
        (``?binary_data_output=true`` or ``Accept: application/octet-stream``)."""
        record = await load(job_id, request)
        if record.state is not JobState.SUCCEEDED:
            detail = f": {record.error}" if record.error else ""
            return JSONResponse({"error": f"job {job_id} is {record.state.value}{detail}; "
                                          "only a SUCCEEDED job has a result",
                                 "state": record.state.value}, status_code=409)
        with _redis_guard():
            chunks = await service.dispatcher.redis.hgetall(keys.job_chunks(job_id))
        ordered = _ordered_chunks(job_id, record.chunks, chunks)
        binary = binary_data_output or BINARY_TYPE in request.headers.get("accept", "")
        shape = InferRequest(id=job_id, inputs=[], rows=record.total, binary_default=binary)
        content, json_length = render(record.model, shape, join_chunks(ordered))
        if json_length is None:
            return Response(content, media_type="application/json")
        return Response(content, media_type=BINARY_TYPE,
                        headers={HEADER_LENGTH: str(json_length)})

    @router.delete("/{job_id}")
    async def cancel(job_id: str, request: Request) -> Response:
        """Cancel an unfinished job: feeding stops at once, chunks in flight are discarded."""
        redis = service.dispatcher.redis
        await load(job_id, request)  # another owner's job is unknown here too
        with _redis_guard():
            before = await transition(keys=[record_key(job_id)],
                                      args=[JobState.CANCELLED, UNFINISHED, "finished_at",
                                            repr(time.time())])
            if before is None:
                raise ModelNotFound(f"unknown job {job_id!r} (or its result expired)")
            state = JobState(before.decode())
            if state not in FINISHED:
                pipe = redis.pipeline(transaction=False)
                count_move(pipe, keys.jobs_counted(), state, JobState.CANCELLED)
                await pipe.execute()
            if state is JobState.RUNNING:  # wake its task, which withdraws what is in flight
                pipe = redis.pipeline(transaction=False)
                pipe.rpush(keys.job_replies(job_id), Reply(WAKE).encode())
                pipe.expire(keys.job_replies(job_id), settings.job_result_ttl_s)
                await pipe.execute()
            elif state is JobState.PENDING:  # its task, when it starts, only reports it
                await redis.delete(keys.job_input(job_id))
                await redis.srem(keys.jobs_active(), job_id)
        if state in (JobState.SUCCEEDED, JobState.FAILED):
            return JSONResponse({"error": f"job {job_id} already ended {state.value}",
                                 "state": state.value}, status_code=409)
        return JSONResponse((await load(job_id, request)).view())

    return router


def _ordered_chunks(job_id: str, count: int,
                    chunks: Mapping[bytes | str, bytes | str]) -> list[list[Tensor]]:
    """A SUCCEEDED job's result chunks in order. None left: the result expired (404). Some
    missing: they were lost (a job worker stores a chunk before counting it, so this is a
    bug or lost Redis data): a 500 that names them, logged; the job's state is left alone,
    as its end was reported already (and a read should not rewrite it)."""
    if count and not chunks:
        raise ModelNotFound(f"the result of job {job_id} expired")
    missing = [i for i in range(count) if str(i).encode() not in chunks]
    if missing:
        log.error("job %s SUCCEEDED but %d of its %d result chunks are missing: %s", job_id,
                  len(missing), count, missing[:10])
        raise ConveyorError(f"the result of job {job_id} is incomplete: {len(missing)} of "
                            f"its {count} chunks are missing (first: {missing[:10]})")
    return [unpack_tensors(cast(bytes, chunks[str(i).encode()])) for i in range(count)]


@contextmanager
def _redis_guard() -> Iterator[None]:
    try:
        yield
    except REDIS_FAILED as exc:
        raise Unavailable(f"Redis is unreachable: {exc}") from None


async def _read_body(request: Request, claim: LargeBody, limit: int) -> bytes:
    return await read_body(request.receive, claim,
                           content_length(request.headers.get("content-length")), limit,
                           "CONVEYOR_JOB_MAX_BYTES")


def _split(body: bytes, header_length: str | None) -> tuple[memoryview, memoryview]:
    """The JSON header and the binary tensors after it (binary tensor extension)."""
    view = memoryview(body)
    if header_length is None:
        return view, view[:0]
    length = content_length(header_length)
    if length is None or not 0 < length <= len(body):
        raise InvalidInput(f"Inference-Header-Content-Length {header_length!r} does not fit a "
                           f"body of {len(body)} bytes")
    return view[:length], view[length:]


async def _callback_url(parsed: InferRequest, allowed: AllowList) -> str:
    """``parameters.callback_url``, checked against the callback policy (resolved in a
    thread: the job worker checks it again before each POST)."""
    url = parsed.parameters.get("callback_url") or ""
    if not isinstance(url, str):
        raise InvalidInput(f"parameters.callback_url must be an http(s) URL, got {url!r}")
    if url:
        try:
            await asyncio.to_thread(check_callback, url, allowed)
        except OSError as exc:
            raise InvalidInput(f"parameters.callback_url: its host does not resolve: "
                               f"{exc}") from None
    return url


def _principal(request: Request) -> Principal | None:
    principal: Principal | None = request.scope.get(PRINCIPAL)
    return principal


def _owner(principal: Principal | None) -> str:
    return "" if principal is None else principal.digest


def _sees(principal: Principal | None, record: JobRecord) -> bool:
    """Without keys everyone sees every job; with keys, its owner and admin keys do."""
    return principal is None or principal.admin or record.owner == principal.digest
