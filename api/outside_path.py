"""How long a model's requests spend outside the inference process, as this API process
sees them, for the adaptive policy's shedding.

A successful request took ``took`` here, from reading it to its answer. Its reply says how
long it waited in its stream (admission to its batch's start, ``queue_ms``) and how long
its batch ran until its answers were made (``exec_ms``). The rest is this side's: the
parse and admission before, the reply's way back and its write after. Past capacity the
adaptive policy answers at once what a batch started now would not answer in time, and it
must keep that path's time in hand: too little and its answers reach their clients late,
too much and it turns away requests that would have made it. With the model on a device
(bench/device_model.py, on 2 cores) the path is about 2 ms; with a model that shares the
cores with the API, tens of ms past capacity. A fixed 30% of the latency target (15 ms
of 50) cost the device up to 4% of its goodput against the best fixed window (the
batching sweep, bench/RESULTS-batching.md).

So each request carries this process's estimate (``params[envelope.PATH]``): the smoothed
mean plus twice the smoothed mean deviation. The queue time is measured between two
clocks, the API's and the worker's; on separate hosts it is off by their skew, so no
sample counts below 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

SMOOTHING = 0.05
"""Weight of the newest request: the estimate follows the path within a few dozen."""
DEVIATIONS = 2.0
"""The reserve: the mean plus this many mean deviations."""


@dataclass(slots=True)
class OutsidePath:
    _mean: dict[str, float] = field(default_factory=dict)
    _deviation: dict[str, float] = field(default_factory=dict)

    def observe(self, model: str, took_s: float, inside_s: float) -> None:
        """A request for ``model`` was answered ``took_s`` after this process read it, of
        which ``inside_s`` in its stream and its batch (its reply's ``queue_ms`` and
        ``exec_ms``)."""
        sample = max(0.0, took_s - inside_s)
        mean = self._mean.get(model)
        if mean is None:
            self._mean[model], self._deviation[model] = sample, 0.0
            return
        self._mean[model] = mean + SMOOTHING * (sample - mean)
        deviation = self._deviation[model]
        self._deviation[model] = deviation + SMOOTHING * (abs(sample - mean) - deviation)

    def reserve_us(self, model: str) -> int | None:
        """What a request of ``model`` should carry as ``params[envelope.PATH]``; None
        before one of its requests was answered."""
        mean = self._mean.get(model)
        if mean is None:
            return None
        return math.ceil((mean + DEVIATIONS * self._deviation[model]) * 1e6)
