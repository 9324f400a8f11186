"""deploy/grafana/conveyor.json and deploy/prometheus/alerts.yml: well formed, and every
metric they query is one the API exports (api/metric_defs.py, which docs/metrics.md lists).

``promtool`` (Debian: ``apt-get install --no-install-recommends prometheus``) checks the
rules and runs their unit tests (deploy/prometheus/alerts_test.yml); without it those two
tests are skipped, saying why.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from api.metric_defs import ALL
from tests.procs import ROOT

DASHBOARD = ROOT / "deploy" / "grafana" / "conveyor.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
ALERT_TESTS = ROOT / "deploy" / "prometheus" / "alerts_test.yml"

KUBE_STATE_METRICS = {"kube_deployment_status_replicas_ready", "kube_deployment_spec_replicas",
                      "kube_pod_container_status_restarts_total"}
"""What the alert rules take from kube-state-metrics (never the dashboard)."""

PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool",
                "and", "or", "unless", "offset", "inf", "nan"}
QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
BRACED = re.compile(r"\{[^{}]*\}|\[[^\[\]]*\]")
GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
NAME = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: identifiers that are neither functions,
    keywords, label names nor numbers."""
    text = QUOTED.sub('""', expr)
    text = BRACED.sub(" ", text)
    text = GROUPING.sub(" ", text)
    names = set()
    for match in NAME.finditer(text):
        rest = text[match.end():].lstrip()
        if rest.startswith("(") or match.group().lower() in PROMQL_WORDS:
            continue
        if match.start() and (text[match.start() - 1].isdigit() or text[match.start() - 1] == "."):
            continue  # the exponent or unit of a number: 1e3, 5m
        names.add(match.group())
    return names


def documented_metrics() -> set[str]:
    text = (ROOT / "docs" / "metrics.md").read_text()
    return set(re.findall(r"^\| `(conveyor_[a-z0-9_]+)` \|", text, re.MULTILINE))


def exported_names() -> set[str]:
    """The series names of every metric the API exports (a histogram's three kinds)."""
    names = {m.name for m in ALL}
    return names | {f"{m.name}{suffix}" for m in ALL if m.kind == "histogram"
                    for suffix in ("_bucket", "_count", "_sum")}


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def dashboard_exprs() -> Iterator[tuple[str, str]]:
    for panel in dashboard()["panels"]:
        for target in panel["targets"]:
            yield panel["title"], target["expr"]


def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


@pytest.mark.parametrize(("expr", "names"), [
    ('sum by (model, le) (rate(conveyor_a_bucket{model=~"$model", code=~"5.."}[$__rate_interval]))',
     {"conveyor_a_bucket"}),
    ('max by (model) (x_total) > 5 unless on (model) (y{state="ready"} == 1)', {"x_total", "y"}),
    ("histogram_quantile(0.99, sum by (le) (rate(z_bucket[5m]))) * 1e3 > 0.5", {"z_bucket"}),
    ('(max(jobs{state="PENDING"}) or vector(0)) == 0 and on () up offset 5m', {"jobs", "up"}),
])
def test_metric_names_are_found_in_promql(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


def test_docs_metrics_table_is_read() -> None:
    names = documented_metrics()
    assert {"conveyor_requests_total", "conveyor_queue_depth", "conveyor_oom_total",
            "conveyor_dead_letter_total", "conveyor_gpu_memory_used_bytes"} <= names


def test_dashboard_panels_are_complete() -> None:
    board = dashboard()
    panels = board["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        grid = panel["gridPos"]
        assert all(isinstance(grid[k], int) for k in ("h", "w", "x", "y")), panel["title"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        assert all(t["expr"].strip() and t["datasource"] == panel["datasource"]
                   for t in panel["targets"]), panel["title"]
    cells = [(p["gridPos"]["x"], p["gridPos"]["y"]) for p in panels]
    assert len(cells) == len(set(cells)), "two panels at one place"


def test_dashboard_selects_models_with_a_template_variable() -> None:
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    model = variables["model"]
    assert model["type"] == "query" and model["multi"] and model["includeAll"]
    query = re.fullmatch(r"label_values\((\w+), model\)", model["query"]["query"])
    assert query is not None and query[1] in exported_names()
    per_model = {"conveyor_requests_total", "conveyor_queue_depth", "conveyor_batch_size_bucket",
                 "conveyor_request_duration_seconds_bucket", "conveyor_oom_total"}
    for title, expr in dashboard_exprs():
        if metric_names(expr) & per_model:
            assert 'model=~"$model"' in expr, title


def test_dashboard_queries_only_exported_metrics() -> None:
    allowed = exported_names()
    unknown = {(title, name) for title, expr in dashboard_exprs()
               for name in metric_names(expr) - allowed}
    assert not unknown


def test_dashboard_shows_what_operators_ask_for() -> None:
    used = {name for _, expr in dashboard_exprs() for name in metric_names(expr)}
    assert {"conveyor_request_duration_seconds_count", "conveyor_request_duration_seconds_bucket",
            "conveyor_queue_depth", "conveyor_queue_oldest_age_seconds",
            "conveyor_batch_size_bucket", "conveyor_rows_total", "conveyor_gpu_memory_used_bytes",
            "conveyor_oom_total", "conveyor_worker_restarts_total", "conveyor_dead_letter_total",
            "conveyor_jobs", "conveyor_job_rows_total"} <= used
    codes = [expr for _, expr in dashboard_exprs() if "by (code)" in expr]
    assert codes, "request rate by status code"


def test_alert_rules_query_only_exported_metrics() -> None:
    allowed = exported_names() | KUBE_STATE_METRICS
    for rule in alert_rules():
        assert metric_names(rule["expr"]) <= allowed, rule["alert"]
        assert rule["labels"]["severity"] in {"warning", "critical"}, rule["alert"]
        assert {"summary", "description"} <= set(rule["annotations"]), rule["alert"]


def test_alert_rules_cover_the_failures_operators_page_on() -> None:
    names = {rule["alert"] for rule in alert_rules()}
    assert {"ConveyorQueueAgeHigh", "ConveyorNoReadyWorker", "ConveyorDeadLettersGrowing",
            "ConveyorInferenceRestartLoop", "ConveyorRedisUnreachable",
            "ConveyorJobsNotStarting"} <= names
    tested = {t["alertname"] for case in yaml.safe_load(ALERT_TESTS.read_text())["tests"]
              for t in case["alert_rule_test"]}
    assert len(tested & names) >= 2


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.skip("promtool is not installed (Debian: apt-get install --no-install-recommends "
                    "prometheus)")
    return found


def test_promtool_checks_the_rules() -> None:
    run = subprocess.run([promtool(), "check", "rules", str(ALERTS)], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in run.stdout


def test_promtool_runs_the_rules_unit_tests() -> None:
    run = subprocess.run([promtool(), "test", "rules", str(ALERT_TESTS)], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
