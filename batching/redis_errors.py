"""The two kinds of Redis failure conveyor tells apart, named once.

``REDIS_UNREACHABLE``: the connection failed or timed out, or a Redis Cluster is between
primaries (``CLUSTERDOWN``, ``TRYAGAIN``, ``MASTERDOWN``: redis-py raises those as error
replies); the same call may work after a back-off (a restarting Redis, a network blip, a
failover). Loops that retry catch these only, so an error reply (a bug, a wrong key type)
is not retried forever.

``REDIS_FAILED``: any failure of a Redis call, error replies included; for best-effort
calls (counters, heartbeats, status reads) whose failure is reported, not retried.
"""

from __future__ import annotations

from redis.exceptions import ClusterDownError, RedisError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

REDIS_UNREACHABLE = (RedisConnectionError, RedisTimeoutError, ClusterDownError, TryAgainError,
                     OSError)
REDIS_FAILED = (RedisError, OSError)
