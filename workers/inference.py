"""The batch loop of one inference process: form, run and answer batches.

The loop: block for the first entry, top up without blocking while the policy says
wait (the window is timed here, never by a short Redis BLOCK), claim what dead or stuck
consumers left behind, drop entries whose clients left (each read fetches the model's
withdrawn set along), answer expired entries without running them (workers/expiry.py),
run one shape group, split the outputs, answer and acknowledge in one pipeline. Every
few seconds, and at once after Redis failed or lost data, it also recomputes the model's
rows-waiting counter from its streams (workers/reconcile.py).

Pipelined (``pipelined=True``, as an inference process on an accelerator runs), the model runs on a
model thread (workers/model_thread.py) while this thread reads what arrives, and when the
model frees it forms the next batch from everything read meanwhile, launches it, and only
then answers the batch that just finished. Redis stays on this thread. Without a model
thread each step runs its batch to the end: what tests that drive the loop step by step use.

Model failures are answered, never fatal. Out of memory halves the batch
(workers/batch_run.py, which runs a batch through the model) and the learned memory cap
(workers/memory_caps.py). A CUDA error that poisons the context stops the process with
the batch unacknowledged: the supervisor replaces it and another process re-runs the
entries.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping
from functools import partial

from redis.exceptions import RedisError

from batching.config import ModelConfig
from batching.envelope import PATH
from batching.errors import ModelFailure, Unavailable
from batching.former import Batch, BatchFormer, Entry, Layout
from batching.keys import Keys
from batching.policy_choice import make_policy
from batching.service_rate import ServiceRate
from workers.backends import (
    LoadedModel,
)
from workers.batch_report import BatchListener, BatchReport, failure
from workers.batch_run import Arrays, BatchRunner, Outcome
from workers.batch_stats import batch_counters
from workers.expiry import Expiry, answer_unrun
from workers.memory_caps import MemoryCaps
from workers.model_thread import ModelThread
from workers.output_push import OutputPush
from workers.shared_inputs import SharedInputs
from workers.shared_state import SharedState
from workers.stream_port import ReclaimPort, StreamPort

log = logging.getLogger("conveyor.inference")

BLOCK_MS = 1000
"""Longest blocking read; bounds how long a stop request or a reclaim check waits."""
FLUSH_BLOCK_MS = 100
"""Blocking read while statistics wait to be flushed: idle counters are at most this late."""
POLL_S = 0.001
"""While the model runs and the next batch is not full: how often the loop reads again
(at least; an eighth of the last batch's time for a slow model)."""
FATAL_EXIT_CODE = 3

def _no_events(report: BatchReport) -> None:
    """The default listener: nobody is told."""


class InferenceLoop:
    """One model instance's loop. ``streams`` and ``reclaimer`` are its Redis side
    (:class:`workers.streams.ModelStreams`, :class:`workers.recovery.Reclaimer`) or, in
    unit tests, their in-memory stand-ins (:mod:`workers.memory_streams`)."""

    def __init__(self, config: ModelConfig, model: LoadedModel, streams: StreamPort,
                 reclaimer: ReclaimPort, shared: SharedState, keys: Keys, *,
                 pipelined: bool = False,
                 versions: Mapping[str, LoadedModel] | None = None) -> None:
        """``model`` runs requests that name no version; ``versions`` (a model with version
        folders) the others, by version."""
        self.config = config
        self.model = model
        self.versions = dict(versions or {})
        self.streams = streams
        self.reclaimer = reclaimer
        self.reconciler = streams.reconciler(config.batch_rows)
        streams.on_data_lost = self.reconciler.suspect
        self.shared = shared
        self.dlq = keys.dead_letter(config.name)
        self.policy = make_policy(config)
        adaptive = config.batching.adaptive  # a fixed window keeps Triton's order
        self.former = BatchFormer(self.policy, config.batch_rows, Layout.of(config),
                                  config.max_batch_cost, config.queue.max_priority_wait_ms,
                                  target_s=config.batching.latency_target_ms / 1000.0
                                  if adaptive else None,
                                  lifo=adaptive and config.batching.overload == "lifo")
        self.caps = MemoryCaps(config, self.former, self.policy, shared, streams)
        self.row_cap = self.caps.row_cap
        """:attr:`MemoryCaps.row_cap`, the one owner of the batch size bound."""
        self.expiry = Expiry(config, self.former, self.policy, self.row_cap, streams)
        self.events: BatchListener = _no_events
        self.stopping = False
        self._lone = False
        """The last batch was :attr:`Batch.lone`."""
        self._model: ModelThread[Outcome] | None = (
            ModelThread(f"model-{config.name}") if pipelined else None)
        self._running = 0.0
        """When the batch on the model thread started (time.monotonic())."""
        self._lone_running = False
        """The batch on the model thread is :attr:`Batch.lone`."""
        self._prepared: tuple[Batch, Arrays | None] | None = None
        """The next batch, formed full and stacked while the model ran the last one
        (:meth:`_prepare`), with its stacked inputs."""
        self._model_s = 0.0
        """How long the last batch took in the model thread."""
        self.batches = 0
        self.rows = 0
        self._last_answered = 0.0
        """When the last batch's answers were sent (time.time())."""
        self._cpu_mark = time.thread_time()
        """This thread's CPU time when the last batch's answers were sent."""
        self.service = ServiceRate()
        """Rows per second of running batches, published with the heartbeat."""
        self.inputs = SharedInputs()
        self.outputs = OutputPush()
        """Uploads large outputs to the API processes that offer a place for them."""
        self._stages = pipelined and hasattr(model, "staging")
        """The model stacks batches into a buffer of its own: a full next batch is
        stacked while the model runs (:meth:`_prepare`)."""
        self.runner = BatchRunner(config.name, self.former.layout, model, self.versions,
                                  {t.name: t.datatype for t in config.outputs})

    def apply_control(self, overrides: dict[str, int]) -> None:
        """Run-time batching knobs (Celery's ``conveyor_set_batching``), without a restart.

        ``max_batch_size`` may lower the configured bound or restore it, never exceed it:
        the API admits requests against the configured one.
        """
        if "max_queue_delay_us" in overrides:
            self.policy.max_delay_s = max(0, int(overrides["max_queue_delay_us"])) / 1e6
        if "max_batch_size" in overrides:
            self.caps.limit(min(max(1, int(overrides["max_batch_size"])),
                                self.config.batch_rows))

    def stats(self) -> dict[str, float]:
        return {"batches": self.batches, "rows": self.rows,
                "mean_batch": self.rows / self.batches if self.batches else 0.0,
                "row_cap": self.row_cap.cap, "max_batch_size": self.row_cap.limit,
                "max_queue_delay_us": int(self.policy.max_delay_s * 1e6),
                "service_rows_per_s": self.service.rows_per_s}

    @property
    def idle(self) -> bool:
        """Nothing read waits here and no batch runs: a stopping process may exit."""
        return (len(self.former) == 0 and self._prepared is None
                and not (self._model and self._model.busy))

    def step(self) -> None:
        """Read, claim, and run at most one batch (pipelined: launch it, or take the model's
        result and launch the next). A Redis failure propagates (the caller retries; a
        batch on the model thread runs on and is answered by a later step), and the next
        step reconciles the rows-waiting counter: the failure may have been a restart that
        lost data."""
        try:
            self._step()
        except (OSError, RedisError) as exc:
            self.reconciler.suspect(f"Redis failed ({exc})")
            raise

    def _step(self) -> None:
        busy = self._model is not None and self._model.busy
        bound = self.expiry.room(self.row_cap.limit)
        room = bound - self.former.pending_rows
        now = time.time()
        if not self.stopping and self.reconciler.due(now):
            self.reconciler.run(now)
        if not self.stopping and room > 0:
            if self.reclaimer.due(now):
                self._admit(self.reclaimer.poll(now, room))
                room = bound - self.former.pending_rows
            block = None
            if len(self.former) == 0 and not busy:
                self.streams.flush_counts()
                # Buffered counters still waiting: wake up soon to send them.
                block = FLUSH_BLOCK_MS if self.streams.counts_pending else BLOCK_MS
            if room > 0 and not (busy and self._lone_running and len(self.former) == 0):
                # While the model runs the loop never blocks in Redis (a short BLOCK
                # returns at Redis's next tick, up to 100 ms late); a lone request's
                # batch is answered first: nothing else is likely to arrive meanwhile.
                # Poll, not sleep, only in the first wait after a lone request: under more
                # load the loop seldom sleeps, and polling would take CPU from the
                # processes feeding it.
                poll, self._lone = self._lone, False
                fresh = self.streams.read(room, block, poll=poll)
                self._arrived(fresh)
                self.expiry.read(len(fresh), room, now)
                room = bound - self.former.pending_rows
            now = time.time()
        elif not self.stopping and self.former.best_priority > 1:
            # Full of lower-priority work (job chunks, say): still let urgent requests in,
            # or they would wait behind everything this process has already read.
            self._arrived(self.streams.read(bound, None, self.former.best_priority - 1))
            now = time.time()
        self.expiry.answer(now)
        if busy:
            self._prepare(now)
            # Read again soon while the next batch can still grow; else wait for the model.
            growing = room > 0 and not self.stopping and not (
                self._lone_running and len(self.former) == 0)
            poll_s = max(POLL_S, self._model_s / 8)
            if self._model is not None and self._model.wait(poll_s if growing else None):
                self._hand_over()
            return
        batch = self._form(now)
        if batch is not None:
            self._start(batch)
        elif len(self.former) and not self.stopping:
            time.sleep(min(self.former.decide(now).wait_s, 0.001))

    def _form(self, now: float) -> Batch | None:
        """The batch the policy dispatches now (all that waits when stopping), if any."""
        decision = self.former.decide(now)
        if not len(self.former) or not (decision.dispatch or self.stopping):
            return None
        cap = min(decision.max_rows or self.row_cap.cap, self.row_cap.cap)
        batch = self.former.take(decision.reason or "drain",
                                 min(cap, self.expiry.in_time_rows or cap))
        self.expiry.formed(len(self.former), now)
        return batch

    def _prepare(self, now: float) -> None:
        """While the model runs, take a next batch that is already as full as it can be
        and stack its inputs now, into the buffer its model offers (pinned host memory
        on a GPU): the model then starts it the moment it frees, instead of idling while
        the batch is stacked. Only a full batch: one that could still grow waits for the
        model, to take in what arrives meanwhile."""
        if (self._prepared is not None or self.stopping or not self._stages
                or self.former.pending_rows < self.row_cap.cap):
            return
        batch = self._form(now)
        if batch is not None:
            trial = batch.entries[0].deliveries > 1  # runs on this thread: nothing to stack
            self._prepared = (batch, None if trial else self.runner.stack(batch))

    def _start(self, batch: Batch, stacked: Arrays | None = None) -> None:
        """Pipelined, launch ``batch`` on the model thread (its inputs ``stacked`` if they
        are); else, or when it is on trial, run it here: nothing else runs or is answered
        while an entry is on trial."""
        if self._model is None or batch.entries[0].deliveries > 1:
            self.run(batch)
            return
        self.streams.settle()
        self._running = time.monotonic()
        self._lone_running = batch.lone
        self._model.launch(partial(self._execute, batch, stacked))

    def _hand_over(self) -> None:
        """The model is free: launch the next batch (the one :meth:`_prepare` stacked, or
        one formed now from everything read while the last one ran), then answer the last
        one (before the next, if that one is on trial).
        What the model thread raised (the device lost, say) raises here, once the answers
        already sent are applied."""
        assert self._model is not None
        try:
            done = self._model.collect()
        except BaseException:
            with contextlib.suppress(OSError, RedisError):
                self.streams.settle()
            raise
        self._model_s = time.monotonic() - self._running
        self.caps.learn(done)
        now = time.time()
        self.expiry.answer(now)
        batch: Batch | None
        stacked: Arrays | None = None
        if self._prepared is not None:
            (batch, stacked), self._prepared = self._prepared, None
        else:
            batch = self._form(now)
        if batch is not None and batch.entries[0].deliveries == 1:
            self._start(batch, stacked)
            batch = None
        self._finish(done)
        if batch is not None:
            self._start(batch)

    def _readable(self, entries: list[Entry]) -> list[Entry]:
        """``entries`` with their inputs in reach; one whose input is in an arena this
        process cannot read (workers/shared_inputs.py) is answered now, unrun."""
        readable, lost = self.inputs.split(entries)
        for entry, why in lost:
            answer_unrun(self.streams, [entry], Unavailable(why))
        return readable

    def _arrived(self, fresh: list[Entry]) -> None:
        fresh = self._readable(fresh)
        if fresh:
            self.policy.observe_arrivals(sum(e.rows for e in fresh), time.time())
            paths = [p for e in fresh if isinstance(p := e.request.params.get(PATH), int)
                     and not isinstance(p, bool) and p >= 0]  # µs, from an API process
            if paths:
                self.policy.observe_path(max(paths) / 1e6)
            self.former.add(fresh)
        if self.streams.withdrawn:
            gone = self.former.take_withdrawn(self.streams.withdrawn)
            if gone:
                self.streams.withdraw(gone)

    def _admit(self, claimed: list[Entry]) -> None:
        """Queue claimed entries, dead-lettering those delivered too often."""
        claimed = self._readable(claimed)
        if not claimed:
            return
        limit = self.config.max_deliveries
        dead = [e for e in claimed if e.deliveries > limit]
        if dead:
            reason = (f"failed {limit} times: each process that took it died or hung "
                      "before answering")
            self.streams.dead_letter(self.dlq, dead, reason)
            answer_unrun(self.streams, dead, ModelFailure(
                f"model {self.config.name!r} {reason}; moved to the dead-letter stream"),
                {"dead_letter_count": len(dead)})
        alive = [e for e in claimed if e.deliveries <= limit]
        self.former.add(alive)
        self.streams.count({"reclaimed_count": len(claimed)})

    def run(self, batch: Batch) -> None:
        """Run ``batch`` on this thread and answer it. Every answer sent before is applied
        first, and a re-delivered entry is put on trial before it runs."""
        self.streams.settle()
        if batch.entries[0].deliveries > 1:  # re-delivered: it runs alone (Former.take)
            self.streams.on_trial(batch.entries[0])
        prep_s = time.thread_time() - self._cpu_mark
        done = self._execute(batch)
        done.prep_s = prep_s
        self.caps.learn(done)
        self._finish(done)

    def _execute(self, batch: Batch, stacked: Arrays | None = None) -> Outcome:
        """Run ``batch`` through the model (on the model thread when pipelined): touches
        nothing the loop's thread uses but ``shared.busy_since``, which the supervisor
        watches for hangs."""
        self.shared.busy_since = time.monotonic()
        done = Outcome(batch, time.time())
        try:
            done.answered = self.runner.run_entries(batch.entries, done, stacked)
        finally:
            self.shared.busy_since = 0.0
        done.finished = time.time()
        return done

    def _finish(self, done: Outcome) -> None:
        """Answer a batch the model ran, and count it."""
        batch, started, finished = done.batch, done.started, done.finished
        self.batches += 1
        self.rows += batch.rows
        self.service.observe(batch.rows, finished - started)
        self._lone = batch.lone
        counters = batch_counters(done.answered, batch.rows, started, finished, done.phase_ns)
        counters[f"reason:{batch.reason}"] = 1
        counters["wait_ns"] = int((started - min(e.seen for e in batch.entries)) * 1e9)
        self.streams.note("last_inference", int(finished * 1000))
        self.outputs.push(done.answered)
        self.streams.answer(done.answered, counters)
        answered = time.time()
        self.events(BatchReport(batch.rows, batch.reason, min(e.seen for e in batch.entries),
                                started, answered, failure(done.answered)))
        self.reclaimer.observe_batch(answered - started)
        if all(reply.ok for _, reply in done.answered):
            self.policy.observe_batch(batch.rows, self._service_s(done, answered), answered)
        self._last_answered = answered
        self._cpu_mark = time.thread_time()

    def _service_s(self, done: Outcome, answered: float) -> float:
        """What the batch cost the whole path, as the adaptive policy learns it: on the
        loop's thread, its run and answers plus the CPU spent reading and forming it; on the
        model thread, whose reads overlap the model, the time since the previous answers
        (a backlog) or since it started (an idle loop)."""
        if done.prep_s is not None:
            return answered - done.started + done.prep_s
        return answered - max(self._last_answered, done.started)
