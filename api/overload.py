"""Refusing at once what this API process can no longer answer in time.

Past what the API process itself can serve (its event loop saturated: on a small host
the clients, the model and the API share the cores), requests wait in the kernel's socket
buffers before the API reads them, where no deadline counts; served in turn, every one is
late for its client, and goodput falls to nothing while the API works at full speed. The
API cannot see how long a request waited unread, but the lateness of its own event loop
(a timer that should fire every ``INTERVAL_S``) measures it: a request read now waited
about that long.

So before a request costs Redis, a worker or the reply path, the API compares the time it
may still take (``parameters.timeout``, or the model's ``default_timeout_ms``) with what
it would cost now: the loop's lag plus the time its recent successful requests of that
model took from the API's reading them to their answer. A request that would not make it
is answered at once, 503 / UNAVAILABLE with ``Retry-After`` (as a full queue is): its
client may retry elsewhere or later, and the API spends its CPU on those that still can.
Below saturation the lag is a millisecond or two and nothing is refused.

The lag bounds the unread wait only while requests queue unread. A client that sends its
next request as soon as it has an answer (a closed loop, or a client retrying a 503 at
once) cannot have one waiting unread longer than its connection has had a request in
hand, however late the loop runs: the lag then measures this process's own work, which
refusing such clients only adds to (a refused request is back within a millisecond). So
when the listener says when the request's connection was last quiet (api/http_guard.py),
the unread wait is at most the time since then.

Such clients can still tip the process into refusing: a lag that rises once (a cold
start, a stall of the host) has it refuse, the refused come back at once, and the loop,
busy refusing them, stays behind; the few requests let through are slow for the same
reason, which keeps the estimate up. So the refusals of requests with that bound (on a
connection answered before) are held to a budget: ``REFUSALS_PER_ANSWER`` for each request
answered, over about the last ``RATE_S``. Past it, they go through, and their queue's
deadline decides. A connection's first request has no bound (its bytes may have waited
with the connection itself, before the accept), so a flood of new connections is refused
whatever the budget. On a busy 2-core host, 64 clients in a closed loop with a 50 ms
timeout, on a model served in 30 ms, had 93% of their requests refused before these two
rules (goodput 1,900 → 100 requests a second: the probes below); with them, in most
seconds none, and at worst 1.4 per answer over a second (see ``RATE_S``).

A refusal still costs the API most of what an answer costs (the HTTP machinery, the
error's write): past capacity, refusals can take more of the process than the answers. So
a request is checked as soon as its timeout is known. Its ``parameters.timeout`` is in
its body, and can only shorten the model's ``default_timeout_ms``: a first check against
that default comes before the body is read (``final=False``), and the check by its own
timeout before its JSON tensors are decoded (api/service.py). On mlp_medium at 2,000
req/s offered on a 2-core host, decoding was about a fifth of the API's CPU samples;
skipping it for the refused requests took 8% off the API's CPU per offered request.

Cheaper still, and judged by the wait itself: for a model whose adaptive policy has
``batching.overload: lifo``, the HTTP listener refuses a request as soon as its headers
are parsed (api/http_guard.py: a pre-encoded 503, its body skipped, no task, no Redis)
in a standing backlog only, as CoDel drops packets: once the requests it reads have
waited unread (the longest they can have, api/turns.py) more than
``TARGET_SHARE`` of the model's latency target (or its default timeout, when sooner) for
``STANDING_S`` on end, and until they have waited less for as long, it refuses those
whose wait plus the time this model's requests take here is more than ``HEADROOM`` of
that budget:
:meth:`Overload.refuses_unread`. Under first come,
first served every request of a standing backlog would be answered late, so refusing by
the timeout only (above) answered nothing in time; refusing those at a fraction of a
served request's cost drains the backlog. A burst, or a turn the host's scheduler made
long, waits above the target for less than ``STANDING_S``: nothing is refused for it
(judged by the longest wait and the loop's lag alone, on a busy 2-core host at half its
capacity, 13% of the requests had been). Nor is a backlog that fewer than ``CLIENTS``
connections of the model can be part of: what waits unread is then someone else's.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from api.turns import TurnClock
from batching.config import ModelConfig
from batching.errors import Overloaded

INTERVAL_S = 0.005
"""How often the loop's lateness is sampled, while requests come."""
IDLE_ROUNDS = 20
"""The sampler stops after this many rounds (100 ms) with no request checked, and the
next request starts it again: an idle process is not woken 200 times a second for
nothing (measured: 3% of a core per idle API process on a 2-core virtual machine). A loop
with no request has none to be late for, so its lag reads 0 meanwhile."""
KEEPING_UP_S = 0.005
"""A lag up to this long is a loop that keeps up: nothing is refused on it."""
SMOOTHING = 0.1
"""Weight of the newest sample: the lag follows the load within about 50 ms, and a single
stall shorter than 50 ms (a busy host's scheduler) leaves it under ``KEEPING_UP_S``."""
PROBE_S = 0.01
"""While refusing, one request of each model still goes through every this often, so that
the time requests take stays measured: judged by the last ones that were served, without
new ones, a refusal would never end."""
UNREAD_TURNS = 1.0
"""Loop turns a request waits, unseen, before the API reads its bytes and starts its clock
(the socket's turn): the unseen wait is about this many times the lag. The request task's
turn, after the read, is on the request's clock (api/http_guard.py ``RECEIVED_AT``), so in
``took_s`` too. Measured before the clock started at the read, when both turns were unseen:
on a saturated 2-core host the refused requests' own latency was 2-3 times the smoothed
lag."""
REFUSALS_PER_ANSWER = 4.0
"""Refusals of requests on connections answered before, per request answered: clients
retrying at once cannot keep the process refusing. A budget of 1 on every request was too
few: at 130% of capacity (open loop on kept-alive connections) the requests it let through
were late by seconds."""
RATE_S = 0.25
"""Time constant of the decaying counts of answers and refusals that the budget compares.
Short, so that the answers of a loop that kept up do not fund a long run of refusals once
it falls behind: over a second, 64 closed-loop clients at capacity on a 2-core host were
still seen refused 3,000 times a second (and answered 270 times) for a second or two at a
time, 2 seconds in 32; over a quarter of one, none in 32 (the worst: 1,009 answered,
1,392 refused)."""

