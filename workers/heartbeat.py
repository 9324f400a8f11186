"""An inference process announces its state in the model's heartbeat hash, once a second.

Each beat also carries the process's resident memory (``rss_bytes``), read as it beats:
loading a model is when it grows most."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import redis
from redis.exceptions import RedisError

from batching.keys import Keys
from batching.process_memory import resident_bytes


class Heartbeat:
    """Background thread writing ``consumer -> {state, device, pid, ts, rss_bytes, ...}``."""

    def __init__(self, client: redis.Redis, keys: Keys, model: str, consumer: str,
                 device: str, interval_s: float,
                 on_beat: Callable[[], None] | None = None) -> None:
        self._redis = client
        self._key = keys.workers(model)
        self._consumer = consumer
        self._interval_s = interval_s
        self._on_beat = on_beat
        self._stop = threading.Event()
        self.info: dict[str, Any] = {"state": "loading", "model": model, "device": device,
                                      "pid": os.getpid(), "host": socket.gethostname(),
                                      "consumer": consumer}
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def update(self, **info: Any) -> None:
        self.info.update(info)
        self.beat()

    def start(self) -> None:
        self.beat()
        self._thread.start()

    def stop(self) -> None:
        """Stop beating and remove this consumer's entry."""
        self._stop.set()
        self._thread.join(timeout=self._interval_s * 2)
        with contextlib.suppress(RedisError):
            self._redis.hdel(self._key, self._consumer)

    def beat(self) -> None:
        if self._on_beat is not None:
            self._on_beat()
        # While Redis is down beats are lost; the first one after it returns re-announces us.
        with contextlib.suppress(RedisError):
            self._redis.hset(self._key, self._consumer,
                             json.dumps({**self.info, "ts": time.time(),
                                         "rss_bytes": resident_bytes()}))

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.beat()
