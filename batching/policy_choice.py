"""The batching policy a model's config selects: adaptive, or Triton's fixed window.

Its own module so that :mod:`batching.policy` (the protocol and the fixed window) and
:mod:`batching.adaptive`, which builds on it, import in one direction only.
"""

from __future__ import annotations

from batching.adaptive import AdaptivePolicy
from batching.config import ModelConfig
from batching.policy import FixedWindow, TunablePolicy


def make_policy(config: ModelConfig) -> TunablePolicy:
    """The policy of one inference instance: adaptive, or Triton's fixed window. A model
    without a batch dim runs one request a batch: it never waits for a second."""
    batching = config.batching
    rows = config.batch_rows
    delay_s = batching.max_queue_delay_us / 1e6 if config.batched else 0.0
    preferred = tuple(sorted(p for p in batching.preferred_batch_sizes if 0 < p <= rows))
    if not batching.adaptive:
        return FixedWindow(rows, delay_s, preferred)
    return AdaptivePolicy(rows, max_delay_s=delay_s, preferred=preferred,
                          latency_target_s=batching.latency_target_ms / 1000.0)
