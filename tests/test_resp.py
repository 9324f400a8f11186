"""The lean Redis client (batching.resp) against a real redis-server of its own, and the
redis-py connection that stands in for it with ``CONVEYOR_LEAN_REDIS=0``
(batching.redis_links): the same interface, the same answers."""

from __future__ import annotations

import logging
import os
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from batching.redis_links import PipelineConnection, blocking_link
from batching.resp import Address, Connection, RespError, check, encode, encode_all
from tests.procs import RedisServer


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("resp"))
    yield server
    server.stop()


@pytest.fixture(params=["lean", "redis-py"])
def conn(server: RedisServer, request: pytest.FixtureRequest
         ) -> Iterator[Connection | PipelineConnection]:
    """The hot path's blocking connection, either kind."""
    connection = blocking_link(server.url, 5, lean=request.param == "lean")
    assert isinstance(connection, Connection | PipelineConnection)
    connection.execute([("FLUSHDB",)])
    yield connection
    connection.close()


@pytest.fixture
def lean(server: RedisServer) -> Iterator[Connection]:
    connection = Connection(Address.from_url(server.url), timeout_s=5)
    connection.call("FLUSHDB")
    yield connection
    connection.close()


def test_encode_writes_resp_arrays_of_bulk_strings() -> None:
    assert encode(("SET", "k", b"\x00\r\n", 5, 1.5)) == (
        b"*5\r\n$3\r\nSET\r\n$1\r\nk\r\n$3\r\n\x00\r\n\r\n$1\r\n5\r\n$3\r\n1.5\r\n")
    assert encode_all([("PING",), ("ECHO", "é")]) == (
        b"*1\r\n$4\r\nPING\r\n*2\r\n$4\r\nECHO\r\n$2\r\n\xc3\xa9\r\n")


@pytest.mark.parametrize(("url", "want"), [
    ("redis://127.0.0.1:6390/2", Address("127.0.0.1", 6390, db=2)),
    ("redis://:s%40cret@cache.example:7000", Address("cache.example", 7000, password="s@cret")),
    ("redis://app:pw@cache/0", Address("cache", 6379, username="app", password="pw")),
    ("rediss://cache:6380/1", Address("cache", 6380, db=1, tls=True)),
    ("unix:///run/redis.sock?db=3", Address(path="/run/redis.sock", db=3)),
    ("redis://cache?db=4", Address("cache", 6379, db=4)),
])
def test_address_reads_the_url_forms_redis_py_reads(url: str, want: Address) -> None:
    assert Address.from_url(url) == want


def test_tls_options_follow_redis_py_query_parameters() -> None:
    assert Address.from_url("redis://cache").ssl_context() is None
    strict = Address.from_url("rediss://cache").ssl_context()
    assert strict is not None and strict.verify_mode == ssl.CERT_REQUIRED and strict.check_hostname
    loose = Address.from_url("rediss://cache?ssl_cert_reqs=none").ssl_context()
    assert loose is not None and loose.verify_mode == ssl.CERT_NONE and not loose.check_hostname
    options = Address.from_url("rediss://c?ssl_ca_certs=/etc/ca.pem").ssl_options()
    assert options is not None and options["ssl_ca_certs"] == "/etc/ca.pem"


def test_every_tls_option_redis_py_reads_reaches_the_lean_context() -> None:
    """ssl_min_version and ssl_ciphers, typed by redis-py's URL parser, shape the lean
    client's context as they shape redis-py's."""
    context = Address.from_url("rediss://cache?ssl_min_version=772&ssl_check_hostname=false"
                               "&ssl_ciphers=ECDHE-RSA-AES128-GCM-SHA256").ssl_context()
    assert context is not None and context.minimum_version == ssl.TLSVersion.TLSv1_3
    assert not context.check_hostname
    tls12 = {c["name"] for c in context.get_ciphers() if c["protocol"] == "TLSv1.2"}
    assert tls12 == {"ECDHE-RSA-AES128-GCM-SHA256"}


