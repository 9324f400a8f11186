"""``conveyor jobs``: submit, watch, fetch and cancel async jobs (docs/jobs.md).

    conveyor jobs submit rows.npy --model digits           # progress bar until it ends
    conveyor jobs submit rows.npz --model digits --no-wait  # print the id and return
    conveyor jobs status ID
    conveyor jobs watch ID                                  # progress bar until it ends
    conveyor jobs result ID -o out.npz                      # .npy, .npz or .json
    conveyor jobs cancel ID
    conveyor jobs list

With API keys on the server, ``CONVEYOR_API_KEY`` is sent as the bearer key: a job is
seen, listed and cancelled only with the key that submitted it (or an admin key).

Arrays (.npy: the model's one input; .npz: one array per input name) travel as binary
tensors; a .json file is a KServe v2 body (``inputs``, optional ``outputs`` and
``parameters``) sent as it is. A result is saved by the name's suffix: .npy (the one
output), .npz (one array per output name) or .json (the KServe v2 response body).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt

from batching.datatypes import from_numpy, from_raw, to_raw
from batching.settings import Settings

FINISHED = ("SUCCEEDED", "FAILED", "CANCELLED")
POLL_S = 0.5
BAR_WIDTH = 30
TIMEOUT_S = 60.0
SAVED_AS = ".npy (the one output), .npz (every output) or .json (KServe v2 body)"


def add_parser(commands: Any) -> None:
    """Add the ``jobs`` command group to the ``conveyor`` parser's subcommands."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", default=os.environ.get("CONVEYOR_URL")
                        or f"http://127.0.0.1:{Settings().http_port}",
                        help="the conveyor API (default: $CONVEYOR_URL or the local one)")
    jobs = commands.add_parser("jobs", help="submit, watch, fetch and cancel async jobs")
    sub = jobs.add_subparsers(dest="action", required=True)
    submit = sub.add_parser("submit", parents=[common],
                            help="submit FILE (.npy, .npz or KServe v2 .json)")
    submit.add_argument("file", type=Path)
    submit.add_argument("--model", "-m", required=True)
    submit.add_argument("--input", help="input name for a .npy file (default: the model's one)")
    submit.add_argument("--output", action="append", default=[], dest="outputs",
                        help="output to keep (repeatable; default: every output)")
    submit.add_argument("--priority", type=int, default=0,
                        help="1 (highest) .. the model's levels; 0: the lowest (default)")
    submit.add_argument("--callback-url", help="POSTed the job's status when it ends")
    submit.add_argument("--no-wait", action="store_true", help="print the id and return")
    submit.add_argument("-o", "--out", type=Path, help=f"when it succeeds, save the result: {SAVED_AS}")
    status = sub.add_parser("status", parents=[common], help="print a job's state and progress")
    status.add_argument("id")
    watch = sub.add_parser("watch", parents=[common],
                           help="wait for a job to end, with a progress bar; 0 only if it succeeded")
    watch.add_argument("id")
    watch.add_argument("-o", "--out", type=Path, help=f"when it succeeds, save the result: {SAVED_AS}")
    result = sub.add_parser("result", parents=[common], help="fetch a finished job's result")
    result.add_argument("id")
    result.add_argument("-o", "--out", type=Path, help=SAVED_AS)
    cancel = sub.add_parser("cancel", parents=[common], help="cancel a job")
    cancel.add_argument("id")
    listing = sub.add_parser("list", parents=[common], help="list your most recent jobs")
    listing.add_argument("--limit", type=int, default=20)


