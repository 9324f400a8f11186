"""The chaos suite: real Redis, real API and workers, concurrent load, and faults.

Every scenario checks that each request got exactly one answer (no client-side errors or
hangs), that the service heals, and that no Redis key leaks. ``CONVEYOR_CHAOS_SCALE``
stretches the load phases (``make chaos`` runs it larger); CI runs scale 1.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import httpx
import pytest

from tests.conftest import MakeStack, Stack
from tests.procs import ROOT, RedisServer, wait_for

pytestmark = pytest.mark.chaos

SCALE = float(os.environ.get("CONVEYOR_CHAOS_SCALE", "1"))
MODELS = ROOT / "tests" / "chaos_models"
CLIENTS = 8


@dataclass
class Outcome:
    sent: float
    took: float
    status: int  # 0: no answer (exception)
    error: str = ""


@dataclass
class Load:
    """Closed-loop clients hammering one model until stopped."""

    url: str
    params: dict[str, Any] = field(default_factory=dict)
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self, clients: int = CLIENTS) -> Load:
        for c in range(clients):
            thread = threading.Thread(target=self._client, args=(c,), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> list[Outcome]:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)
        return self.outcomes

    def _client(self, c: int) -> None:
        with httpx.Client(timeout=60) as client:
            i = 0
            while not self._stop.is_set():
                i += 1
                self.outcomes.append(one(client, self.url, float(c * 100000 + i), self.params))


def one(client: httpx.Client, url: str, value: float,
        params: dict[str, Any] | None = None) -> Outcome:
    body: dict[str, Any] = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [value, 0]}]}
    if params:
        body["parameters"] = params
    sent = time.monotonic()
    try:
        response = client.post(f"{url}/v2/models/work/infer", json=body)
    except httpx.HTTPError as exc:
        return Outcome(sent, time.monotonic() - sent, 0, repr(exc))
    took = time.monotonic() - sent
    if response.status_code == 200:
        assert response.json()["outputs"][0]["data"] == [value + 1, 1.0], "wrong answer"
        return Outcome(sent, took, 200)
    return Outcome(sent, took, response.status_code, response.json()["error"])


def inference_pids(stack: Stack) -> list[int]:
    beats = cast(dict[bytes, bytes], stack.redis().hgetall(f"{stack.prefix}:{{work}}:workers"))
    return [json.loads(v)["pid"] for k, v in beats.items()
            if not k.endswith(b":slot") and json.loads(v).get("state") == "ready"]


def ready(stack: Stack) -> bool:
    return httpx.get(f"{stack.url}/v2/health/ready").status_code == 200


def keys(stack: Stack) -> set[bytes]:
    return {k for k in cast(list[bytes], stack.redis().keys(f"{stack.prefix}:*")) if b":reply:" not in k}


def quiesced(stack: Stack) -> None:
    """No request waits: every admitted row was answered and every reply collected."""
    r = stack.redis()
    wait_for(lambda: int(r.get(f"{stack.prefix}:{{work}}:rows") or 0) == 0
             and not r.keys(f"{stack.prefix}:reply:*"), 15, "the queue to drain")


def report(name: str, outcomes: list[Outcome], **figures: float) -> None:
    by_status: dict[int, int] = {}
    for o in outcomes:
        by_status[o.status] = by_status.get(o.status, 0) + 1
    line = {"scenario": name, "requests": len(outcomes), "by_status": by_status, **figures}
    out = os.environ.get("CONVEYOR_CHAOS_REPORT")
    if out:
        with Path(out).open("a") as f:
            f.write(json.dumps(line) + "\n")
    print(line)


@pytest.fixture
def chaos_stack(make_stack: MakeStack) -> Iterator[Stack]:
    stack = make_stack(MODELS, CONVEYOR_HEARTBEAT_STALE_S="2")
    stack.add_api()
    stack.add_worker()
    stack.wait_ready()
    with httpx.Client() as client:  # creates the model's counters: keys() compares after this
        assert one(client, stack.url, 0.0).status == 200
    yield stack


def test_kill_every_inference_process_mid_load(chaos_stack: Stack) -> None:
    stack = chaos_stack
    before = keys(stack)
    load = Load(stack.url).start()
    time.sleep(1.5 * SCALE)
    victims = inference_pids(stack)
    assert victims
    killed_at = time.monotonic()
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    wait_for(lambda: ready(stack) and set(inference_pids(stack)).isdisjoint(victims), 15,
             "replacement processes")
    with httpx.Client(timeout=15) as client:
        wait_for(lambda: one(client, stack.url, 0.5).status == 200, 15, "full service")
    healed = time.monotonic() - killed_at
    time.sleep(2 * SCALE)
    outcomes = load.stop()
    ok = sum(o.status == 200 for o in outcomes)
    report("kill -9 every inference process", outcomes, success_rate=ok / len(outcomes),
           heal_s=round(healed, 2))
    assert all(o.status for o in outcomes), "a request got no answer"
    assert ok / len(outcomes) >= 0.95, {o.error for o in outcomes if o.status != 200}
    assert healed < 15
    quiesced(stack)
    assert keys(stack) == before


def test_sigstop_hang_times_out_and_the_process_is_replaced(chaos_stack: Stack) -> None:
    stack = chaos_stack
    before = keys(stack)
    load = Load(stack.url, params={"timeout": 1_000_000}).start(4)
    time.sleep(1 * SCALE)
    [victim] = inference_pids(stack)
    os.kill(victim, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        # Heartbeat stale after 2 s, SIGTERM, SIGKILL 2 s later, back-off, reload.
        wait_for(lambda: ready(stack) and victim not in inference_pids(stack), 20,
                 "the hung process to be replaced")
    finally:
        if os.path.exists(f"/proc/{victim}"):
            os.kill(victim, signal.SIGKILL)
    replaced = time.monotonic() - stopped_at
    time.sleep(1 * SCALE)
    outcomes = load.stop()
    report("SIGSTOP an inference process", outcomes, replaced_s=round(replaced, 2))
    # Entries of timed-out requests hold their rows until answered, so a long hang can
    # also fill the queue: 503 (a full queue) is a correct answer then.
    assert all(o.status in (200, 504, 503) for o in outcomes), {o.error for o in outcomes}
    timeouts = [o for o in outcomes if o.status == 504]
    assert timeouts, "requests queued behind the hung process should time out"
    # answered at their 1 s deadline, not held until the process is replaced (over 7 s);
    # a throttled CI host once took 1.73 s to deliver a 504
    assert max(o.took for o in timeouts) < 1.0 + 1.5
    assert replaced < 3 + 2 + 2 + 5  # execution_timeout_s + grace + back-off + reload
    assert any(o.status == 200 and o.sent > stopped_at + replaced for o in outcomes)
    quiesced(stack)
    assert keys(stack) == before


def test_poison_request_fails_alone(chaos_stack: Stack) -> None:
    stack = chaos_stack
    before = keys(stack)
    results: dict[float, Outcome] = {}

    def send(value: float) -> None:
        with httpx.Client(timeout=60) as client:
            results[value] = one(client, stack.url, value)

    threads = [threading.Thread(target=send, args=(v,)) for v in [-1.0, *range(1, 16)]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    poison = results.pop(-1.0)
    report("poison request", [poison, *results.values()])
    assert poison.status == 500 and "dead-letter" in poison.error
    assert all(o.status == 200 for o in results.values()), {o.error for o in results.values()}
    dlq = f"{stack.prefix}:{{work}}:dlq".encode()
    assert stack.redis().xlen(dlq) == 1
    quiesced(stack)
    assert keys(stack) - before == {dlq}


@pytest.mark.serial  # its latency bound holds on two cores, not beside another test's stack
def test_overload_gets_fast_503s_and_accepted_requests_stay_fast(make_stack: MakeStack,
                                                                  tmp_path: Path) -> None:
    shutil.copytree(MODELS / "work", tmp_path / "work")
    config = tmp_path / "work" / "config.yaml"
    config.write_text(config.read_text().replace("max_queue_rows: 64", "max_queue_rows: 8")
                      .replace("latency_target_ms: 500", "latency_target_ms: 1000"))
    stack = make_stack(tmp_path)
    stack.add_api()
    stack.add_worker()
    stack.wait_ready()
    api_pid = stack.apis[0][0].pid
    rss_before = _rss_mb(api_pid)
    load = Load(stack.url).start(24)  # the queue holds 8 rows: 3x what it admits
    time.sleep(3 * SCALE)
    outcomes = load.stop()
    accepted = sorted(o.took for o in outcomes if o.status == 200)
    rejected = sorted(o.took for o in outcomes if o.status == 503)
    p99 = accepted[int(len(accepted) * 0.99)]
    report("overload", outcomes, accepted_p99_ms=round(p99 * 1000, 1),
           rejected_median_ms=round(statistics.median(rejected) * 1000, 1))
    assert {o.status for o in outcomes} <= {200, 503}, {o.error for o in outcomes}
    assert rejected and accepted
    # At most 8 rows wait (a few 10 ms batches), so accepted requests stay well inside the
    # target even on a busy 2-core CI machine; a full-queue 503 costs one Redis round trip.
    assert p99 < 1.0  # latency_target_ms of the model
    assert statistics.median(rejected) < 0.25
    assert _rss_mb(api_pid) - rss_before < 100
    quiesced(stack)


def test_redis_outage_fast_503_then_full_service(make_stack: MakeStack, logdir: Path) -> None:
    server = RedisServer(logdir)
    try:
        stack = make_stack(MODELS)
        stack.redis_url = server.url
        stack.add_api()
        worker = stack.add_worker()
        stack.wait_ready()
        api_pid, worker_pid = stack.apis[0][0].pid, worker.pid
        with httpx.Client(timeout=30) as client:
            assert one(client, stack.url, 1.0).status == 200
            server.stop()
            outage = [one(client, stack.url, 2.0) for _ in range(5)]
            assert all(o.status == 503 and o.took < 1.0 for o in outage), outage
            wait_for(lambda: not ready(stack), 5, "readiness to turn false")
            assert httpx.get(f"{stack.url}/v2/health/live").status_code == 200
            time.sleep(1 * SCALE)
            server.start()
            back = time.monotonic()
            wait_for(lambda: one(client, stack.url, 3.0).status == 200, 30, "service to return")
            wait_for(lambda: ready(stack), 10, "readiness to return")
            report("redis outage", outage, recovered_s=round(time.monotonic() - back, 2))
        assert stack.apis[0][0].alive() and worker.alive()
        assert (stack.apis[0][0].pid, worker.pid) == (api_pid, worker_pid)
    finally:
        server.stop()


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no RSS for {pid}")


def test_redis_restarted_empty_under_load_heals(make_stack: MakeStack, logdir: Path, tmp_path: Path) -> None:
    """Item 12 of issue 10: Redis SIGKILLed and restarted without persistence while many
    clients with deadlines fill a small queue and CPU hogs overload the host. Every request
    is answered quickly, and soon after the restart the counter matches the streams: plain
    requests succeed and no full-queue 503 lingers."""
    shutil.copytree(MODELS / "work", tmp_path / "work")
    config = tmp_path / "work" / "config.yaml"
    # A fixed 0.3 s window: the worker holds entries read before Redis dies and answers
    # them after it is back (their rows must not be released twice).
    config.write_text(config.read_text().replace("max_queue_rows: 64", "max_queue_rows: 12")
                      .replace("latency_target_ms: 500",
                               "adaptive: false\n  max_queue_delay_us: 300000"))
    server = RedisServer(logdir)
    hogs: list[subprocess.Popen[bytes]] = []
    try:
        stack = make_stack(tmp_path, CONVEYOR_HEARTBEAT_STALE_S="2")
        stack.redis_url = server.url
        stack.add_api()
        stack.add_worker()
        stack.wait_ready()
        deadline_s = 2.0
        load = Load(stack.url, params={"timeout": int(deadline_s * 1e6)}).start(16)
        hog_s = 6 + 4 * SCALE
        hogs = [subprocess.Popen([sys.executable, "-c", _HOG, str(hog_s)]) for _ in range(2)]
        time.sleep(2 * SCALE)
        server.stop()  # SIGKILL: everything Redis held is gone
        time.sleep(1)
        server.start()  # empty: no persistence
        back = time.monotonic()
        # As if the counter had outlived its entries (a partial restore, an evicted stream):
        # without reconciliation every request from now on would get a full-queue 503.
        stack.redis().set(f"{stack.prefix}:{{work}}:rows", 12)
        time.sleep(3 + 2 * SCALE)
        outcomes = load.stop()
        with httpx.Client(timeout=30) as client:  # the load is gone: nothing may be refused
            after = [one(client, stack.url, 8.0) for _ in range(20)]
        healed = min((o.sent + o.took - back for o in outcomes
                      if o.status == 200 and o.sent > back), default=float("inf"))
        report("redis restarted empty under load", outcomes, heal_s=round(healed, 2))
        assert all(o.status in (200, 503, 504) for o in outcomes), \
            {(o.status, o.error) for o in outcomes if o.status not in (200, 503, 504)}
        slow = [o for o in outcomes if o.took > deadline_s + 3.0]
        assert not slow, slow[:5]
        assert healed < 3 + 2 * SCALE
        assert all(o.status == 200 for o in after), {(o.status, o.error) for o in after}
        r = stack.redis()
        wait_for(lambda: int(r.get(f"{stack.prefix}:{{work}}:rows") or 0) == 0, 10,
                 "the rows-waiting counter to match the empty streams")
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
        server.stop()


_HOG = "import sys, time\nend = time.time() + float(sys.argv[1])\nwhile time.time() < end: pass\n"
"""A CPU hog that ends by itself: an overloaded host for a bounded time."""
