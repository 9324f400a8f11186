"""``conveyor run`` / ``make run``: what binds where, no password printed, and a stop that
leaves no process behind whatever signals arrive (or when the launcher itself is killed)."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from batching.settings import Settings
from conveyor import launcher
from conveyor.harness import ProcessGroup
from tests.procs import ROOT, RedisServer, free_port, service_env, wait_for

TEST_MODELS = ROOT / "tests" / "models"
PASSWORD = "S3cret-launcher"
READY_TIMEOUT_S = 240.0
"""Starting five processes and a model on a busy 2-core host can take long."""
STOP_BOUND_S = 10.0
"""The spec: nothing is left this long after the signal."""
OUR_ENV = ("CONVEYOR_HOST", "CONVEYOR_API_KEYS_FILE", "CONVEYOR_ALLOW_UNAUTHENTICATED",
           *launcher.FLOWER_AUTH_ENV)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in OUR_ENV:
        monkeypatch.delenv(name, raising=False)


# --- In-process: binding, banner, the stop itself --------------------------------------

def test_refuses_to_bind_beyond_loopback_without_keys(
        clean_env: None, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    def never(*_args: object) -> ProcessGroup:
        raise AssertionError("started a process")
    monkeypatch.setattr(launcher, "start", never)
    monkeypatch.setattr(launcher, "redis_answers", never)
    assert launcher.run("0.0.0.0") == 2
    assert "CONVEYOR_API_KEYS_FILE" in capsys.readouterr().err


@pytest.mark.parametrize(("host", "env", "bound", "says"), [
    ("127.0.0.1", {}, "127.0.0.1", "this host only"),
    ("0.0.0.0", {"CONVEYOR_API_KEYS_FILE": "/k"}, "127.0.0.1", "FLOWER_BASIC_AUTH=user:pass"),
    ("0.0.0.0", {"CONVEYOR_API_KEYS_FILE": "/k", "FLOWER_BASIC_AUTH": "ops:pw-xyz"},
     "0.0.0.0", "login"),
    ("0.0.0.0", {"CONVEYOR_ALLOW_UNAUTHENTICATED": "1"}, "0.0.0.0", "open to the network"),
])
def test_flower_leaves_loopback_only_with_a_login_or_explicitly_open(
        clean_env: None, monkeypatch: pytest.MonkeyPatch, host: str, env: dict[str, str],
        bound: str, says: str) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    settings = Settings(host=host)
    flower_host, login = launcher.flower_binding(settings, os.environ)
    assert (flower_host, says in login) == (bound, True)
    assert f"--address={bound}" in launcher.commands(settings, flower_host)["flower"]
    text = launcher.banner(settings, flower_host, login)
    assert "pw-xyz" not in text
    assert f"http://{bound}:{settings.flower_port}" in text


def test_banner_says_loopback_only_without_keys(clean_env: None) -> None:
    settings = Settings()
    text = launcher.banner(settings, *launcher.flower_binding(settings, {}))
    assert f"HTTP API      http://127.0.0.1:{settings.http_port}/v2" in text
    assert f"gRPC          127.0.0.1:{settings.grpc_port}" in text
    assert "Loopback only (127.0.0.1): no CONVEYOR_API_KEYS_FILE" in text
    half = max(1, len(os.sched_getaffinity(0)) // 2)
    assert f"API processes {half} (CONVEYOR_API_WORKERS" in text
    text = launcher.banner(Settings(api_workers=3), "127.0.0.1", "")
    assert "API processes 3 (CONVEYOR_API_WORKERS" in text


def test_banner_names_tls_and_keys_and_brackets_ipv6(clean_env: None, tmp_path: Path) -> None:
    settings = Settings(host="::", api_keys_file=tmp_path / "keys",
                        tls_cert_file=tmp_path / "c.pem", tls_key_file=tmp_path / "k.pem")
    text = launcher.banner(settings, *launcher.flower_binding(settings, {}))
    assert f"HTTP API      https://[::]:{settings.http_port}/v2" in text
    assert f"gRPC          [::]:{settings.grpc_port}  (TLS)" in text
    assert f"API keys from {tmp_path / 'keys'}." in text


def test_stop_terms_all_at_once_then_kills_whole_groups_at_one_deadline() -> None:
    stubborn = "trap '' TERM; sleep 300 & sleep 300 & wait"  # ignored TERM is inherited
    children = [launcher.start(f"stubborn{i}", ["sh", "-c", stubborn]) for i in range(3)]
    polite = launcher.start("polite", ["sleep", "300"])
    wait_for(lambda: all(len(_group(c.popen.pid)) == 3 for c in children), 10,
             "the stubborn groups to start")
    began = time.monotonic()
    launcher.stop_all([polite, *children[:2]], [children[2]], deadline_s=2.0)
    took = time.monotonic() - began
    assert polite.popen.returncode == -signal.SIGTERM
    assert 1.9 < took < 4.5, took  # one deadline for everything, not one per child (6 s)
    assert not any(_group(c.popen.pid) for c in children)


def test_children_die_with_a_killed_parent(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    script = ("import os, signal, sys, time; from conveyor import launcher; "
              "child = launcher.start('sleeper', ['sleep', '300']); "
              f"open({str(pid_file)!r}, 'w').write(str(child.popen.pid)); time.sleep(300)")
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT)
    try:
        wait_for(lambda: pid_file.exists() and pid_file.read_text() != "", 30, "the child")
        child = int(pid_file.read_text())
        parent.kill()
        parent.wait()
        wait_for(lambda: _state(child) in ("", "Z"), 5, "the orphan to die")
    finally:
        parent.kill()
        parent.wait()


def test_a_parent_gone_before_the_call_signals_at_once() -> None:
    script = ("import signal, time; from batching.lifetime import die_with_parent; "
              "die_with_parent(signal.SIGTERM, 1); time.sleep(30)")  # 1: not our parent
    child = subprocess.run([sys.executable, "-c", script], cwd=ROOT, timeout=30, check=False)
    assert child.returncode == -signal.SIGTERM


# --- Real processes: the whole stack under make or conveyor run ------------------------

def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _stat(pid: int) -> list[str]:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return []
    return text[text.rindex(")") + 2:].split()


def _state(pid: int) -> str:
    fields = _stat(pid)
    return fields[0] if fields else ""


def _group(pgid: int) -> list[int]:
    return [p for p in _pids() if (f := _stat(p)) and f[2] == str(pgid) and f[0] != "Z"]


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid in _pids():
        fields = _stat(pid)
        if fields:
            children.setdefault(int(fields[1]), []).append(pid)
    found: set[int] = set()
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _marked(marker: str) -> set[int]:
    """Live processes whose environment holds the test's marker (orphans included)."""
    found: set[int] = set()
    for pid in _pids():
        with contextlib.suppress(OSError):
            if marker.encode() in Path(f"/proc/{pid}/environ").read_bytes() \
                    and _state(pid) not in ("", "Z"):
                found.add(pid)
    return found


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture
def password_redis(tmp_path: Path) -> Iterator[str]:
    server = RedisServer(tmp_path, "--requirepass", PASSWORD)
    yield f"redis://default:{PASSWORD}@127.0.0.1:{server.port}/0"
    server.stop()