UNREAD_SHARE = 1.0
"""The wait the listener judges a request by, as a share of the longest it can have waited
unread (api/turns.py). Its bytes came at any time in the loop's previous turn, but judged
midway (0.5) the requests let through past capacity were late (on a 2-core host at 110%
of capacity, about 4,900 served a second, 3,000 of them in time)."""
HEADROOM = 0.8
"""In a standing backlog, a request is let through only if its wait plus the time this
model's requests take here is within this share of its budget: what the listener cannot
see (the reply's way back to the client, the client's own turn) comes on top. With both,
on a 2-core host past capacity, 3,900 a second in time at 110% and 3,080 at 125% where
there had been 3,160 and 2,360 (bench/RESULTS-batching.md)."""
TARGET_SHARE = 0.25
"""A wait up to this share of a model's budget is no backlog: no refusal starts."""
STANDING_S = 0.1
"""The listener starts refusing a model's requests only once their wait has been above
``TARGET_SHARE`` of its budget this long on end (a backlog that stands, not a burst or a
long turn of a preempted process), and stops once it has been below as long: stopped at
the first fresh read, it let the backlog grow back in the process (its requests read, in
tasks that wait for the loop) and tests/test_api_shedding.py's served p99 went to 2 s."""

RETURNS_S = 1.0
"""Within this long of the end of a standing backlog, one is back at the first read above
the target (CoDel's memory of its last dropping state): past capacity, one that had to
stand for ``STANDING_S`` again let ``STANDING_S`` of requests in each time."""


