"""conveyor.harness: what the launcher, the benchmarks and these tests start processes with."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest

from conveyor.harness import ProcessGroup, RedisServer, free_port, group_cpu_s, redis_answers, wait_until


def test_waiting_stops_as_soon_as_a_watched_process_exits_and_shows_its_log(tmp_path: Path) -> None:
    proc = ProcessGroup("early", ["sh", "-c", "echo cannot start; exit 3"], log=tmp_path / "e.log")
    began = time.monotonic()
    with pytest.raises(ChildProcessError, match=r"(?s)early exited before it.*cannot start"):
        wait_until(lambda: False, 30, "it", watch=[proc])
    assert time.monotonic() - began < 10


def test_waiting_gives_up_after_the_timeout_and_retries_errors_meanwhile() -> None:
    calls: list[int] = []

    def flaky() -> bool:
        calls.append(1)
        raise ConnectionRefusedError

    with pytest.raises(TimeoutError, match="waiting for nothing"):
        wait_until(flaky, 0.3, "nothing", interval=0.05)
    assert len(calls) > 2


def test_stop_kills_the_whole_group_when_sigterm_is_ignored(tmp_path: Path) -> None:
    proc = ProcessGroup("stubborn", ["sh", "-c", "trap '' TERM; sleep 300 & wait"],
                        log=tmp_path / "s.log")
    time.sleep(0.3)  # the trap is set
    began = time.monotonic()
    proc.stop(timeout=0.5)
    assert proc.popen.returncode == -signal.SIGKILL
    assert time.monotonic() - began < 5


def test_cpu_of_a_group_counts_its_children_under_their_label(tmp_path: Path) -> None:
    spin = f"{sys.executable} -c 'import time; end = time.time() + 3\nwhile time.time() < end: pass'"
    proc = ProcessGroup("parent", ["sh", "-c", f"{spin} & wait"], log=tmp_path / "c.log")
    try:
        time.sleep(1.0)
        cpu = group_cpu_s([proc], {"parent": "spinner"})
    finally:
        proc.stop()
    assert cpu.get("spinner", 0.0) > 0.2 and cpu.get("parent", 0.0) < 0.2, cpu


def test_redis_answers_only_where_a_redis_listens_locked_or_not(tmp_path: Path) -> None:
    assert not redis_answers(f"redis://127.0.0.1:{free_port()}/0")
    with RedisServer(tmp_path, "--requirepass", "pw") as server:
        assert redis_answers(server.url)  # -NOAUTH is an answer
    assert not redis_answers(server.url)
