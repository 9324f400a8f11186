"""The shell and Python examples of README.md and docs/*.md, run as written against a real stack.

Which blocks run:

- A fenced block tagged ``sh``, ``bash``, ``shell``, ``console``, ``python`` or ``py`` is an
  example, and runs. Other blocks (``json``, ``yaml``, untagged diagrams and logs) are not.
- An example that needs what a test cannot give (``make run``, a server in the
  foreground, a GPU, another host, ``pip install``) is preceded by an HTML comment
  ``<!-- not run: why -->``, which a reader of the rendered page does not see and a
  reader of the source does; it is reported as skipped with that reason.
- A console example whose output differs on every run (counts, host names) is preceded
  by ``<!-- output not checked: why -->``: its commands run, its output is not compared.
- An example that runs a command needing a tool outside the venv (``conveyor bench`` needs
  wrk; ``NEEDS`` lists them) is skipped, with the tool named, where that tool is not on
  the ``PATH``: ``make test`` installs them (``make deps``), and a machine that cannot
  have one skips its examples instead of failing them.

How they run: the examples of one page in page order, in one temporary folder that stands
in for the checkout's root (``models`` links to the bundled models, which the examples
read), as a reader following the page would: a file one example writes (``digit.json``)
is there for the next ones. The venv's ``bin`` comes first on the ``PATH``. The docs
address the API as ``localhost:8000``: that text is replaced by the test stack's address,
and ``CONVEYOR_URL``, ``CONVEYOR_REDIS_URL`` and ``CONVEYOR_KEY_PREFIX`` point the
``conveyor`` and ``celery`` commands at the same stack.
``sh`` blocks are one ``bash -euo pipefail`` script. ``console`` blocks are prompts
(``$ command``, continued by a trailing backslash, an open quote or a here-document) and
the output a reader should see: the commands run as one script as well, and where the
block shows output, the command's output (stdout and stderr, as a terminal shows them)
must match it: whitespace is ignored, ``...`` stands for anything, a 32-digit hex job id
for any id, and a number with a fraction for any number (probabilities and times differ
by machine). Python blocks run with the venv's python. Run alone, an example may miss a
file an earlier one of its page writes.

One stack for the module (API, an inference worker serving ``models/``, a job worker).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import MODELS, Stack
from tests.jobs_stack import add_job_worker
from tests.procs import ROOT, RedisServer

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL = {"sh", "bash", "shell"}
CONSOLE = {"console"}
PYTHON = {"python", "py"}
FENCE = re.compile(r"^```(\S*)\s*$")
MARKER = re.compile(r"^<!--\s*(?P<kind>not run|output not checked):\s*(?P<why>.*?)\s*-->$")
HEREDOC = re.compile(r"<<-?\s*(['\"]?)(?P<end>\w+)\1")
DOCS_ADDRESS = "localhost:8000"
MARK = "@@docs-example-command@@"
TIMEOUT_S = 120
NEEDS = (("conveyor bench", "wrk"), ("--protocol grpc", "h2load"), ("promtool ", "promtool"),
         ("docker-compose ", "docker-compose"))
"""(text in an example, the tool it needs on the ``PATH``)."""


@dataclass
class Command:
    """One prompt of a console block and the output shown under it."""

    text: str
    shown: list[str] = field(default_factory=list)


@dataclass
class Example:
    path: Path
    line: int
    language: str
    body: str
    marker: re.Match[str] | None

    @property
    def not_run(self) -> str | None:
        """Why the example does not run, or None when it does."""
        return self.marker["why"] if self.marker and self.marker["kind"] == "not run" else None

    @property
    def missing_tools(self) -> list[str]:
        """The tools of ``NEEDS`` this example runs and this machine's ``PATH`` lacks."""
        return sorted({tool for text, tool in NEEDS
                       if text in self.body and shutil.which(tool) is None})

    @property
    def output_checked(self) -> bool:
        return self.marker is None or self.marker["kind"] != "output not checked"

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def read_blocks(path: Path) -> Iterator[tuple[int, str, str, re.Match[str] | None]]:
    """Every fenced block of ``path``: its fence's line, language, text and marker."""
    lines = path.read_text().splitlines()
    index = 0
    while index < len(lines):
        fence = FENCE.match(lines[index])
        if fence is None:
            index += 1
            continue
        start = index
        index += 1
        while index < len(lines) and lines[index] != "```":
            index += 1
        before = next((line for line in reversed(lines[:start]) if line.strip()), "")
        yield (start + 1, fence[1], "\n".join(lines[start + 1:index]) + "\n",
               MARKER.match(before.strip()))
        index += 1


