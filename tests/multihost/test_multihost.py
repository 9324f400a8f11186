"""conveyor spread over hosts: a Redis host, two API hosts, three worker hosts and a client
host, each a network namespace on one switch (tests/multihost/netns.py), under load through
both APIs while hosts fail and join.

1. **A worker host's link is cut.** Its inference process cannot answer what it read; once
   its heartbeat is ``STALE_S`` old, the other workers claim its pending entries and run
   them. Every request still gets exactly one answer, its own, with status 200.
2. **A fourth worker host comes up.** Same settings as the others, nothing else changed: it
   joins the consumer group and runs batches within seconds of being ready.
3. **One API host's processes are killed** (SIGKILL). Its clients' requests then in flight
   get no HTTP answer (a connection error each, one per client, since a client stops at
   it); the other API's clients see nothing but 200s. A request of the dead API whose
   input was not fetched yet is answered with an error, never run on other bytes.

Each API and worker host has a ``/dev/shm`` of its own, so every input (the APIs count the
echo model's 16 bytes as large) is fetched by the worker from its API host's bytes
endpoint, the path between hosts (docs/data-path.md), and every output as large is uploaded
to it; the chaos below covers both ways.

No event may cause a 5xx or any other HTTP error: the cut is healed by reclaim well within
the requests' deadlines, the new worker only adds capacity, and a dead API answers nothing
at all. ``CONVEYOR_MULTIHOST_SCALE`` multiplies the requests per phase (``make
test-multihost`` runs 10); ``CONVEYOR_MULTIHOST_REPORT`` names a JSON file for the figures.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conveyor.harness import wait_until
from tests.multihost.answers import Answers, lowest_second, rate, slowest
from tests.multihost.netns import Host, Network, sweep_leftovers, unavailable
from tests.multihost.services import STALE_S, Services
from tests.procs import Proc

SCALE = float(os.environ.get("CONVEYOR_MULTIHOST_SCALE", "1"))
PHASE = round(300 * SCALE)
"""200s answered in each phase (before the first event, and after each) at least."""
CLIENTS = 4
"""Clients per API, each on its own keep-alive connection."""
READY_TIMEOUT_S = 180.0
EVENT_TIMEOUT_S = 120.0 * max(1.0, SCALE / 4)
WORK_WITHIN_S = 15.0
"""How soon after its ready heartbeat the fourth worker must have run a batch."""
MIN_SHARE = 0.1
"""The least share of the rows the fourth worker must run while it is one of three."""
CUT_TRIES = 5
CUT_SETTLE_S = 0.3
"""After a cut, how long before the entries stranded with the cut host are counted: what
was on its way to Redis when the link went down has arrived or is lost by then."""

pytestmark = [pytest.mark.multihost, pytest.mark.timeout(600 + 120 * SCALE)]


@pytest.fixture
def network() -> Iterator[Network]:
    why = unavailable()
    if why is not None:
        pytest.skip(why)
    sweep_leftovers()
    net = Network()
    try:
        net.open()
        yield net
    finally:
        net.remove()


@pytest.fixture
def services(network: Network, tmp_path: Path) -> Iterator[Services]:
    started = Services(tmp_path, f"mh{uuid.uuid4().hex[:8]}")
    try:
        yield started
    finally:
        started.stop()


def start_load(services: Services, client: Host, urls: list[str], workdir: Path) -> Proc:
    argv = [sys.executable, "-m", "tests.multihost.load", str(workdir / "answers.jsonl"),
            str(workdir / "stop"), *urls, "--clients", str(CLIENTS)]
    proc = Proc("load", client.argv(argv), {**os.environ, "PYTHONUNBUFFERED": "1"}, workdir)
    services.procs.append(proc)
    return proc


@dataclass
class Run:
    """The processes of one run, and waits that fail as soon as one of the processes
    expected to live has exited."""

    services: Services
    answers: Answers
    alive: list[Proc] = field(default_factory=list)

    def until(self, condition: Callable[[], bool], what: str,
              timeout: float = EVENT_TIMEOUT_S) -> float:
        """Wait for ``condition``; when it first held."""
        try:
            wait_until(condition, timeout, what, interval=0.1, watch=self.alive)
        except (TimeoutError, ChildProcessError) as exc:
            raise AssertionError(f"{exc}\n{self.services.groups()}\n{self.services.logs()}") from None
        return time.monotonic()

    def answered(self, count: int, after: float, what: str, api: int | None = None) -> float:
        """Wait until ``count`` 200s were answered after ``after``."""
        return self.until(lambda: self.answers.read().done_after(after, api) >= count, what)


def cut_holding(run: Run, network: Network, host: Host, victims: set[str]) -> float:
    """Cut ``host``'s link while its worker holds entries (it runs each batch for 20 ms),
    so that they are stranded with it: something to reclaim. A cut that came between its
    batches (it acknowledged what it held while the link went down) is undone and made
    again. When the cut was made."""
    for _ in range(CUT_TRIES):
        run.until(lambda: run.services.pending(victims) > 0, "the third worker to hold entries")
        network.cut(host)
        cut = time.monotonic()
        time.sleep(CUT_SETTLE_S)
        if run.services.pending(victims) > 0:
            return cut
        network.restore(host)
    raise AssertionError(f"the third worker held no entries after each of {CUT_TRIES} cuts")


def worker_share(run: Run, workers: list[Proc], since: float) -> float:
    """The fourth worker's share (the last of ``workers``) of the rows all of them ran from
    now until ``PHASE`` more answers, as their heartbeats tell."""
    first = [run.services.rows(w)[1] for w in workers]
    run.answered(PHASE, since, "answers with four workers")
    wall = time.time()
    run.until(lambda: all(run.services.rows(w)[0] > wall for w in workers), "fresh heartbeats")
    ran = [run.services.rows(w)[1] - n for w, n in zip(workers, first, strict=True)]
    return ran[-1] / max(1, sum(ran))


def test_hosts_fail_and_join_under_load_with_one_answer_per_request(
        network: Network, services: Services, tmp_path: Path) -> None:
    hosts = {name: network.add(name) for name in ("redis", "api1", "api2", "w1", "w2", "w3", "client")}
    run = Run(services, Answers(tmp_path / "answers.jsonl"))
    run.alive.append(services.start_redis(hosts["redis"]))
    apis = [services.start_api(hosts[name]) for name in ("api1", "api2")]
    workers = [services.start_worker(hosts[name]) for name in ("w1", "w2", "w3")]
    run.alive += [proc for proc, _ in apis] + workers
    run.until(lambda: all(services.ready(w) for w in workers),
              "the workers' inference processes to be ready", READY_TIMEOUT_S)
    before = services.stats()
    load = start_load(services, hosts["client"], [url for _, url in apis], tmp_path)
    run.alive.append(load)
    run.until(lambda: run.answers.read().ready is not None, "the client to start", READY_TIMEOUT_S)
    assert run.answers.ready is not None
    started = run.answers.ready
    # Each host has its own /dev/shm: the inputs are fetched from the APIs, not in Redis.
    run.until(lambda: services.fetched() > 0, "an input fetched from its API host")
    # ... and the outputs (as large as the inputs) uploaded to them: Redis carries neither.
    run.until(lambda: any("large outputs go to the API process at" in w.log() for w in workers),
              "an output uploaded to its API host")
    run.answered(PHASE, started, "the first phase")

    # 1. A worker host drops off the network with entries in hand.
    victims = set(services.beats(workers[2]))
    assert victims, "the third worker has no inference process"
    cut = cut_holding(run, network, hosts["w3"], victims)
    run.alive.remove(workers[2])
    seen: dict[str, int] = {}

    def cut_reclaimed() -> bool:
        seen["reclaimed"] = (services.stats().get("reclaimed_count", 0)
                             - before.get("reclaimed_count", 0))
        seen["pending"] = services.pending(victims)
        return (time.monotonic() > cut + STALE_S + 1.5 and seen["reclaimed"] > 0
                and seen["pending"] == 0)

    try:
        reclaimed = run.until(cut_reclaimed, "the cut worker's entries reclaimed")
    except AssertionError as exc:  # which half did not come: the claims, or the answers
        raise AssertionError(f"entries reclaimed, and still pending with the cut worker: "
                             f"{seen}\n{exc}") from None
    run.answered(PHASE, reclaimed, "answers after the cut")

    # 2. A fourth worker host joins: no configuration changes anywhere.
    joined = time.monotonic()
    fourth = services.start_worker(network.add("w4"))
    run.alive.append(fourth)
    ready = run.until(lambda: services.ready(fourth), "the fourth worker to be ready", READY_TIMEOUT_S)
    working = run.until(lambda: services.rows(fourth)[1] > 0, "the fourth worker to run a batch")
    share = worker_share(run, [workers[0], workers[1], fourth], working)

    # 3. One API host's processes die at once.
    killing = time.monotonic()
    apis[1][0].kill_group()
    killed = time.monotonic()
    run.alive.remove(apis[1][0])
    run.until(lambda: len(run.answers.read().failed_clients(1)) == CLIENTS,
              "every client of the dead API to notice")
    run.answered(PHASE, killed, "answers after the API host died", api=0)
    (tmp_path / "stop").touch()
    run.alive.remove(load)
    run.until(lambda: not load.alive(), "the client to finish")
    assert load.popen.returncode == 0, load.tail()
    end = run.answers.read().end
    assert end is not None, load.tail()
    run.until(lambda: services.rows_waiting() == 0, "every admitted row answered")
    after = services.stats()

    answers = run.answers
    requests = answers.requests
    first, second = ([r for r in requests if r["api"] == api] for api in (0, 1))
    # Every request sent has exactly one outcome, and every 200 carries its own input.
    assert end["sent"] == len(requests) == len({(r["client"], r["value"]) for r in requests})
    assert all(r["own"] for r in requests if r["status"] == 200)
    # The first API's clients saw nothing but 200s, before and after every event.
    assert answers.by_status(0) == {"200": len(first)}, [r for r in first if r["status"] != 200][:5]
    # The second API: 200s up to its death, then one connection error per client, on a
    # request in flight at the kill or sent after it; no HTTP error at all.
    assert answers.by_status(1) == {"200": len(second) - CLIENTS, "0": CLIENTS}
    errors = [r for r in second if r["status"] == 0]
    assert all(r["done"] >= killing for r in errors), errors
    assert all(r["sent"] < killed for r in second if r["status"] == 200)
    for client in {r["client"] for r in second}:
        assert [r for r in second if r["client"] == client][-1]["status"] == 0
    # Redis's side: no request answered twice. The dead API's last requests may or may not
    # have been admitted before it died, and run if their inputs had been fetched, else
    # answered with an error (nobody reads it); nothing else failed or was answered
    # without a client seeing it.
    ok = len(requests) - len(errors)
    answered = after["success_count"] - before.get("success_count", 0)
    failed = after.get("fail_count", 0) - before.get("fail_count", 0)
    assert ok <= answered + failed <= ok + len(errors), (ok, answered, failed)
    assert answered >= ok and failed <= len(errors), (ok, answered, failed)
    assert services.pending(victims) == 0
    # The fourth worker ran batches within seconds of its ready heartbeat, and a fair part
    # of the rows: a third would be an even split between the three live workers.
    assert working - ready < WORK_WITHIN_S, working - ready
    assert share >= MIN_SHARE, share

    held = [r for r in requests if cut - 1 <= r["sent"] < cut + 1]  # the cut worker's last read blocks 1 s
    figures = {
        "scale": SCALE, "clients_per_api": CLIENTS, "requests": len(requests),
        "by_status": {"api1": answers.by_status(0), "api2": answers.by_status(1)},
        "api2_errors": sorted({r["error"] for r in errors}),
        "throughput_rps": {
            "before": round(rate(answers, started, cut), 1),
            "after_cut": round(rate(answers, reclaimed, joined), 1),
            "four_workers": round(rate(answers, working, killing), 1),
            "api1_four_workers": round(rate(answers, working, killing, api=0), 1),
            "api1_after_kill": round(rate(answers, killed, end["end"]), 1)},
        "cut": {"reclaimed_entries": after.get("reclaimed_count", 0) - before.get("reclaimed_count", 0),
                "last_held_answer_s": round(max(r["done"] for r in held) - cut, 2),
                "slowest_request_s": round(slowest(answers, cut - 1, cut + 1), 2),
                "lowest_second_rps": lowest_second(answers, cut, reclaimed)},
        "join": {"ready_s": round(ready - joined, 2),
                 "first_batch_after_ready_s": round(working - ready, 2),
                 "rows_share": round(share, 3)},
        "kill": {"in_flight_errors": len(errors),
                 "last_error_s": round(max(r["done"] for r in errors) - killing, 3)},
        "seconds": round(end["end"] - started, 1),
    }
    out = os.environ.get("CONVEYOR_MULTIHOST_REPORT")
    if out:
        Path(out).write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures))
