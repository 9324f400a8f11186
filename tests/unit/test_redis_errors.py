"""Which Redis failures a retrying loop waits out (docs in batching/redis_errors.py)."""

from __future__ import annotations

import pytest
from redis.exceptions import (
    ClusterDownError,
    MasterDownError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError

from batching.redis_errors import REDIS_FAILED, REDIS_UNREACHABLE


@pytest.mark.parametrize("error", [
    RedisConnectionError("reset"), OSError("unreachable"),
    ClusterDownError("CLUSTERDOWN The cluster is down"),
    MasterDownError("MASTERDOWN Link with MASTER is down"),
    TryAgainError("TRYAGAIN Multiple keys request during rehashing of slot"),
])
def test_a_cluster_between_primaries_is_waited_out_like_a_lost_connection(error: Exception) -> None:
    assert isinstance(error, REDIS_UNREACHABLE)


def test_an_error_reply_is_not_retried_but_counts_as_a_failure() -> None:
    wrong = ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value")
    assert not isinstance(wrong, REDIS_UNREACHABLE)
    assert isinstance(wrong, REDIS_FAILED)
