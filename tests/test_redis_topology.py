"""``CONVEYOR_REDIS_URL`` read as one server, a Sentinel-watched primary or a Cluster, and
the cluster's key slots (the Redis Cluster specification's CRC16 and hash tags)."""

from __future__ import annotations

import binascii

import pytest

from batching.keys import Keys
from batching.redis_topology import parse_topology, sync_redis
from batching.resp import RespError
from batching.resp_cluster import command_key, key_slot, redirect, slot_map
from batching.urls import mask_url


def test_plain_urls_stay_one_server() -> None:
    for url in ("redis://h:6380/2", "rediss://h:6380/0?ssl_cert_reqs=none",
                "unix:///run/redis.sock?db=3"):
        topology = parse_topology(url)
        assert topology.kind == "single" and topology.hosts == ()
    assert parse_topology("redis://h:6380/2").node.db == 2
    assert parse_topology("unix:///run/redis.sock?db=3").node.path == "/run/redis.sock"


def test_a_sentinel_url_names_the_sentinels_the_primary_and_the_database() -> None:
    topology = parse_topology(
        "redis+sentinel://app:pw@s1:26379,s2,[::1]:26380/mymaster/2?sentinel_password=sp")
    assert topology.kind == "sentinel"
    assert topology.hosts == (("s1", 26379), ("s2", 26379), ("::1", 26380))
    assert topology.service == "mymaster"
    node = topology.node
    assert (node.username, node.password, node.db, node.tls) == ("app", "pw", 2, False)
    assert topology.sentinel_password == "sp"
    sentinel = topology.sentinel_address("s2", 26379)
    assert (sentinel.password, sentinel.db, sentinel.port) == ("sp", 0, 26379)
    primary = topology.node_address("10.0.0.9", 6379)
    assert (primary.host, primary.password, primary.db) == ("10.0.0.9", "pw", 2)


def test_kombus_sentinel_list_and_tls_are_read_too() -> None:
    topology = parse_topology("sentinel://:pw@s1:26379;sentinel://:pw@s2:26379/1"
                              "?master_name=cache")
    assert (topology.kind, topology.service, topology.node.db) == ("sentinel", "cache", 1)
    assert topology.hosts == (("s1", 26379), ("s2", 26379))
    tls = parse_topology("rediss+sentinel://s1/m/0?ssl_cert_reqs=none")
    assert tls.node.tls and dict(tls.node.tls_options) == {"ssl_cert_reqs": "none"}


def test_a_cluster_url_lists_its_seed_nodes() -> None:
    topology = parse_topology("redis+cluster://:pw@n1:7000,n2:7001,n3")
    assert topology.kind == "cluster"
    assert topology.hosts == (("n1", 7000), ("n2", 7001), ("n3", 6379))
    assert topology.node.password == "pw"
    assert parse_topology("rediss+cluster://n1:7000").node.tls


