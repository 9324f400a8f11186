"""Async jobs as Celery tasks on ``cv.jobs``, run by job workers::

    celery -A workers.app worker -Q cv.jobs --no-inference -P threads -c 4

The API stores a job (:mod:`api.job_routes`) and sends :func:`run_job` with the job id as the
task id, so Flower shows each job as one task: STARTED, then PROGRESS events carrying
``{"done", "total"}`` (also stored with ``update_state``), then SUCCESS, FAILURE or
REVOKED (cancelled).

A job worker that dies does not lose its job. Every finished chunk is stored as it
arrives, and the running task holds a lease it renews. A job worker told to stop hands
its jobs over at once (the task releases its lease and retries itself, so another job
worker resumes it); one killed outright stops renewing, and within ``job_lease_s`` the
reaper thread of any job worker resends the task. Either way the job resumes from the
chunks already done. The task also acks late, so a message whose worker died before
starting the job is redelivered by the broker.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections import Counter
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
import orjson
from celery import Task, bootsteps, shared_task
from celery.exceptions import Ignore
from celery.signals import worker_shutting_down
from celery.states import REVOKED

from batching.backoff import nth_delay
from batching.callbacks import AllowList, CallbackRefused, Resolver, Target, check_callback, resolve
from batching.job_record import (
    CALLBACK_TASK,
    FINISHED,
    JOB_QUEUE,
    JOB_TASK,
    JobRecord,
    JobState,
)
from batching.keys import Keys
from batching.redis_errors import REDIS_UNREACHABLE
from batching.redis_topology import sync_redis
from batching.repository_scan import as_text
from batching.settings import Settings
from batching.urls import mask_url
from conveyor.celery_client import send_job
from workers.job_runner import JobRunner

log = logging.getLogger("conveyor.jobs")

PROGRESS = "PROGRESS"
"""The Celery state of a running job's task; its meta (and event) carry done and total."""
PROGRESS_EVERY_S = 0.5
CALLBACK_RETRIES = 8
CALLBACK_MAX_DELAY_S = 300
CALLBACK_TIMEOUT = httpx.Timeout(5.0, connect=2.0)

_stopping = threading.Event()


@worker_shutting_down.connect
def _on_shutdown(**_: Any) -> None:
    """Running jobs hand over rather than hold the warm shutdown up until they finish."""
    _stopping.set()


class JobContext:
    """What every job task of this process shares: settings, keys, one Redis client."""

    def __init__(self) -> None:
        self.settings = Settings()
        self.keys = Keys(self.settings.key_prefix)
        self.redis = sync_redis(self.settings.redis_url, socket_connect_timeout=1.0,
                                          socket_timeout=5.0, health_check_interval=30)

    def record(self, job_id: str) -> JobRecord | None:
        raw = self.redis.hgetall(self.keys.job(job_id))
        return JobRecord.from_hash(job_id, raw) if raw else None


@functools.cache
def context() -> JobContext:
    return JobContext()


@shared_task(name=JOB_TASK, bind=True, acks_late=True, ignore_result=False)
def run_job(self: Task[Any, Any], job_id: str, takeover: str = "") -> dict[str, Any]:
    """Run job ``job_id`` to its end (``takeover``: the reaper's lease token, if it resent it)."""
    ctx = context()
    record = ctx.record(job_id)
    if record is None or record.state in FINISHED:
        if record is not None and record.state is JobState.CANCELLED:
            _notify(ctx, record)  # cancelled before it started
            _revoked(self)
        return {"id": job_id, "state": record.state.value if record else "EXPIRED"}
    progress = _Progress(self)
    runner = JobRunner(ctx.redis, ctx.keys, ctx.settings, record, progress, _stopping.is_set)
    if not runner.acquire(takeover):
        log.info("job %s is running elsewhere; this delivery is a duplicate", job_id)
        raise Ignore()
    before = runner.start()
    if before not in (JobState.PENDING, JobState.RUNNING):
        if before is JobState.CANCELLED:
            runner.cancelled()
            _notify(ctx, record)
            _revoked(self)
        runner.release()
        return {"id": job_id, "state": before.value if before else "EXPIRED"}
    started = time.monotonic()
    state = runner.run()
    if state is JobState.RUNNING:
        if _stopping.is_set():
            raise self.retry(countdown=0, max_retries=None)
        raise Ignore()  # another task took the lease over and runs the job
    _notify(ctx, record)
    took = time.monotonic() - started
    log.info("job %s %s: %d rows in %.2fs", job_id, state.value, record.total, took)
    if state is JobState.CANCELLED:
        _revoked(self)
    if state is JobState.FAILED:
        raise JobError(runner.error)
    return {"id": job_id, "state": state.value, "rows": record.total, "seconds": round(took, 3)}


