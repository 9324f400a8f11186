"""Requests the listeners cut off because their body came too slowly
(:mod:`api.http_guard`, :mod:`api.h2_connection`), counted in
:data:`api.metric_defs.BODY_TIMEOUTS` for ``/metrics``.

prometheus_client (and the metric table, which imports it) is imported when the counter is
first asked for, not with this module: :mod:`api.serve` imports the listener before it
sets ``PROMETHEUS_MULTIPROC_DIR``, which prometheus_client reads once, when imported.
"""

from __future__ import annotations

import functools
from typing import Any

LISTENERS = ("http", "grpc")
"""Values of the ``listener`` label: the HTTP/1.1 port, the native gRPC (HTTP/2) port."""


@functools.cache
def counter() -> Any:
    """This process's counter (registered by :class:`api.metrics.ApiMetrics`), each
    listener's child made at 0."""
    from prometheus_client import Counter

    from api.metric_defs import BODY_TIMEOUTS

    made = Counter(BODY_TIMEOUTS.base, BODY_TIMEOUTS.help, BODY_TIMEOUTS.labels, registry=None)
    for listener in LISTENERS:
        made.labels(listener)
    return made


def count(listener: str) -> None:
    """One request of ``listener`` cut off."""
    counter().labels(listener).inc()