@dataclass(slots=True)
class _Run:
    """The current run of a model's reads on one side of its target."""

    above: bool
    since: float
    """When the run began (time.monotonic())."""
    seen: float
    """When its latest read was judged."""
    standing: bool = False
    """A standing backlog: its requests are judged."""
    ended: float = float("-inf")
    """When the latest standing backlog ended."""


CLIENTS = 4
"""The listener refuses a model's requests only where at least this many connections sent
one within about the last ``CLIENTS_S``: a backlog of that model's own. Fewer clients
cannot be one (each has one request in hand at a time), so what waits unread is not theirs
(another model's clients, a flood of new connections, a host that starves the API of its
cores), and refusing their requests would drain nothing: on a 2-core host shared with a
test suite, a fuzzer's flood of new connections had the listener answer a lone client's
request 503."""
CLIENTS_S = 2.0
"""A connection that sent a model nothing for this long is forgotten (checked once every
this long, not on each request: a backlog has thousands of connections)."""
PROBE_WAIT = 0.5
"""A model's probe (one request every ``probe_s`` let through to keep its time measured)
is let through only if it waited at most this share of the budget: one that waited
through a long turn would only be served late."""
DEVIATIONS = 1.0
"""The listener judges a request by the time its model's requests took here plus this many
mean deviations (the mean alone lets through about as many that end up late as not: in
tests/test_api_shedding.py's setting, served p99 146-150 ms against a target of 100; with
two deviations, 108-122 ms). But two refused many requests that would have made it: on
mlp_medium on a 2-core host, A/B in turns (bench/RESULTS-batching.md), goodput within the
target at 125% of capacity was 69%, 76%, 48% of capacity with two and 98%, 99%, 45% with
one, at 95% 89%, 92%, 87% against 94%, 65%, 92%, the served p99 alike (72-97 ms)."""

_ACTIVE: dict[asyncio.AbstractEventLoop, Overload] = {}
"""The started :class:`Overload` of each event loop, for its HTTP listener."""


def active(loop: asyncio.AbstractEventLoop) -> Overload | None:
    """The :class:`Overload` started on ``loop``, if any (the listener's)."""
    return _ACTIVE.get(loop)


