"""The share of a model's requests the HTTP listener refuses at once, learned from what came
back of those it let through.

The listener's other rule (api/overload.py ``refuses_unread``) judges each request by how
long it waited unread, which only sees a backlog in this process's sockets. Past capacity
on a small host the excess also shows further on: requests the API parsed, admitted and
sent on come back late (the API's own turns, the reply's way) or shed unrun by the
inference process (it could not answer them within the latency target), and each of those
cost the API nearly what an answer costs. So once the inference process has shed one
(within ``SHED_MEMORY_S`` of it, api/overload.py), the listener refuses at the headers (a
pre-encoded 503, no body parsed, no Redis) a share of that model's requests: every request
of a ``lifo`` model that comes back late or shed raises it, and every one answered in time
lowers it, by
``UP`` and ``DOWN`` of what is left to move, as an AQM's drop probability follows its
queue (RED, PIE). The share ``p`` settles where ``p / (1 - p)`` is ``UP / DOWN`` times the
late answers per answer in time: refusing a fifth of the requests (what 125% of capacity
calls for) leaves one late for 16 in time. Below capacity nearly every answer is in time
and the share stays near 0.

Measured on mlp_medium on a 2-core host (bench/fixed_rate.py, 1 s timeouts, a 50 ms
target, fresh stacks in turns; bench/RESULTS-batching.md): the median goodput of 4 rounds
at 1,300, 1,600 and 1,900 req/s offered (capacity about 1,100-1,500) was 863, 811 and 882
a second against 726, 745 and 502 before, and what the inference process shed 135-1,538 a
run against 472-3,611 (in one round of the four, the host at its slowest, the share did
worse: 352, 160 and 100 against 406, 527 and 455). Before the shed gated it, ``UP`` at 2
or 8 times ``DOWN`` did less than at 4.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

UP = 0.04
"""Per request that came back late or shed: the share moves this much of the way to 1."""
DOWN = 0.01
"""Per request answered in time: the share moves this much of the way to 0."""
MOST = 0.9
"""The share never passes this: some requests still go through, whose answers bring it
back down once the model keeps up again."""


@dataclass(slots=True)
class RefusalShare:
    """Per model, the share of its requests to refuse at the headers."""

    shares: dict[str, float] = field(default_factory=dict)
    draw: Callable[[], float] = random.random
    """A number in [0, 1) for each request judged (replaced in tests)."""

    def outcome(self, model: str, in_time: bool) -> None:
        """A request of ``model`` let through came back ``in_time`` or not (late, shed)."""
        share = self.shares.get(model, 0.0)
        if in_time:
            self.shares[model] = share - DOWN * share
        else:
            self.shares[model] = min(MOST, share + UP * (1.0 - share))

    def of(self, model: str) -> float:
        return self.shares.get(model, 0.0)

    def refuses(self, model: str) -> bool:
        """Whether to refuse this request of ``model``: with the model's share."""
        share = self.shares.get(model, 0.0)
        return share > 0.0 and self.draw() < share