@pytest.mark.parametrize(("url", "match"), [
    ("rediss://cache?ssl_validate_ocsp=true", "ssl_validate_ocsp"),  # redis.asyncio lacks it
    ("rediss://cache?ssl_cert_reqs=CERT_REQUIRED", "ssl_cert_reqs"),  # redis-py's names only
    ("rediss://cache?ssl_min_version=tls1.2", "ssl_min_version"),
])
def test_tls_options_redis_py_refuses_are_refused(url: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Address.from_url(url).ssl_context()


def test_the_url_is_read_by_redis_py_s_parser() -> None:
    with pytest.raises(ValueError, match="'db'"):
        Address.from_url("redis://cache?db=first")
    assert Address.from_url("redis://cache/0?db=5&socket_timeout=2").db == 5


def test_address_refuses_other_schemes() -> None:
    with pytest.raises(ValueError, match="http"):
        Address.from_url("http://cache:6379")


def test_login_commands() -> None:
    assert Address().login() == []
    assert Address(password="pw", db=2).login() == [("AUTH", "pw"), ("SELECT", 2)]
    assert Address(username="app", password="pw").login() == [("AUTH", "app", "pw")]


def test_execute_pipelines_and_returns_replies_in_order(
        conn: Connection | PipelineConnection) -> None:
    assert conn.execute([("INCRBY", "k", 7), ("GET", "k"), ("RPUSH", "l", "a", "b"),
                         ("LRANGE", "l", 0, -1)]) == [7, b"7", 2, [b"a", b"b"]]


def test_error_reply_raises_and_leaves_the_connection_usable(
        conn: Connection | PipelineConnection) -> None:
    conn.call("INCR", "k")
    with pytest.raises(RespError, match="WRONGTYPE"):
        conn.execute([("LPUSH", "k", "x"), ("ECHO", "x")])
    assert conn.call("GET", "k") == b"1"


def test_an_unknown_script_reads_noscript(conn: Connection | PipelineConnection) -> None:
    """The dispatcher looks for the code to send the script itself (redis-py drops it)."""
    with pytest.raises(RespError, match=r"^NOSCRIPT "):
        conn.execute([("EVALSHA", "0" * 40, 0)])


def test_transient_errors_read_as_a_lost_connection() -> None:
    with pytest.raises(ConnectionError, match="LOADING"):
        check(RespError("LOADING Redis is loading the dataset in memory"))
    with pytest.raises(RespError):
        check(RespError("NOGROUP No such key"))
    assert check(b"OK") == b"OK"


def test_deferred_replies_are_read_before_the_next_command(
        conn: Connection | PipelineConnection) -> None:
    seen: list[list[object]] = []
    conn.send([("INCR", "n"), ("INCR", "n")], seen.append)
    conn.send([("INCR", "n")], seen.append)
    assert conn.call("GET", "n") == b"3"
    assert seen == [[1, 2], [3]]


def test_deferred_error_replies_are_logged_not_raised(conn: Connection | PipelineConnection,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    conn.call("SET", "k", "v")
    with caplog.at_level(logging.ERROR):
        conn.send([("LPUSH", "k", "x"), ("INCR", "n")])
        assert conn.call("GET", "n") == b"1"
    assert "WRONGTYPE" in caplog.text


def test_flush_reads_every_deferred_reply(conn: Connection | PipelineConnection) -> None:
    seen: list[list[object]] = []
    conn.send([("INCR", "n")], seen.append)
    conn.flush()
    assert seen == [[1]]


def test_reconnects_after_redis_restarts(server: RedisServer,
                                         conn: Connection | PipelineConnection) -> None:
    conn.send([("INCR", "n")])
    server.stop()
    with pytest.raises(OSError):
        conn.call("ECHO", "x")
    server.start()
    assert conn.call("ECHO", "x") == b"x"
    assert conn.call("GET", "n") is None  # a fresh Redis; nothing stale was read


def test_logs_in_and_selects_the_database(tmp_path: Path) -> None:
    server = RedisServer(tmp_path, "--requirepass", "s3cret")
    try:
        conn = Connection(Address.from_url(f"redis://:s3cret@127.0.0.1:{server.port}/2"), 5)
        conn.call("SET", "k", "v")
        other = redis.Redis(port=server.port, password="s3cret", db=2)
        assert other.get("k") == b"v"
        other.close()
        conn.close()
        refused = Connection(Address.from_url(f"redis://:wrong@127.0.0.1:{server.port}/0"), 5)
        with pytest.raises(RespError, match=r"WRONGPASS|invalid"):
            refused.call("PING")
    finally:
        server.stop()


def test_spin_polls_instead_of_sleeping_then_sleeps(lean: Connection, server: RedisServer,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A BLPOP answered 0.3 s later: with a 0.15 s spin the client polls (yielding the CPU
    on every turn) for 0.15 s, then sleeps until the reply comes."""
    yields: list[float] = []
    monkeypatch.setattr(os, "sched_yield", lambda: yields.append(time.perf_counter()))

    def wait(spin_s: float) -> float:
        def push() -> None:
            with redis.Redis(port=server.port) as client:
                client.rpush("q", "x")

        pusher = threading.Timer(0.3, push)
        started = time.perf_counter()
        pusher.start()
        assert lean.execute([("BLPOP", "q", 5)], spin_s)[0] == [b"q", b"x"]
        pusher.join()
        return started

    wait(0.0)
    assert yields == []
    started = wait(0.15)
    assert len(yields) > 10
    assert 0.1 < yields[-1] - started < 0.2