def run(args: argparse.Namespace) -> int:
    key = os.environ.get("CONVEYOR_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else None
    with httpx.Client(base_url=args.url, timeout=TIMEOUT_S, headers=headers) as client:
        try:
            if args.action == "submit":
                return _submit(client, args)
            if args.action == "status":
                return _print(_call(client, "GET", f"/v1/jobs/{args.id}"))
            if args.action == "watch":
                return _await(client, args.id, args.out)
            if args.action == "result":
                return save_result(client, args.id, args.out)
            if args.action == "list":
                return _print(_call(client, "GET", "/v1/jobs", params={"limit": args.limit}))
            return _print(_call(client, "DELETE", f"/v1/jobs/{args.id}"))
        except CliError as exc:
            print(f"conveyor jobs: {exc}", file=sys.stderr)
            return 1
        except httpx.HTTPError as exc:
            print(f"conveyor jobs: cannot reach {args.url}: {exc}", file=sys.stderr)
            return 1


class CliError(Exception):
    pass


def _call(client: httpx.Client, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
    response = client.request(method, path, **kwargs)
    _check(response)
    body: dict[str, Any] = response.json()
    return body


def _check(response: httpx.Response) -> None:
    """Raise the server's error message for an answer that is not a success."""
    if response.is_success:
        return
    try:
        message = response.json().get("error", response.text)
    except ValueError:
        message = response.text[:200]
    raise CliError(f"{response.status_code}: {message}")


def _print(body: dict[str, Any]) -> int:
    print(json.dumps(body, indent=2))
    return 0


def _submit(client: httpx.Client, args: argparse.Namespace) -> int:
    if args.out is not None:
        _save_format(args.out)  # a name we cannot save to fails before the job is queued
    parameters: dict[str, Any] = {"priority": args.priority}
    if args.callback_url:
        parameters["callback_url"] = args.callback_url
    content, headers = _body(client, args, parameters)
    job = _call(client, "POST", "/v1/jobs", content=content, headers=headers)
    if args.no_wait:
        print(job["id"])
        return 0
    print(f"job {job['id']}", file=sys.stderr)
    return _await(client, job["id"], args.out)


def _await(client: httpx.Client, job_id: str, out: Path | None) -> int:
    """Watch the job to its end, print its status, and save its result if it succeeded."""
    if out is not None:
        _save_format(out)
    try:
        status = _watch(client, job_id)
    except KeyboardInterrupt:
        print(f"\nthe job goes on; `conveyor jobs cancel {job_id}` stops it", file=sys.stderr)
        return 130
    _print(status)
    if status["state"] != "SUCCEEDED":
        return 1
    return save_result(client, job_id, out) if out else 0


def _body(client: httpx.Client, args: argparse.Namespace,
          parameters: dict[str, Any]) -> tuple[bytes, dict[str, str]]:
    """The request body: binary tensors for arrays, the file itself for JSON."""
    path: Path = args.file
    outputs = [{"name": name} for name in args.outputs]
    if path.suffix == ".json":
        doc = json.loads(path.read_text())
        if not isinstance(doc, dict) or "inputs" not in doc:
            raise CliError(f"{path} is not a KServe v2 request body (no 'inputs')")
        doc["model"] = args.model
        doc["parameters"] = {**(doc.get("parameters") or {}), **parameters}
        if outputs:
            doc["outputs"] = outputs
        return json.dumps(doc).encode(), {"content-type": "application/json"}
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as archive:
            arrays = {name: archive[name] for name in archive.files}
    elif path.suffix == ".npy":
        arrays = {args.input or _only_input(client, args.model): np.load(path, allow_pickle=False)}
    else:
        raise CliError(f"{path}: expected a .npy, .npz or .json file")
    raws = [to_raw(array) for array in arrays.values()]
    header = json.dumps({
        "model": args.model, "parameters": parameters, "outputs": outputs,
        "inputs": [{"name": name, "datatype": from_numpy(array.dtype), "shape": list(array.shape),
                    "parameters": {"binary_data_size": len(raw)}}
                   for (name, array), raw in zip(arrays.items(), raws, strict=True)],
    }).encode()
    return header + b"".join(raws), {"content-type": "application/octet-stream",
                                     "inference-header-content-length": str(len(header))}


def _only_input(client: httpx.Client, model: str) -> str:
    inputs = _call(client, "GET", f"/v2/models/{model}").get("inputs") or []
    if len(inputs) != 1:
        raise CliError(f"model {model!r} has {len(inputs)} declared inputs: name the one this "
                       "array is with --input, or use an .npz")
    return str(inputs[0]["name"])


def _watch(client: httpx.Client, job_id: str) -> dict[str, Any]:
    """Poll until the job ends, drawing a progress bar on stderr."""
    while True:
        status = _call(client, "GET", f"/v1/jobs/{job_id}")
        done, total = status["progress"]["done"], status["progress"]["total"]
        filled = BAR_WIDTH * done // max(total, 1)
        print(f"\r[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {done}/{total} rows "
              f"{100 * done // max(total, 1):3d}% {status['state']:<9}", end="", file=sys.stderr,
              flush=True)
        if status["state"] in FINISHED:
            print(file=sys.stderr)
            return status
        time.sleep(POLL_S)


def _save_format(out: Path) -> str:
    """The form a result saved as ``out`` takes, from its suffix: a file named .npy holds
    what ``np.load`` reads, never JSON."""
    suffix = out.suffix.lower()
    if suffix not in (".npy", ".npz", ".json"):
        raise CliError(f"-o {out}: name a .npy (the one output), .npz (every output) "
                       "or .json (the KServe v2 body) file")
    return suffix


def save_result(client: httpx.Client, job_id: str, out: Path | None) -> int:
    """Print the result (JSON), or save it by ``out``'s suffix: .npy holds the one output,
    .npz every output by name, .json the KServe v2 response body."""
    if out is None:
        return _print(_call(client, "GET", f"/v1/jobs/{job_id}/result"))
    suffix = _save_format(out)
    if suffix == ".json":
        response = client.get(f"/v1/jobs/{job_id}/result")
        _check(response)
        out.write_bytes(response.content)
    else:
        response = client.get(f"/v1/jobs/{job_id}/result", params={"binary_data_output": "true"})
        _check(response)
        arrays = read_binary_response(response.content,
                                      int(response.headers["inference-header-content-length"]))
        if suffix == ".npz":
            np.savez(out, allow_pickle=False, **arrays)
        elif len(arrays) == 1:
            np.save(out, next(iter(arrays.values())))
        else:
            raise CliError(f"job {job_id} has {len(arrays)} outputs ({', '.join(arrays)}): save "
                           "them as .npz, or submit with --output NAME to keep one")
    print(f"saved {out}", file=sys.stderr)
    return 0


def read_binary_response(body: bytes, header_length: int) -> dict[str, npt.NDArray[Any]]:
    """A KServe v2 binary response's outputs as arrays (BYTES as fixed-width bytes: no pickle)."""
    header = json.loads(body[:header_length])
    arrays: dict[str, npt.NDArray[Any]] = {}
    offset = header_length
    for output in header["outputs"]:
        size = output["parameters"]["binary_data_size"]
        array = from_raw(body[offset:offset + size], output["datatype"], tuple(output["shape"]))
        offset += size
        arrays[output["name"]] = array.astype(np.bytes_) if array.dtype == object else array
    return arrays