@pytest.mark.parametrize(("url", "message"), [
    ("redis+sentinel://:S3cret@s1:26379/0", "names no primary"),
    ("redis+sentinel://:S3cret@s1:x/m", "bad port"),
    ("redis+cluster://:S3cret@n1:7000/3", "database 0 only"),
    ("redis+cluster://:S3cret@/", "no host"),
    ("http://:S3cret@h", "unsupported Redis URL scheme"),
])
def test_bad_urls_are_refused_without_their_password(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as refused:
        parse_topology(url)
    assert "S3cret" not in str(refused.value)


def test_several_host_urls_are_masked_whole() -> None:
    assert (mask_url("redis+cluster://app:S3cret@n1:7000,n2:7001")
            == "redis+cluster://app:**@n1:7000,n2:7001")
    assert (mask_url("redis+sentinel://:S3cret@s1,s2/m/0?sentinel_password=S3cret")
            == "redis+sentinel://:**@s1,s2/m/0?sentinel_password=**")


def test_key_slots_follow_the_cluster_specification() -> None:
    assert key_slot("123456789") == 0x31C3  # the specification's CRC16 test vector
    assert key_slot(b"123456789") == 0x31C3 % 16384
    assert key_slot("{user1000}.following") == key_slot("{user1000}.followers") \
        == key_slot("user1000")
    assert key_slot("foo{}{bar}") == binascii.crc_hqx(b"foo{}{bar}", 0) % 16384  # empty tag
    assert key_slot("foo{{bar}}zap") == key_slot("{bar")
    assert key_slot("foo{bar}{zap}") == key_slot("bar")
    assert key_slot("") == 0


def test_every_key_of_one_model_shares_a_slot() -> None:
    keys = Keys("cv")
    model = [keys.queue("m", 1), keys.queue("m", 3), keys.rows_waiting("m"), keys.stats("m"),
             keys.dead_letter("m"), keys.suspects("m"), keys.control("m"), keys.workers("m")]
    assert {key_slot(k) for k in model} == {key_slot("m")}
    job = [keys.job("j"), keys.job_input("j"), keys.job_chunks("j"), keys.job_lease("j"),
           keys.job_replies("j")]
    assert {key_slot(k) for k in job} == {key_slot("j")}
    assert key_slot(keys.reply("host-1-ab")) == key_slot("host-1-ab")


def test_each_hot_path_command_is_routed_by_its_first_key() -> None:
    assert command_key(("EVALSHA", "abc", 2, "cv:{m}:rows", "cv:{m}:q:1", 1)) == b"cv:{m}:rows"
    assert command_key(("EVAL", "return 1", 0)) is None
    assert command_key(("XREADGROUP", "GROUP", "workers", "c", "COUNT", 8, "BLOCK", 5,
                        "STREAMS", "cv:{m}:q:1", "cv:{m}:q:2", ">", ">")) == b"cv:{m}:q:1"
    assert command_key(("BLMPOP", 1, 1, "cv:reply:{a}", "LEFT", "COUNT", 9)) == b"cv:reply:{a}"
    assert command_key(("RPUSH", "cv:reply:{a}", b"x")) == b"cv:reply:{a}"
    assert command_key(("PING",)) is None


def test_redirections_and_the_slot_map_are_read() -> None:
    assert redirect(RespError("MOVED 3999 127.0.0.1:6381")) == ("MOVED", 3999, ("127.0.0.1", 6381))
    assert redirect(RespError("ASK 3999 10.0.0.2:7000")) == ("ASK", 3999, ("10.0.0.2", 7000))
    assert redirect(RespError("ERR no")) is None and redirect(b"MOVED") is None
    slots = slot_map([[0, 5460, [b"10.0.0.1", 7000, b"id1"]],
                      [5461, 16383, [b"10.0.0.2", 7001, b"id2"], [b"10.0.0.3", 7002, b"id3"]]])
    assert slots[0] == slots[5460] == ("10.0.0.1", 7000)
    assert slots[5461] == slots[16383] == ("10.0.0.2", 7001)


def test_redis_py_clients_log_in_to_sentinels_and_nodes_each_their_own_way() -> None:
    client = sync_redis("rediss+sentinel://:pw@s1:26379/mymaster/3"
                        "?ssl_cert_reqs=none&sentinel_password=sp", socket_timeout=2)
    pool = client.connection_pool
    assert pool.connection_kwargs["password"] == "pw"
    assert pool.connection_kwargs["db"] == 3
    assert pool.connection_kwargs["ssl_cert_reqs"] == "none"
    sentinel = pool.sentinel_manager.sentinels[0].connection_pool  # type: ignore[attr-defined]
    assert sentinel.connection_kwargs["password"] == "sp"
    assert sentinel.connection_kwargs["ssl_cert_reqs"] == "none"
    assert sentinel.connection_kwargs["socket_timeout"] == 2
    client.close()
    plain = parse_topology("redis+sentinel://s1/mymaster?sentinel_password=sp")
    assert plain.sentinel_kwargs() == {"password": "sp"}