def examples() -> list[Example]:
    return [Example(path, line, language, body, marker)
            for path in DOCS for line, language, body, marker in read_blocks(path)
            if language in SHELL | CONSOLE | PYTHON]


def console_commands(body: str) -> list[Command]:
    """The prompts of a console block, with their continuation lines (after a backslash or
    inside quotes), here-documents and output."""
    commands: list[Command] = []
    lines = body.splitlines()
    index = 0
    while index < len(lines):
        line = lines[index]
        index += 1
        if not line.startswith("$ "):
            if commands:
                commands[-1].shown.append(line)
            continue
        text = [line[2:]]
        while (text[-1].endswith("\\") or _open_quote("\n".join(text))) and index < len(lines):
            text.append(lines[index])
            index += 1
        heredoc = HEREDOC.search("\n".join(text))
        if heredoc is not None:
            while index < len(lines):
                text.append(lines[index])
                index += 1
                if text[-1].strip() == heredoc["end"]:
                    break
        commands.append(Command("\n".join(text)))
    return commands


def _open_quote(command: str) -> bool:
    """Whether ``command`` ends inside a quoted string, which goes on on the next line."""
    try:
        shlex.split(command, comments=True)
    except ValueError:
        return True
    return False


def script(example: Example) -> tuple[str, list[Command]]:
    """The bash script of a shell or console example; for a console one, its commands."""
    if example.language in SHELL:
        return example.body, []
    commands = console_commands(example.body)
    steps = [f"echo {MARK}\n{command.text}\n" for command in commands]
    return "".join(steps), commands


def terminal(text: str) -> str:
    """What a terminal shows: a line redrawn with carriage returns shows its last drawing."""
    return "\n".join(line.rstrip("\r").rsplit("\r", 1)[-1] for line in text.split("\n"))


ID = r"(?<![0-9a-f])[0-9a-f]{32}(?![0-9a-f])"
FRACTION = r"(?<![\w.])-?\d+\.\d+(?:e[-+]?\d+)?(?![\w.])"


def shown_pattern(shown: str) -> re.Pattern[str]:
    """The regular expression output shown in the docs stands for (module docstring),
    to match against the output with its whitespace removed."""
    parts = []
    for piece in re.split(rf"(\.\.\.|{ID}|{FRACTION})", shown):
        if piece == "...":
            parts.append(".*?")
        elif re.fullmatch(ID, piece):
            parts.append("[0-9a-f]{32}")
        elif re.fullmatch(FRACTION, piece):
            parts.append(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")
        else:
            parts.append(re.escape(re.sub(r"\s+", "", piece)))
    return re.compile("".join(parts), re.DOTALL)


def check_output(example: Example, commands: list[Command], output: str) -> None:
    printed = output.split(f"{MARK}\n")[1:]
    for command, actual in zip(commands, printed, strict=True):
        shown = "\n".join(command.shown).strip()
        if shown and not shown_pattern(shown).fullmatch(re.sub(r"\s+", "", terminal(actual))):
            raise AssertionError(f"{example.name}: `{command.text}` printed\n{terminal(actual)}\n"
                                 f"but the docs show\n{shown}")


@pytest.fixture(scope="module")
def docs_stack(redis_server: RedisServer, logdir: Path) -> Iterator[Stack]:
    """The API, an inference worker serving the bundled models, and a job worker."""
    stack = Stack(redis_server.url, MODELS, logdir)
    try:
        stack.add_api()
        stack.add_worker()
        add_job_worker(stack)
        stack.wait_ready(timeout=90)
        yield stack
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def page_folders(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Path], Path]:
    """The working folder of each page's examples, made on first use."""
    folders: dict[Path, Path] = {}

    def folder(page: Path) -> Path:
        if page not in folders:
            folders[page] = tmp_path_factory.mktemp(page.stem)
            (folders[page] / "models").symlink_to(MODELS, target_is_directory=True)
        return folders[page]
    return folder


