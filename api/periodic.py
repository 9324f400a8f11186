"""The API's background loops: refresh something every interval until the app stops.

The worker watch (heartbeats), the repository watch (loads and unloads made through
other API processes) and the gRPC health status each run one. A failure of one round is
logged and the next round runs as planned: a loop that died would leave readiness or the
model index frozen while the process keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger("conveyor.api")


class Periodic:
    def __init__(self, name: str, interval_s: float, action: Callable[[], Awaitable[None]]) -> None:
        self.name = name
        self.interval_s = interval_s
        self._action = action
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Run ``action`` every ``interval_s``, the first time one interval from now."""
        self._task = asyncio.create_task(self._run(), name=self.name)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self._action()
            except Exception:
                log.exception("%s: this round failed; the next runs in %.1fs", self.name,
                              self.interval_s)