@pytest.mark.parametrize("how", ["make-group-term", "term-twice", "launcher-killed"])
def test_stop_leaves_no_process_and_frees_the_ports(password_redis: str, tmp_path: Path,
                                                    how: str) -> None:
    if how == "make-group-term" and shutil.which("make") is None:
        pytest.skip("make is not installed")
    marker = uuid.uuid4().hex
    ports = {name: free_port() for name in ("HTTP", "GRPC", "FLOWER", "WORKER")}
    env = service_env(password_redis, TEST_MODELS, f"t{marker[:8]}", CONVEYOR_MODELS="echo",
                      CONVEYOR_TEST_MARKER=marker,
                      **{f"CONVEYOR_{name}_PORT": str(port) for name, port in ports.items()})
    for name in OUR_ENV:
        env.pop(name, None)
    venv = Path(sys.executable).parent.parent
    argv = (["make", "-s", "-o", f"{venv}/.installed", "run", f"VENV={venv}"]
            if how == "make-group-term" else [sys.executable, "-m", "conveyor.cli", "run"])
    out = tmp_path / "run.log"
    with out.open("wb") as log:
        root = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        _wait_ready(ports, out)
        started = _descendants(root.pid)
        assert len(started) >= 5, started  # API, worker, its model process, jobs, Flower
        if how == "launcher-killed":
            os.kill(root.pid, signal.SIGKILL)
        else:
            os.killpg(root.pid, signal.SIGTERM)
            if how == "term-twice":
                time.sleep(0.3)
                os.killpg(root.pid, signal.SIGTERM)
        began = time.monotonic()
        with contextlib.suppress(AssertionError):
            wait_for(lambda: not _marked(marker) and not _alive(started), STOP_BOUND_S,
                     "every process to go", interval=0.2)
        left = {pid: Path(f"/proc/{pid}/cmdline").read_bytes() for pid in
                _marked(marker) | _alive(started) if Path(f"/proc/{pid}").exists()}
        assert not left, f"left after {time.monotonic() - began:.1f}s: {left}\n{out.read_text()}"
        busy = [name for name, port in ports.items() if not _port_free(port)]
        assert not busy, busy
        text = out.read_text(errors="replace")
        assert PASSWORD not in text
        assert "using Redis at redis://default:**@127.0.0.1" in text
        if how == "term-twice":
            assert root.wait(5) == 0, text  # a clean exit: the second signal did not kill it
        assert "KeyboardInterrupt" not in text and "launcher.py" not in text, text
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(root.pid, signal.SIGKILL)
        for pid in _marked(marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        root.wait()


def _alive(pids: set[int]) -> set[int]:
    return {pid for pid in pids if _state(pid) not in ("", "Z")}


def _wait_ready(ports: dict[str, int], out: Path) -> None:
    def ready() -> bool:
        return (httpx.get(f"http://127.0.0.1:{ports['HTTP']}/v2/health/ready").status_code
                == 200
                and httpx.get(f"http://127.0.0.1:{ports['WORKER']}/ready").status_code == 200
                and httpx.get(f"http://127.0.0.1:{ports['FLOWER']}/healthcheck").status_code
                == 200)
    try:
        wait_for(ready, READY_TIMEOUT_S, "conveyor run to be ready", interval=0.5)
    except AssertionError:
        raise AssertionError(out.read_text(errors="replace")) from None


class _GonePipe(io.StringIO):
    def write(self, _text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")


def test_stop_survives_a_reader_that_is_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    """``make run | tee``: Ctrl-C kills tee too; the launcher must still stop everything."""
    monkeypatch.setattr(sys, "stderr", _GonePipe())
    stop = launcher.StopRequest()
    stop(signal.SIGINT, None)
    stop(signal.SIGTERM, None)
    stubborn = launcher.start("stubborn", ["sh", "-c", "trap '' TERM; sleep 300 & wait"])
    wait_for(lambda: len(_group(stubborn.popen.pid)) == 2, 10, "the trap to be set")
    assert launcher.watch([stubborn], stop) == 0
    launcher.stop_all([stubborn], [], deadline_s=0.5)
    assert stubborn.popen.returncode == -signal.SIGKILL
