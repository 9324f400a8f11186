"""Triton-style statistics of one executed batch: the counters an inference process adds
to its model's stats hash (what ``/v2/models/{m}/stats`` and the metrics read)."""

from __future__ import annotations

from batching.envelope import Reply
from batching.former import Entry
from batching.histograms import execution_field
from batching.keys import COMPUTE_PHASES


def batch_counters(answered: list[tuple[Entry, Reply]], rows: int, started: float,
                    finished: float, phase_ns: list[int]) -> dict[str, int]:
    """Triton-style statistics of one executed batch, added to the model's stats hash.

    Like Triton, each request in the batch is charged the batch's compute phases. Counters
    that add nothing (``fail_*`` of a batch that all succeeded) are left out: each is a
    ``HINCRBY`` of Redis's, and the stats' readers take a missing field for 0."""
    exec_ns = int((finished - started) * 1e9)
    ok = [e for e, reply in answered if reply.ok]
    failed = [e for e, reply in answered if not reply.ok]
    n = len(answered)

    def since_enqueued_ns(entries: list[Entry], until: float) -> int:
        return sum(int(max(0.0, until * 1000.0 - e.request.enq_ms) * 1e6) for e in entries)

    counters = {
        "inference_count": rows,
        "execution_count": 1,
        "success_count": len(ok),
        "success_ns": since_enqueued_ns(ok, finished),
        "fail_count": len(failed),
        "fail_ns": since_enqueued_ns(failed, finished),
        "queue_count": n,
        "queue_ns": since_enqueued_ns([e for e, _ in answered], started),
        f"batch:{rows}:count": 1,
        f"batch:{rows}:ns": exec_ns,
        execution_field(finished - started): 1,
    }
    for phase, ns in zip(COMPUTE_PHASES, phase_ns, strict=True):
        counters[f"{phase}_count"] = n
        counters[f"{phase}_ns"] = ns * n
        counters[f"batch:{rows}:{phase}_ns"] = ns
    return {name: amount for name, amount in counters.items() if amount}
