"""The metric table (api/metric_defs.py) against what a scrape exports and what the docs
list, and the pure pieces the shared metrics are computed with."""

from __future__ import annotations

import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from api.metric_defs import ALL
from api.metrics import ApiMetrics, http_code
from api.metrics_doc import DOC, END, render
from api.metrics_shared import drain_s, instances
from batching.histograms import (
    LATENCY_BUCKETS,
    batch_sizes,
    cumulative,
    execution_field,
    execution_times,
)
from batching.service_rate import ServiceRate


def scraped(metrics: ApiMetrics) -> dict[str, list[tuple[dict[str, str], float]]]:
    return {f.name: [(s.labels, s.value) for s in f.samples]
            for f in text_string_to_metric_families(metrics.exposition().decode())}


def busy_metrics() -> ApiMetrics:
    """Metrics with every kind of shared state filled in, as a scrape would find it."""
    metrics = ApiMetrics()
    shared = metrics._shared
    shared.model_states = {"m": "READY"}
    shared.depth = {("m", "1"): 3}
    shared.oldest_s = {("m", "1"): 1.5}
    shared.waiting = {"m": 3}
    shared.totals = {"m": {"batch:2:count": 2, "batch:2:ns": 10**9, "exec_le:0.5": 2,
                           "reason:full": 2, "inference_count": 4, "job_rows": 1}}
    shared.jobs = {"PENDING": 1, "SUCCEEDED": 2}
    shared.beats = {"m": [{"consumer": "h:1:m:cuda:0:0", "state": "ready", "row_cap": 8,
                           "rss_bytes": 1000, "host": "h", "device": "cuda:0",
                           "gpu_memory": {"used": 1, "total": 2},
                           "policy": {"arrival_rate_per_s": 5.0, "latency_a_s": 0.1,
                                      "latency_b_s_per_row": 0.01},
                           "service_rows_per_s": 2.0}]}
    return metrics


def test_a_scrape_exports_exactly_the_metrics_of_the_table() -> None:
    exported = {name for name in scraped(busy_metrics())  # the parser splits off _created
                if not name.endswith("_created")}
    assert exported == {m.base for m in ALL}


def test_docs_metrics_md_lists_the_table_as_written() -> None:
    text = DOC.read_text()
    assert render(text) == text, "docs/metrics.md is out of date: run python -m api.metrics_doc"
    for metric in ALL:
        assert f"| `{metric.name}` | {metric.kind} |" in text


def test_a_metric_left_out_of_the_docs_is_caught() -> None:
    text = DOC.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `conveyor_jobs` |"))
    assert render(text.replace(row + "\n", "")) != text.replace(row + "\n", "")
    with pytest.raises(ValueError):
        render(text.replace(END, "", 1))


def test_resident_memory_of_the_api_and_of_workers_is_one_family() -> None:
    samples = scraped(busy_metrics())["conveyor_process_resident_memory_bytes"]
    roles = {labels["role"]: value for labels, value in samples}
    assert roles["api"] > 0 and roles["worker"] == 1000


def test_shared_state_reads_as_prometheus_families() -> None:
    families = scraped(busy_metrics())
    assert ({"model": "m", "le": "2.0"}, 2) in families["conveyor_batch_size"]
    assert ({"model": "m", "le": "1.0"}, 0) in families["conveyor_batch_size"]
    assert ({"model": "m"}, 4.0) in [(lbl, v) for lbl, v in families["conveyor_batch_size"]
                                     if "le" not in lbl]  # the _sum: rows
    assert ({"model": "m", "le": "0.2"}, 0) in families["conveyor_batch_execution_seconds"]
    assert ({"model": "m", "le": "0.5"}, 2) in families["conveyor_batch_execution_seconds"]
    assert ({"model": "m"}, 1.5) in families["conveyor_queue_drain_seconds"]
    assert ({"model": "m"}, 4) in families["conveyor_rows"]
    assert ({"state": "PENDING"}, 1) in families["conveyor_jobs"]
    assert ({"state": "RUNNING"}, 0) in families["conveyor_jobs"]
    assert ({"state": "SUCCEEDED"}, 2) in families["conveyor_jobs_finished"]
    state = families["conveyor_model_instance_state"]
    assert ({"model": "m", "consumer": "h:1:m:cuda:0:0", "state": "ready"}, 1) in state
    assert ({"model": "m", "consumer": "h:1:m:cuda:0:0", "state": "failed"}, 0) in state


@pytest.mark.parametrize("outcome,code", [("success", "200"), ("invalid_input", "400"),
                                          ("overloaded", "503"), ("deadline_exceeded", "504"),
                                          ("no_such_code", "500")])
def test_the_code_label_is_the_outcome_s_http_status(outcome: str, code: str) -> None:
    assert http_code(outcome) == code


def test_execution_times_count_in_the_bucket_of_their_upper_bound() -> None:
    assert execution_field(0.0001) == "exec_le:0.0005"
    assert execution_field(0.5) == "exec_le:0.5"
    assert execution_field(0.51) == "exec_le:1.0"
    assert execution_field(31.0) == "exec_le:+Inf"
    counted = {execution_field(s): 1 for s in (0.0001, 0.51, 31.0)}
    assert execution_times(counted) == {0.0005: 1, 1.0: 1, math.inf: 1}
    buckets = dict(cumulative(execution_times(counted), LATENCY_BUCKETS))
    assert (buckets["0.0005"], buckets["0.5"], buckets["1.0"], buckets["30.0"],
            buckets["+Inf"]) == (1, 1, 2, 2, 3)


def test_batch_sizes_come_from_the_per_size_batch_counts() -> None:
    counters = {"batch:3:count": 2, "batch:3:ns": 5, "batch:8:count": 1, "batches:x": 9}
    assert batch_sizes(counters) == {3.0: 2, 8.0: 1}
    assert cumulative(batch_sizes(counters), (2, 4, 8)) == [
        ("2.0", 0), ("4.0", 2), ("8.0", 3), ("+Inf", 3)]


def test_drain_time_is_zero_when_empty_and_infinite_when_nothing_serves() -> None:
    ready = {"state": "ready", "service_rows_per_s": 100.0}
    assert drain_s(0, []) == 0
    assert drain_s(50, []) == math.inf
    assert drain_s(50, [{"state": "ready", "service_rows_per_s": 0.0}]) == math.inf
    assert drain_s(50, [{"state": "loading", "service_rows_per_s": 100.0}]) == math.inf
    assert drain_s(50, [ready, ready]) == 0.25


def test_a_slot_counts_only_while_no_process_of_it_beats() -> None:
    process = {"consumer": "h:20:m:cpu:0", "state": "loading"}
    slot = {"consumer": "h:10:m:cpu:0:slot", "state": "loading"}
    other = {"consumer": "h:10:m:cpu:1:slot", "state": "failed"}
    assert instances([process, slot, other]) == [process, other]
    assert instances([slot]) == [slot]


def test_the_service_rate_follows_the_recent_batches() -> None:
    rate = ServiceRate()
    assert rate.rows_per_s == 0
    rate.observe(8, 0.1)
    assert rate.rows_per_s == pytest.approx(80)
    for _ in range(30):
        rate.observe(32, 0.1)
    assert rate.rows_per_s == pytest.approx(320, rel=0.01)
