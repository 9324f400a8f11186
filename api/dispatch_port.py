"""What the API asks of its dispatcher, as a protocol.

:class:`api.dispatch.Dispatcher` (Redis links, admission script, reply reader) is the one
the API process runs; the service, the worker watch, the repository control and the job
routes depend only on this protocol, so ``api.main.create_app`` can be handed another
one, such as the in-memory dispatcher of the in-process tests (tests/unit).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import redis.asyncio as aioredis

    from api.dispatch import Admission
    from batching.envelope import Reply, Request


class DispatchPort(Protocol):
    reply_key: str
    """The list this API process's replies come back on (``cv:reply:{api_id}``)."""
    redis_ok: bool
    """Whether Redis answered lately; the worker watch clears it when a refresh fails."""

    @property
    def redis(self) -> aioredis.Redis:
        """A redis.asyncio client for everything but admission and replies: heartbeats,
        the repository hash, statistics, jobs."""

    def new_id(self) -> str:
        """A request id unique within this API process."""

    async def start(self) -> None: ...

    async def close(self) -> None:
        """Stop, answer the requests still waiting, and close every connection."""

    async def submit(self, admission: Admission, request: Request, timeout_s: float) -> Reply:
        """Admit ``request`` and wait for its reply until ``timeout_s``.

        Raises :class:`batching.errors.Overloaded` when the model's queue is full,
        :class:`batching.errors.Unavailable` when Redis is unreachable and
        :class:`batching.errors.DeadlineExceeded` when ``timeout_s`` passes. Cancelled
        (its client left), it withdraws the request from the model's queue.
        """
