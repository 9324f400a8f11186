"""Storing a job's finished chunks: each once, its rows counted once into the job's
progress and once into the model's ``job_rows``.

The job runner counts a chunk as stored only once :meth:`ChunkStore.store` returned. A
write that raised (Redis lost, a failover) may or may not have landed, and the chunk's
reply is gone from the reply list either way, so the runner sends the chunk again.
``job_store.lua`` makes that second store harmless: a chunk already in the job's chunks
hash adds no rows to ``done`` (same slot, one script: exact). ``job_rows`` lives on the
model's slot, so it is added after the script: for a chunk whose earlier write raised,
the rows are added whether or not that write had landed, as it never got that far.
"""

from __future__ import annotations

import logging
from typing import Any

import redis

from batching.envelope import Tensor
from batching.job_record import STORE_LUA, JobRecord, Rows, pack_tensors
from batching.keys import Keys
from batching.redis_errors import REDIS_FAILED

log = logging.getLogger("conveyor.jobs")


class ChunkStore:
    """Writes one job's finished chunks into ``cv:job:{id}:chunks``."""

    def __init__(self, client: redis.Redis, keys: Keys, record: JobRecord) -> None:
        self.client = client
        self._script = client.register_script(STORE_LUA)
        self._keys = [keys.job_chunks(record.id), keys.job(record.id)]
        self._stats = keys.stats(record.model)
        self._job_id = record.id
        self._unsure: set[int] = set()
        """Chunks whose write raised: landed or not, their rows are not in job_rows yet."""

    def store(self, finished: dict[int, list[Tensor]], rows: Rows) -> int:
        """Store ``finished`` (chunk index -> outputs); return the job's rows done.

        Raises what Redis raised, and then none of them counts as stored.
        """
        args: list[Any] = []
        for index, outputs in finished.items():
            args += [index, pack_tensors(outputs), rows.rows(index)]
        try:
            done, *new = self._script(keys=self._keys, args=args)
        except Exception:
            self._unsure.update(finished)
            raise
        counted = sum(rows.rows(i) for i in finished if i in new or i in self._unsure)
        self._unsure.difference_update(finished)
        if counted:
            try:  # a counter (on the model's slot), best effort: lost in an outage, never doubled
                self.client.hincrby(self._stats, "job_rows", counted)
            except REDIS_FAILED as exc:
                log.warning("job %s: %d rows left out of job_rows: %s", self._job_id,
                            counted, exc)
        return int(done)