class JobError(Exception):
    """The job failed; Celery records its task as FAILURE with this message."""


class _Progress:
    """Reports progress to Celery: ``update_state`` and a task event, at most twice a second."""

    def __init__(self, task: Task[Any, Any]) -> None:
        self.task = task
        self._next = 0.0

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if now < self._next and done < total:
            return
        self._next = now + PROGRESS_EVERY_S
        meta = {"done": done, "total": total}
        try:
            self.task.update_state(state=PROGRESS, meta=meta)
            self.task.send_event("task-progress", result=orjson.dumps(meta).decode(), retry=False)
        except Exception as exc:  # progress is for watching: it never stops the job
            log.debug("progress report failed: %s", exc)


def _revoked(task: Task[Any, Any]) -> None:
    """Show the cancelled job's task as REVOKED in the result backend and in Flower.

    Celery's event state (which Flower keeps) ranks a custom state such as PROGRESS after
    REVOKED, so a plain ``task-revoked`` following progress events would only add its
    time and leave the task PROGRESS; an event's fields are still applied, so it carries
    the state itself.
    """
    task.update_state(state=REVOKED, meta={"reason": "cancelled"})
    task.send_event("task-revoked", terminated=False, expired=False, signum=None,
                    state=REVOKED)
    raise Ignore()


def _notify(ctx: JobContext, record: JobRecord) -> None:
    """Queue the callback of a finished job, once (a duplicate delivery sends none)."""
    if not record.callback_url or not ctx.redis.hsetnx(ctx.keys.job(record.id), "notified", 1):
        return
    final = ctx.record(record.id)
    if final is not None:
        send_callback.delay(record.callback_url, final.view())


@shared_task(name=CALLBACK_TASK, bind=True, acks_late=True, max_retries=CALLBACK_RETRIES)
def send_callback(self: Task[Any, Any], url: str, body: dict[str, Any]) -> int:
    """POST the finished job's status to its ``callback_url``, retried with back-off.

    The URL is checked against the callback policy again first (the allowed hosts may
    have changed, and its name may resolve elsewhere now); a refusal is final.
    """
    try:
        response = deliver(url, body, AllowList.parse(context().settings.callback_hosts))
        response.raise_for_status()
    except CallbackRefused as exc:
        log.error("job %s: callback refused, not sent: %s", body.get("id"), exc.message)
        return 0
    except (httpx.HTTPError, OSError) as exc:
        retries = self.request.retries
        if retries >= CALLBACK_RETRIES:
            log.error("job %s: callback to %s failed %d times, giving up: %s", body.get("id"),
                      mask_url(url), retries + 1, exc)
            return 0
        delay = nth_delay(1, CALLBACK_MAX_DELAY_S, retries)
        log.warning("job %s: callback to %s failed (%s); retrying in %ds", body.get("id"),
                    mask_url(url), exc, delay)
        raise self.retry(countdown=delay) from exc
    return response.status_code


