"""Every Redis key conveyor uses is built here; no key strings elsewhere.

``{model}`` in braces is a Redis Cluster hash tag: all keys of one model share a slot,
so multi-key commands on them stay legal in a cluster.
"""

from __future__ import annotations

from dataclasses import dataclass

GROUP = "workers"
"""The consumer group every inference process reads a model's streams with."""


@dataclass(frozen=True, slots=True)
class Keys:
    prefix: str = "cv"

    def queue(self, model: str, priority: int) -> str:
        """Stream of requests of one priority level (1 = highest)."""
        return f"{self.prefix}:{{{model}}}:q:{priority}"

    def queues(self, model: str, levels: int) -> list[str]:
        """A model's request streams, highest priority first."""
        return [self.queue(model, p) for p in range(1, levels + 1)]

    def rows_waiting(self, model: str) -> str:
        """Counter of rows admitted and not yet answered (the queue limit's measure)."""
        return f"{self.prefix}:{{{model}}}:rows"

    def reply(self, api_id: str) -> str:
        """List of encoded replies for one API process."""
        return f"{self.prefix}:reply:{api_id}"

    def dead_letter(self, model: str) -> str:
        return f"{self.prefix}:{{{model}}}:dlq"

    def stats(self, model: str) -> str:
        """Hash of counters the workers add to with every batch (Triton's statistics)."""
        return f"{self.prefix}:{{{model}}}:stats"

    def repository(self) -> str:
        """Hash: model -> JSON {state: loaded|unloaded, ts}, set by repository load/unload."""
        return f"{self.prefix}:repository"

    def control(self, model: str) -> str:
        """Hash of run-time batching overrides (max_queue_delay_us, max_batch_size)."""
        return f"{self.prefix}:{{{model}}}:control"

    def workers(self, model: str) -> str:
        """Hash: consumer name -> heartbeat JSON."""
        return f"{self.prefix}:{{{model}}}:workers"
