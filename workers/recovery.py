"""Taking over the entries of dead or stuck consumers, and dead-lettering repeat offenders.

Entries a process read but never acknowledged stay pending on its consumer. A live
process claims them:
- at once, from consumers with no fresh heartbeat (killed, or frozen: a SIGSTOPped
  process beats no more);
- after ``min_idle`` from any consumer, sized from the slowest recent batch, so that a
  live but wedged process cannot sit on entries forever.
A claim from a dead consumer counts as a delivery only for the entries it may have died
of: those on their first delivery, and the re-delivered entry it was running alone
(:meth:`workers.streams.ModelStreams.on_trial`); a claim from a stuck one counts for
every entry it takes. Past ``max_deliveries`` an entry goes to the model's
dead-letter stream and its client gets a 500 naming the failure.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field

import redis
from redis.exceptions import ResponseError

from batching.former import Entry
from batching.keys import Keys
from workers.streams import ModelStreams

log = logging.getLogger("conveyor.recovery")

CHECK_EVERY_S = 0.5
MIN_IDLE_FLOOR_MS = 5_000
IDLE_BATCHES = 4
"""A live consumer's entry may be claimed after this many of its slowest batches."""
FORGET_CONSUMERS_EVERY_S = 30.0


@dataclass(slots=True)
class Reclaimer:
    client: redis.Redis
    keys: Keys
    model: str
    streams: ModelStreams
    stale_s: float
    slowest_batch_s: float = 0.0
    _next_check: float = 0.0
    _next_forget: float = field(default=0.0)

    @property
    def min_idle_ms(self) -> int:
        return max(MIN_IDLE_FLOOR_MS, int(IDLE_BATCHES * self.slowest_batch_s * 1000))

    def observe_batch(self, seconds: float) -> None:
        """Track a decaying maximum of batch time: recent slow batches dominate."""
        self.slowest_batch_s = max(seconds, self.slowest_batch_s * 0.99)

    def due(self, now: float) -> bool:
        return now >= self._next_check

    def poll(self, now: float, room: int) -> list[Entry]:
        """Claim up to ``room`` entries from dead or stuck consumers (highest priority first)."""
        self._next_check = now + CHECK_EVERY_S
        try:
            return self._poll(now, room)
        except ResponseError as exc:
            self.streams.on_missing_group(exc)
            return []

    def _poll(self, now: float, room: int) -> list[Entry]:
        live = self._live_consumers()
        claimed: list[Entry] = []
        for stream in self.streams.streams:
            for consumer in self.streams.pending_by_consumer(stream):
                if len(claimed) >= room:
                    return claimed
                if consumer != self.streams.consumer and consumer not in live:
                    taken = self.streams.claim_from(stream, consumer, room - len(claimed))
                    if taken:
                        log.warning("claimed %d entries of dead consumer %s", len(taken), consumer)
                    claimed.extend(taken)
            if len(claimed) < room:
                claimed.extend(self.streams.autoclaim(stream, self.min_idle_ms,
                                                      room - len(claimed)))
        if now >= self._next_forget:
            self._next_forget = now + FORGET_CONSUMERS_EVERY_S
            for stream in self.streams.streams:
                self.streams.forget_idle_consumers(stream, live, int(FORGET_CONSUMERS_EVERY_S * 1000))
        return claimed

    def _live_consumers(self) -> set[str]:
        now = time.time()
        beats = self.client.hgetall(self.keys.workers(self.model))
        return {c.decode() if isinstance(c, bytes) else c for c, raw in beats.items()
                if now - float(json.loads(raw).get("ts", 0)) <= self.stale_s}