def deliver(url: str, body: dict[str, Any], allowed: AllowList,
            resolver: Resolver = resolve) -> httpx.Response:
    """POST ``body`` to ``url`` at the addresses the policy checked, and nowhere else.

    The connection goes to a checked address (the next one if it cannot connect), with
    the URL's host as the Host header and TLS server name, so the name is not resolved a
    second time. No redirects, no proxies from the environment, short timeouts.
    """
    target = check_callback(url, allowed, resolver)
    *others, last = target.addresses
    with httpx.Client(timeout=CALLBACK_TIMEOUT, follow_redirects=False,
                      trust_env=False) as client:

        def post(address: str) -> httpx.Response:
            return client.post(_pinned(url, target, address), json=body,
                               headers={"Host": _host_header(target)},
                               extensions={"sni_hostname": target.host})

        for address in others:
            try:
                return post(address)
            except httpx.ConnectError as exc:
                log.info("callback to %s at %s: %s; trying the next address", target.host,
                         address, exc)
        return post(last)


def _pinned(url: str, target: Target, address: str) -> str:
    parts = urlsplit(url)
    literal = f"[{address}]" if ":" in address else address
    userinfo = parts.netloc.rpartition("@")[0]
    netloc = f"{userinfo}@{literal}:{target.port}" if userinfo else f"{literal}:{target.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, ""))


def _host_header(target: Target) -> str:
    host = f"[{target.host}]" if ":" in target.host else target.host
    default = 443 if target.scheme == "https" else 80
    return host if target.port == default else f"{host}:{target.port}"


class JobReaper(bootsteps.StartStopStep):
    """In job workers: resends the task of a running job whose lease lapsed (its worker died)."""

    def __init__(self, parent: Any, **options: Any) -> None:
        super().__init__(parent, **options)
        self.enabled = JOB_QUEUE in parent.app.amqp.queues.consume_from
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, parent: Any) -> None:
        self._thread = threading.Thread(target=self._run, args=(parent.app,), daemon=True,
                                        name="conveyor-job-reaper")
        self._thread.start()

    def stop(self, parent: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)

    def _run(self, app: Any) -> None:
        ctx = context()
        while not self._stop.wait(ctx.settings.job_lease_s / 2):
            try:
                reap(ctx, app)
            except REDIS_UNREACHABLE as exc:
                log.debug("job reaper: Redis unreachable: %s", exc)


def reap(ctx: JobContext, app: Any) -> None:
    """Resend every RUNNING job with no lease; forget finished or expired ones; recount
    the unfinished jobs."""
    active = sorted(as_text(m) for m in ctx.redis.smembers(ctx.keys.jobs_active()))
    pipe = ctx.redis.pipeline(transaction=False)
    for job_id in active:
        pipe.hget(ctx.keys.job(job_id), "state")
        pipe.exists(ctx.keys.job_lease(job_id))
    answers = pipe.execute() if active else []
    lease_ms = int(ctx.settings.job_lease_s * 1000)
    recount(ctx, answers[::2])
    for job_id, state, leased in zip(active, answers[::2], answers[1::2], strict=True):
        if state is None or state.decode() in FINISHED:
            ctx.redis.srem(ctx.keys.jobs_active(), job_id)
        elif state.decode() == JobState.RUNNING and not leased:
            token = f"reaper-{os.urandom(6).hex()}"
            if ctx.redis.set(ctx.keys.job_lease(job_id), token, nx=True, px=lease_ms):
                log.warning("job %s lost its worker; resending it to resume", job_id)
                send_job(app, job_id, token)


def recount(ctx: JobContext, states: list[bytes | None]) -> None:
    """Set the counts of PENDING and RUNNING jobs (``Keys.jobs_counted``) to the states
    the reaper just read. Each move keeps them exact; this takes off what no move
    counts, a job whose record expired before it ran."""
    found = Counter(as_text(s) for s in states if s is not None)
    ctx.redis.hset(ctx.keys.jobs_counted(),
                   mapping={state: found[state] for state in (JobState.PENDING, JobState.RUNNING)})
