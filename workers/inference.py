"""One inference process: load a model once on its device, then form, run and answer batches.

Started by the supervisor with ``spawn`` (CUDA is never touched before a fork). The loop:
block for the first entry, top up without blocking while the policy says wait (the
window is timed here, never by a short Redis BLOCK), answer expired entries without
running them, run one shape group, split the outputs, answer and acknowledge.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from batching.config import ModelConfig
from batching.datatypes import from_numpy
from batching.envelope import Reply, Tensor
from batching.errors import ConveyorError, DeadlineExceeded, ModelFailure
from batching.former import Batch, BatchFormer, Entry
from batching.keys import Keys
from batching.policy import FixedWindow
from batching.repository import load_model_config
from batching.settings import Settings
from workers.backends import LoadedModel, load_model
from workers.heartbeat import Heartbeat
from workers.streams import ModelStreams

log = logging.getLogger("conveyor.inference")

BLOCK_MS = 1000
"""Longest blocking read; bounds how long a stop request waits."""


def consumer_name(model: str, device: str, index: int) -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{model}:{device}:{index}"


class InferenceLoop:
    def __init__(self, config: ModelConfig, model: LoadedModel, streams: ModelStreams) -> None:
        self.config = config
        self.model = model
        self.streams = streams
        delay_s = config.batching.max_queue_delay_us / 1e6
        self.former = BatchFormer(FixedWindow(config.max_batch_size, delay_s),
                                  config.max_batch_size)
        self.stopping = False
        self.batches = 0
        self.rows = 0
        self._out_types = {t.name: t.datatype for t in config.outputs}

    def step(self) -> None:
        """Read, and run at most one batch."""
        room = self.config.max_batch_size - self.former.pending_rows
        if not self.stopping and room > 0:
            block = BLOCK_MS if len(self.former) == 0 else None
            self.former.add(self.streams.read(room, block))
        now = time.time()
        expired = self.former.take_expired(now)
        if expired:
            self._answer_error(expired, DeadlineExceeded("deadline passed while queued"))
        decision = self.former.decide(now)
        if not decision.dispatch:
            if len(self.former) and not self.stopping:
                time.sleep(min(decision.wait_s, 0.001))
                return
            if not self.stopping:
                return
        if len(self.former):
            self.run(self.former.take(decision.reason or "drain"))

    def run(self, batch: Batch) -> None:
        started = time.time()
        try:
            outputs = self._predict(batch)
        except ConveyorError as exc:
            self._answer_error(batch.entries, exc)
            return
        finished = time.time()
        exec_ms = (finished - started) * 1000.0
        rows = batch.rows
        self.batches += 1
        self.rows += rows
        replies = []
        queue_ns = 0
        for entry, own in zip(batch.entries, batch.split(outputs), strict=True):
            wanted = entry.request.outputs
            tensors = [Tensor.from_array(name, arr, self._out_types.get(name))
                       for name, arr in own.items() if not wanted or name in wanted]
            queue_ms = max(0.0, started * 1000.0 - entry.request.enq_ms)
            queue_ns += int(queue_ms * 1e6)
            replies.append((entry, Reply(entry.request.id, tensors, batch_rows=rows,
                                         exec_ms=exec_ms, queue_ms=queue_ms)))
        self.streams.answer(replies, _batch_counters(batch, started, finished, queue_ns))

    def _predict(self, batch: Batch) -> dict[str, npt.NDArray[Any]]:
        try:
            outputs = self.model.predict(batch.stacked_inputs())
        except ConveyorError:
            raise
        except Exception as exc:  # the model's own failure: reported, never fatal here
            log.exception("model %s failed on a batch of %d rows", self.config.name, batch.rows)
            raise ModelFailure(f"model {self.config.name!r} failed: "
                               f"{type(exc).__name__}: {exc}") from exc
        rows = batch.rows
        for name, arr in outputs.items():
            arr = np.asarray(arr)
            if arr.ndim == 0 or arr.shape[0] != rows:
                raise ModelFailure(f"model {self.config.name!r} returned output {name!r} "
                                   f"with shape {list(arr.shape)} for {rows} input rows")
            if name not in self._out_types:
                self._out_types[name] = from_numpy(arr.dtype)
            outputs[name] = arr
        return outputs

    def _answer_error(self, entries: list[Entry], exc: ConveyorError) -> None:
        now_ms = time.time() * 1000.0
        fail_ns = sum(int(max(0.0, now_ms - e.request.enq_ms) * 1e6) for e in entries)
        self.streams.answer(
            [(e, Reply(e.request.id, error_code=exc.code, error=exc.message)) for e in entries],
            {"fail_count": len(entries), "fail_ns": fail_ns})


def _batch_counters(batch: Batch, started: float, finished: float,
                    queue_ns: int) -> dict[str, int]:
    """Triton-style statistics of one executed batch (see api/ stats)."""
    requests = len(batch.entries)
    exec_ns = int((finished - started) * 1e9)
    success_ns = sum(int(max(0.0, finished * 1000.0 - e.request.enq_ms) * 1e6)
                     for e in batch.entries)
    return {
        "inference_count": batch.rows,
        "execution_count": 1,
        "success_count": requests,
        "success_ns": success_ns,
        "queue_count": requests,
        "queue_ns": queue_ns,
        "compute_infer_count": requests,
        "compute_infer_ns": exec_ns * requests,
        f"batch:{batch.rows}:count": 1,
        f"batch:{batch.rows}:ns": exec_ns,
    }


def serve(model_name: str, device: str, index: int) -> None:
    """Entry point of a spawned inference process."""
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s[%(process)d] %(message)s")
    settings = Settings()
    keys = Keys(settings.key_prefix)
    folder = Path(settings.model_repository) / model_name
    config = load_model_config(folder)
    consumer = consumer_name(model_name, device, index)
    client = redis.Redis.from_url(settings.redis_url, socket_connect_timeout=1.0,
                                  socket_timeout=BLOCK_MS / 1000 + 5, health_check_interval=30)
    heartbeat = Heartbeat(client, keys, model_name, consumer, device,
                          settings.heartbeat_interval_s)
    heartbeat.start()
    streams = ModelStreams(client, keys.queues(model_name, config.queue.priority_levels),
                           keys.stats(model_name), consumer)
    loop = InferenceLoop(config, load_model(config, folder, device), streams)

    def stop(_signum: int, _frame: object) -> None:
        loop.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which stops us
    _retry(streams.ensure_groups)
    heartbeat.update(state="ready", max_batch_size=config.max_batch_size)
    log.info("%s ready on %s as %s", model_name, device, consumer)
    gc.collect()
    gc.freeze()
    backoff = 0.1
    while not (loop.stopping and len(loop.former) == 0):
        try:
            loop.step()
            backoff = 0.1
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            log.warning("Redis unreachable (%s); retrying in %.1fs", exc, backoff)
            time.sleep(backoff)
            backoff = min(backoff * 2, 5.0)
    heartbeat.stop()
    log.info("%s stopped after %d batches, %d rows", consumer, loop.batches, loop.rows)


def _retry(action: Any) -> None:
    delay = 0.1
    while True:
        try:
            action()
            return
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            log.warning("Redis unreachable (%s); retrying", exc)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)
