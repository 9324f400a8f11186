"""Run `wrk` with a fixed POST body and return its summary as a dict.

The Lua `done` hook prints one JSON line, so parsing does not depend on wrk's text report.
wrk counts HTTP status >= 400 as errors (summary.errors.status); connect, read, write and
timeout errors are added to that.
"""

import json
import subprocess
import tempfile
from pathlib import Path
from typing import TypedDict

MARKER = "WRK_JSON "

LUA_TEMPLATE = """\
local f = assert(io.open({body_path}, "rb"))
wrk.method = "POST"
wrk.body = f:read("*a")
f:close()
wrk.headers["Content-Type"] = "application/json"

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '{marker}{{"requests": %d, "duration_us": %d, "errors": %d, "p50_us": %d, "p99_us": %d}}\\n',
    summary.requests, summary.duration,
    e.status + e.connect + e.read + e.write + e.timeout,
    latency:percentile(50.0), latency:percentile(99.0)))
end
"""


class WrkResult(TypedDict):
    rps: float
    p50_ms: float
    p99_ms: float
    errors: int
    requests: int


def _lua_string(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def run_wrk(
    url: str,
    body: str,
    connections: int = 1,
    duration_s: int = 10,
    threads: int = 1,
    timeout_s: int = 10,
) -> WrkResult:
    """POST `body` (JSON) to `url` with `connections` open connections for `duration_s`."""
    with tempfile.TemporaryDirectory(prefix="wrk-") as tmp:
        body_path = Path(tmp) / "body.json"
        body_path.write_text(body)
        script = Path(tmp) / "post.lua"
        lua = LUA_TEMPLATE.format(body_path=_lua_string(str(body_path)), marker=MARKER)
        script.write_text(lua)
        cmd = [
            "wrk", f"-t{threads}", f"-c{connections}", f"-d{duration_s}s",
            f"--timeout={timeout_s}s", "--latency", "-s", str(script), url,
        ]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    line = next(ln for ln in out.splitlines() if ln.startswith(MARKER))
    stats = json.loads(line.removeprefix(MARKER))
    return {
        "rps": stats["requests"] / (stats["duration_us"] / 1e6),
        "p50_ms": stats["p50_us"] / 1e3,
        "p99_ms": stats["p99_us"] / 1e3,
        "errors": stats["errors"],
        "requests": stats["requests"],
    }