def environment(stack: Stack) -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)
    return {**stack.env, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
            "CONVEYOR_URL": stack.url, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}


EXAMPLES = examples()


def skip_marks(example: Example) -> list[pytest.MarkDecorator]:
    if example.not_run is not None:
        return [pytest.mark.skip(reason=f"{example.name} not run: {example.not_run}")]
    if example.missing_tools:
        return [pytest.mark.skip(reason=f"{example.name} needs {', '.join(example.missing_tools)}, "
                                        "which is not installed (make deps)")]
    return []


@pytest.mark.parametrize("example", [
    pytest.param(example, id=example.name, marks=skip_marks(example)) for example in EXAMPLES])
def test_example_runs_as_written(example: Example, docs_stack: Stack,
                                 page_folders: Callable[[Path], Path]) -> None:
    commands: list[Command] = []
    if example.language in PYTHON:
        argv, code = [sys.executable, "-c"], example.body
    else:
        code, commands = script(example)
        argv = ["bash", "-euo", "pipefail", "-c"]
    address = docs_stack.url.removeprefix("http://")
    done = subprocess.run([*argv, code.replace(DOCS_ADDRESS, address)], cwd=page_folders(example.path),
                          env=environment(docs_stack), stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=TIMEOUT_S,
                          check=False)
    # Bytes, not text mode: text mode would turn the progress bar's carriage returns into lines.
    output = done.stdout.decode(errors="replace")
    assert done.returncode == 0, f"{example.name} exited {done.returncode}:\n{terminal(output)[-4000:]}"
    if example.output_checked:
        check_output(example, commands, output)


def test_every_marker_stands_before_an_example_and_says_why() -> None:
    stray = []
    for path in DOCS:
        lines = path.read_text().splitlines()
        for number, line in enumerate(lines):
            if not re.match(r"<!--\s*(not run|output not checked)", line.strip()):
                continue
            marker = MARKER.match(line.strip())
            following = next((later for later in lines[number + 1:] if later.strip()), "")
            fence = FENCE.match(following)
            examples = CONSOLE if marker and marker["kind"] == "output not checked" else (
                SHELL | CONSOLE | PYTHON)
            if marker is None or not marker["why"] or fence is None or fence[1] not in examples:
                stray.append(f"{path.relative_to(ROOT)}:{number + 1}: {line.strip()}")
    assert stray == [], "a marker without a reason, or not right before an example it fits"
    assert sum(example.not_run is None for example in EXAMPLES) >= 5


def test_an_example_whose_tool_is_missing_is_skipped_with_its_name(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    example = Example(ROOT / "docs" / "benchmarking.md", 1, "console",
                      "$ conveyor bench digits --protocol grpc\n", None)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert example.missing_tools == ["h2load", "wrk"]
    (mark,) = skip_marks(example)
    assert "needs h2load, wrk" in mark.kwargs["reason"]
    for tool in ("wrk", "h2load"):
        (tmp_path / tool).write_text("#!/bin/sh\n")
        (tmp_path / tool).chmod(0o755)
    assert example.missing_tools == [] and skip_marks(example) == []
