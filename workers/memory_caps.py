"""The batch-size bounds an inference process learns from device memory: what each batch
showed (workers/batch_run.py bisects one that ran out) fed to its ``RowCap``
(batching/memory.py), on rows, or for a model with a padded axis on rows times the padded
length, and the bound published to the policy, the former and the supervisor."""

from __future__ import annotations

import logging

from batching.config import ModelConfig
from batching.former import BatchFormer
from batching.memory import UNBOUNDED, RowCap
from batching.policy import TunablePolicy
from workers.batch_run import Outcome
from workers.shared_state import SharedState
from workers.stream_port import StreamPort

log = logging.getLogger("conveyor.inference")


class MemoryCaps:
    """One inference process's learned bounds; ``streams`` counts its out-of-memory
    errors."""

    def __init__(self, config: ModelConfig, former: BatchFormer, policy: TunablePolicy,
                 shared: SharedState, streams: StreamPort) -> None:
        self._name = config.name
        self._former = former
        self._policy = policy
        self._shared = shared
        self._streams = streams
        self.row_cap = RowCap(config.batch_rows)
        """The one owner of the batch size bound: ``limit`` is ``max_batch_size`` (lowered
        at run time by :meth:`limit`), ``cap`` the rows the device has shown it holds,
        never above ``limit``. The policy and the former keep the configured bound and get
        the run-time one from here: the policy as its ``row_cap``, the former with each
        :meth:`BatchFormer.take`. For a model with a padded axis it never learns:
        :attr:`cost_cap` does."""
        self.cost_cap = RowCap(UNBOUNDED)
        """A model with a padded axis: the learned bound on rows times padded length,
        which the former applies (``max_padded``)."""
        self._padded = bool(former.layout.pad)

    def limit(self, rows: int) -> None:
        """``max_batch_size`` set at run time to ``rows``."""
        self.row_cap.limit = rows
        self.row_cap.cap = min(self.row_cap.cap, rows)
        self.publish()

    def learn(self, done: Outcome) -> None:
        """What the batch showed of device memory, in the order it happened."""
        for fitted, rows, width in done.fits:
            if not fitted:
                self._on_oom(rows, width)
            elif self._padded:
                self.cost_cap.on_success(rows * width, width)
            else:
                self.row_cap.on_success(rows)
        self.publish()

    def publish(self) -> None:
        self._shared.row_cap = self._policy.row_cap = self.row_cap.cap
        if self.cost_cap.cap < UNBOUNDED:
            self._former.max_padded = self.cost_cap.cap

    def _on_oom(self, rows: int, width: int) -> None:
        self._streams.count({"oom_count": 1})
        if self._padded:
            self.cost_cap.on_oom(rows * width)
            self.publish()
            log.warning("%s: out of memory at %d rows of padded length %d; cap on rows x "
                        "length now %d", self._name, rows, width, self.cost_cap.cap)
            return
        self.row_cap.on_oom(rows)
        self.publish()
        log.warning("%s: out of memory at %d rows; row cap now %d", self._name, rows,
                    self.row_cap.cap)
