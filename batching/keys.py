"""Every Redis key conveyor uses is built here; no key strings elsewhere.

``{model}`` in braces is a Redis Cluster hash tag: all keys of one model share a slot,
so multi-key commands on them stay legal in a cluster. A model with ``queue.partitions``
N above 1 has N sets of streams, rows counter and withdrawn set: partition 0 under
``{model}`` (the layout of a model with one partition), partition p under ``{model#p}``,
each its own slot, so one model's requests spread over up to N nodes of a cluster. Model
names never hold ``#`` (batching/names.py), so no model's tag is another's partition.
"""

from __future__ import annotations

from dataclasses import dataclass

GROUP = "workers"
"""The consumer group every inference process reads a model's streams with."""


COMPUTE_PHASES = ("compute_input", "compute_infer", "compute_output")
"""Fields of a model's stats hash (``{phase}_count``, ``{phase}_ns`` and per batch size
``batch:{rows}:{phase}_ns``): stacking inputs, running the model, packing outputs."""


@dataclass(frozen=True, slots=True)
class Partition:
    """The keys of one partition of a model: what admission, release, withdrawal and
    reconciliation touch together, all in one slot."""

    streams: tuple[str, ...]
    """Its request streams, highest priority first."""
    rows: str
    """Its rows-waiting counter."""
    withdrawn: str
    """Its withdrawn set."""


def _tag(model: str, partition: int) -> str:
    """The hash tag of a model's partition: ``{model}`` for partition 0."""
    return f"{{{model}}}" if partition == 0 else f"{{{model}#{partition}}}"


@dataclass(frozen=True, slots=True)
class Keys:
    prefix: str = "cv"

    def queue(self, model: str, priority: int, partition: int = 0) -> str:
        """Stream of requests of one priority level (1 = highest) of one partition."""
        return f"{self.prefix}:{_tag(model, partition)}:q:{priority}"

    def queues(self, model: str, levels: int, partition: int = 0) -> list[str]:
        """A partition's request streams, highest priority first."""
        return [self.queue(model, p, partition) for p in range(1, levels + 1)]

    def rows_waiting(self, model: str, partition: int = 0) -> str:
        """Counter of rows admitted and not yet answered in one partition (the queue
        limit's measure)."""
        return f"{self.prefix}:{_tag(model, partition)}:rows"

    def partition(self, model: str, levels: int, partition: int) -> Partition:
        """The keys of one partition of a model of ``levels`` priority levels."""
        return Partition(tuple(self.queues(model, levels, partition)),
                         self.rows_waiting(model, partition),
                         self.withdrawn(model, partition))

    def partitions(self, model: str, levels: int, count: int) -> list[Partition]:
        """Every partition of a model (``count``: its ``queue.partitions``), 0 first."""
        return [self.partition(model, levels, p) for p in range(count)]

    def reply(self, api_id: str) -> str:
        """List of encoded replies for one API process; ``{api_id}`` is its hash tag (each
        API process's list lives on its own slot of a cluster)."""
        return f"{self.prefix}:reply:{{{api_id}}}"

    def dead_letter(self, model: str) -> str:
        return f"{self.prefix}:{{{model}}}:dlq"

    def suspects(self, model: str) -> str:
        """Hash: consumer name -> the re-delivered entry it is running alone, the one a
        crash of that consumer is blamed on."""
        return f"{self.prefix}:{{{model}}}:suspects"

    def withdrawn(self, model: str, partition: int = 0) -> str:
        """Sorted set of a partition's entries whose clients left after a worker read them:
        member "<stream> <entry id>", score the request's deadline (ms). The worker
        holding one drops it unrun (batching/lua/withdraw.lua)."""
        return f"{self.prefix}:{_tag(model, partition)}:withdrawn"

    def stats(self, model: str) -> str:
        """Hash of counters the workers add to with every batch (Triton's statistics)."""
        return f"{self.prefix}:{{{model}}}:stats"

    def repository(self) -> str:
        """Hash: model -> JSON {state: loaded|unloaded, ts}, set by repository load/unload."""
        return f"{self.prefix}:repository"

    def shm_regions(self, host: str) -> str:
        """Hash: system shared memory region name -> JSON {key, offset, byte_size, token},
        for the API processes that share one ``/dev/shm`` (``host``: api.shm_region)."""
        return f"{self.prefix}:shm:{host}"

    def control(self, model: str) -> str:
        """Hash of run-time batching overrides (max_queue_delay_us, max_batch_size)."""
        return f"{self.prefix}:{{{model}}}:control"

    def workers(self, model: str) -> str:
        """Hash: consumer name -> heartbeat JSON."""
        return f"{self.prefix}:{{{model}}}:workers"

    def job(self, job_id: str) -> str:
        """Hash of one async job: model, state, progress, timestamps, error, parameters.

        ``{job_id}`` is the job's hash tag: every key of one job lives on one slot.
        """
        return f"{self.prefix}:job:{{{job_id}}}"

    def job_input(self, job_id: str) -> str:
        """The job's input tensors, packed (deleted when the job ends)."""
        return f"{self.job(job_id)}:input"

    def job_chunks(self, job_id: str) -> str:
        """Hash: chunk index -> packed output tensors; the result once the job succeeds."""
        return f"{self.job(job_id)}:chunks"

    def job_lease(self, job_id: str) -> str:
        """Token of the job task running the job, with a TTL it keeps renewing."""
        return f"{self.job(job_id)}:lease"

    def job_replies(self, job_id: str) -> str:
        """List of encoded replies to the job's chunks (the job's own reply list)."""
        return f"{self.job(job_id)}:replies"

    def jobs_active(self) -> str:
        """Set of ids of jobs not yet finished (what the job reaper looks at)."""
        return f"{self.prefix}:jobs:active"

    def jobs_counted(self) -> str:
        """Hash: job state -> jobs in it now (PENDING, RUNNING) or that ended in it
        (SUCCEEDED, FAILED, CANCELLED), kept up to date with each move (the metrics)."""
        return f"{self.prefix}:jobs:counted"

    def jobs_listed(self, owner: str) -> str:
        """Sorted set of the most recent job ids (score: creation time) of one owner (the
        digest of its API key), or of every job for ``owner`` "" (``GET /v1/jobs``)."""
        return f"{self.prefix}:jobs:listed:{owner or 'all'}"

    def celery(self) -> str:
        """Prefix of Celery's own keys (broker queues, events, results): stacks that share a
        Redis under different prefixes never exchange tasks or events."""
        return f"{self.prefix}:celery:"