@dataclass(slots=True)
class Overload:
    lag_s: float = 0.0
    """The event loop's lateness, smoothed."""
    took_s: dict[str, float] = field(default_factory=dict)
    """Per model, the smoothed time its successful requests took in this process."""
    took_dev_s: dict[str, float] = field(default_factory=dict)
    """Per model, the smoothed absolute deviation of that time from ``took_s``."""
    probe_s: float = PROBE_S
    """While refusing, one request of each model goes through this often."""
    _passed: dict[str, float] = field(default_factory=dict)
    """Per model, when a request last went through (time.monotonic())."""
    interval_s: float = INTERVAL_S
    """The sampler's interval."""
    _timer: asyncio.TimerHandle | None = None
    """The sampler's next round; None while it is stopped."""
    _loop: asyncio.AbstractEventLoop | None = None
    """The loop it samples, once started."""
    _checked: bool = False
    """A request was checked since the last round."""
    _quiet_rounds: int = 0
    _sampled: float = 0.0
    """When the last round ran, or the sampler started again."""
    _aged: float = 0.0
    """When the budget's counts were last aged."""
    _answers: float = 0.0
    """Requests answered, decaying with ``RATE_S`` (aged by the sampler)."""
    _refusals: float = 0.0
    """Requests refused, decaying alike."""
    unread_budget_s: dict[str, float] = field(default_factory=dict)
    """Per ``lifo`` model seen, the longest a request may take, read or unread: its
    latency target, or its default timeout when sooner."""
    turns: TurnClock | None = None
    """The loop's turns, once started (api/turns.py)."""
    standing_s: float = STANDING_S
    """How long a model's requests wait above its target before the listener refuses."""
    _runs: dict[str, _Run] = field(default_factory=dict)
    """Per model, its reads' current run above or below the target."""
    refused_unread: int = 0
    """Requests the listener refused by :meth:`refuses_unread`."""
    _clients: dict[str, dict[int, float]] = field(default_factory=dict)
    """Per model, the connections that sent it a request lately, with when
    (:meth:`_clients_of`)."""
    _forgot: float = float("-inf")
    """When the connections not seen for ``CLIENTS_S`` were last forgotten."""
    counts_refusal: Callable[[str, float], None] | None = None
    """Counts a request the listener refused, once answered (its model, the seconds from
    its read): with the API's other 503s (api/metrics.py ``ApiMetrics.refused``)."""

    def start(self, counts_refusal: Callable[[str, float], None] | None = None) -> None:
        """Start on the running loop, its listener's refusals counted by ``counts_refusal``."""
        self.counts_refusal = counts_refusal
        self._loop = asyncio.get_running_loop()
        self._aged = time.monotonic()
        self.turns = TurnClock(self._loop)
        _ACTIVE[self._loop] = self
        self._resume()

    async def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._loop is not None and _ACTIVE.get(self._loop) is self:
            del _ACTIVE[self._loop]
        self._timer = self._loop = None

    def learn(self, model: str, config: ModelConfig) -> None:
        """Note ``model``'s budget for :meth:`refuses_unread` (only ``lifo`` adaptive
        models have one): the listener judges a model's requests once one has been seen."""
        batching = config.batching
        if batching.adaptive and batching.overload == "lifo":
            self.unread_budget_s[model] = min(batching.latency_target_ms,
                                              config.queue.default_timeout_ms) / 1000.0
        else:
            self.unread_budget_s.pop(model, None)

    def refuses_unread(self, model: str, waited_s: float, client: int) -> bool:
        """Whether a request for ``model`` whose bytes waited up to ``waited_s`` before
        their read is to be refused at once: in a standing backlog (:meth:`_standing`),
        its wait plus the time the model's requests take here (with ``DEVIATIONS``)
        exceeds ``HEADROOM`` of its budget, and at least ``CLIENTS`` connections sent the
        model requests lately (``client``: the request's). One request a model still goes
        through every ``probe_s``, to keep that time measured, if it waited at most
        ``PROBE_WAIT`` of the budget."""
        budget = self.unread_budget_s.get(model)
        if budget is None:
            return False
        waited = UNREAD_SHARE * waited_s
        now = time.monotonic()
        clients = self._clients_of(model, client, now)
        if not self._standing(model, waited_s, waited, TARGET_SHARE * budget, now):
            return False
        if clients < CLIENTS:
            return False  # the backlog is not this model's
        took = self.took_s.get(model, 0.0) + DEVIATIONS * self.took_dev_s.get(model, 0.0)
        if waited + took <= HEADROOM * budget:
            return False
        last = self._passed.get(model)
        if (last is None or now - last >= self.probe_s) and waited <= PROBE_WAIT * budget:
            return False  # a probe, unless its wait alone would make it late
        self.refused_unread += 1
        return True

    def _standing(self, model: str, waited_s: float, waited: float, target: float,
                  now: float) -> bool:
        """Whether ``model``'s requests are in a standing backlog, with one read now that
        waited up to ``waited_s`` (judged ``waited``): they have been above ``target`` for
        ``standing_s`` on end (at once within ``RETURNS_S`` of the end of the last), and
        not below it as long since. One read above is since its wait passed the target
        (a turn longer than ``standing_s`` is a backlog that stood); reads further apart
        than their wait explains (the loop was idle between) are not one run."""
        above = waited > target
        run = self._runs.get(model)
        if run is None or now - run.seen - waited_s > self.standing_s:
            ended = float("-inf") if run is None else run.ended
            run = self._runs[model] = _Run(above, now, now, ended=ended)
        elif run.above != above:
            run.above, run.since = above, now
        if above:
            run.since = min(run.since, now - waited + target)
        run.seen = now
        if run.standing != above and (
                now - run.since >= self.standing_s or now - run.ended < RETURNS_S):
            run.standing = above
            if not above:
                run.ended = now
        return run.standing

    def _clients_of(self, model: str, client: int, now: float) -> int:
        """The connections that sent ``model`` a request lately, ``client`` now among
        them (those not seen for ``CLIENTS_S`` forgotten once every ``CLIENTS_S``)."""
        if now - self._forgot >= CLIENTS_S:
            self._forgot = now
            for seen in self._clients.values():
                for stale in [c for c, at in seen.items() if now - at > CLIENTS_S]:
                    del seen[stale]
        seen = self._clients.setdefault(model, {})
        seen[client] = now
        return len(seen)

    def refusal_answered(self, model: str, seconds: float) -> None:
        """The listener answered a request for ``model`` it refused by
        :meth:`refuses_unread`, ``seconds`` after its read."""
        if self.counts_refusal is not None:
            self.counts_refusal(model, seconds)

    @property
    def sampling(self) -> bool:
        """Whether the lag is being sampled (stopped while no request comes)."""
        return self._timer is not None

    def answered(self, model: str, seconds: float) -> None:
        """A request for ``model`` succeeded ``seconds`` after this process read it."""
        was = self.took_s.get(model)
        self.took_s[model] = seconds if was is None else was + SMOOTHING * (seconds - was)
        dev = self.took_dev_s.get(model, 0.0)
        off = 0.0 if was is None else abs(seconds - was)
        self.took_dev_s[model] = dev + SMOOTHING * (off - dev)
        self._answers += 1.0

    def check(self, model: str, timeout_s: float, unread_at_most: float | None = None, *,
              final: bool = True) -> None:
        """Raise :class:`Overloaded` when a request for ``model`` that may take
        ``timeout_s`` would, by the current lag and recent requests, be answered late.
        Only while the loop is behind: with no lag, the queue and the worker decide.
        ``unread_at_most``: the longest the request can have waited unread, when known.
        ``final=False``: an early check against an upper bound of the request's timeout
        (its model's default, before its body is read); one it passes is checked again,
        with its own timeout, and only that one counts as the model's probe."""
        self._checked = True
        if self._timer is None and self._loop is not None:
            self._resume()
        if self.lag_s <= KEEPING_UP_S:
            return
        unread = UNREAD_TURNS * self.lag_s
        if unread_at_most is not None:
            unread = min(unread, unread_at_most)
        expected = unread + self.took_s.get(model, 0.0)
        now = time.monotonic()
        last = self._passed.get(model)
        if expected <= timeout_s or last is None or now - last >= self.probe_s:
            if final:
                self._passed[model] = now
            return
        if (unread_at_most is not None
                and self._refusals + 1.0 > REFUSALS_PER_ANSWER * self._answers):
            return  # the budget is spent: refusing more would keep the loop behind
        self._refusals += 1.0
        raise Overloaded(
            f"this API process is overloaded: a request now takes about "
            f"{expected * 1e3:.0f} ms to answer here ({unread * 1e3:.0f} ms of it waiting "
            f"to be read), more than its {timeout_s * 1e3:.0f} ms timeout")

    def _resume(self) -> None:
        """Start sampling (again): the next round measures from now."""
        assert self._loop is not None
        self._sampled = time.monotonic()
        self._quiet_rounds = 0
        self._timer = self._loop.call_later(self.interval_s, self._sample)

    def _sample(self) -> None:
        """One round of the sampler: how much later than its interval it came. After
        ``IDLE_ROUNDS`` rounds without a request it stops, the lag set to 0."""
        now = time.monotonic()
        late = max(0.0, now - self._sampled - self.interval_s)
        kept = math.exp((self._aged - now) / RATE_S)  # the budget's counts age here,
        self._answers *= kept                         # not on each request
        self._refusals *= kept
        self._aged = self._sampled = now
        self.lag_s += SMOOTHING * (late - self.lag_s)
        if self._checked:
            self._checked = False
            self._quiet_rounds = 0
        else:
            self._quiet_rounds += 1
        if self._quiet_rounds >= IDLE_ROUNDS:
            self._timer = None
            self.lag_s = 0.0
            return
        assert self._loop is not None
        self._timer = self._loop.call_later(self.interval_s, self._sample)
