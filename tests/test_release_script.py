"""release.lua acknowledges a batch's entries in one XACK and deletes them in one XDEL per
distinct row count, still releasing the rows of exactly the entries it deleted (issue 37)."""

from __future__ import annotations

import redis

from batching.keys import GROUP, Keys
from batching.lua import script
from workers.streams import RELEASE_LUA, STATS_LUA

RELEASE = script("release").text


def calls(client: redis.Redis, verb: str) -> int:
    return int(client.info("commandstats").get(f"cmdstat_{verb}", {}).get("calls", 0))


def test_a_batch_is_released_in_one_call_per_row_count(client: redis.Redis, keys: Keys) -> None:
    stream, rows_key = keys.queue("m", 1), keys.rows_waiting("m")
    client.xgroup_create(stream, GROUP, id="0", mkstream=True)
    sizes = [1, 2, 1, 3, 1, 2]
    ids = [client.xadd(stream, {"d": b"x", "r": n}) for n in sizes]
    client.set(rows_key, sum(sizes))
    client.xreadgroup(GROUP, "c", {stream: ">"})
    client.xdel(stream, ids[1], ids[2])  # answered elsewhere already: 2 + 1 rows not ours
    client.config_resetstat()
    args = [a for entry_id, n in zip(ids, sizes, strict=True) for a in (entry_id, n)]
    assert client.eval(RELEASE, 2, rows_key, stream, GROUP, *args) == 1 + 3 + 1 + 2
    assert (calls(client, "xack"), calls(client, "xdel")) == (1, 3)
    assert int(client.get(rows_key) or 0) == 3
    assert client.xlen(stream) == 0
    assert client.xpending(stream, GROUP)["pending"] == 0
    assert client.eval(RELEASE, 2, rows_key, stream, GROUP, *args) == 0  # nothing left


def test_a_batch_larger_than_a_chunk_is_released_whole(client: redis.Redis, keys: Keys) -> None:
    stream, rows_key = keys.queue("m", 1), keys.rows_waiting("m")
    client.xgroup_create(stream, GROUP, id="0", mkstream=True)
    pipe = client.pipeline(transaction=False)
    for _ in range(1200):
        pipe.xadd(stream, {"d": b"x", "r": 1})
    ids = pipe.execute()
    client.set(rows_key, 1200)
    client.xreadgroup(GROUP, "c", {stream: ">"})
    args = [a for entry_id in ids for a in (entry_id, 1)]
    assert client.eval(RELEASE, 2, rows_key, stream, GROUP, *args) == 1200
    assert int(client.get(rows_key) or 0) == 0
    assert client.xpending(stream, GROUP)["pending"] == 0


def test_a_worker_sends_the_scripts_without_their_comments() -> None:
    """Redis hashes a script's whole text with each EVAL."""
    for sent, name in ((RELEASE_LUA, "release"), (STATS_LUA, "stats")):
        assert b"--" not in sent
        assert len(sent) < len(script(name).text) * 3 // 4
