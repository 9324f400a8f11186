"""The GPU benchmark's report (bench/RESULTS-gpu.md, or OUT/gpu.md for a dry run): the
environment, the raw model's and conveyor's tables and the OOM result, made from the records
alone so that a run cut short still reports what it measured.
"""

from __future__ import annotations

import argparse
import sys

from bench.gpu_models import BENCH_MODEL, NETS
from bench.gpu_record import Recorder


def markdown(rec: Recorder, args: argparse.Namespace) -> str:
    env = next(iter(rec.find("env")), {})
    seconds = rec.find("summary")[-1]["seconds"] if rec.find("summary") else "?"
    lines = [f"# GPU ({env.get('gpu', args.device)}) results", "",
             f"Produced by `{' '.join(['python -m bench.gpu_bench', *sys.argv[1:]])}` (which "
             f"`bash bench/gpu_bench.sh` runs on a GPU machine) in one run of {seconds} s; the "
             "correctness checks are the GPU tests, `make test-gpu`. The CPU benchmark is in "
             "[RESULTS.md](RESULTS.md).", ""]
    lines += [f"- commit: {env.get('commit')}",
              f"- device: {env.get('gpu', args.device)} ({env.get('gpu_memory_gib', '?')} GiB, "
              f"{env.get('multiprocessors', '?')} SMs, capability {env.get('capability', '?')}); "
              f"nvidia-smi: {env.get('nvidia_smi', '-')}",
              f"- host: {env.get('cpus')} CPUs, {env.get('platform')}, Python {env.get('python')}, "
              f"torch {env.get('torch')} (CUDA {env.get('cuda')}, cuDNN {env.get('cudnn')}, "
              f"cudnn.benchmark {env.get('cudnn_benchmark')})",
              "- packages: " + ", ".join(f"{k} {v}" for k, v in (env.get("packages") or {}).items()),
              ""]
    raws = rec.find("raw")
    if raws:
        batches = list(raws[0]["rows_per_s"])
        lines += [f"### Raw model: {NETS[args.net][0]}, uint8 224×224×3 in, "
                  f"{(rec.find('raw_model') or [{}])[0].get('dtype', '?')}, channels_last", "",
                  "| variant | input | batch-1 p50 ms | batch-1 p99 ms | "
                  + " | ".join(f"rows/s @{b}" for b in batches) + " |",
                  "|---|---|---|---|" + "---|" * len(batches)]
        for r in raws:
            cells = [f"{r['rows_per_s'][b]:,}" if b in r["rows_per_s"] else "-" for b in batches]
            lines.append(f"| {r['variant']} | {r['input']} | {r['batch1']['p50_ms']:.2f} | "
                         f"{r['batch1']['p99_ms']:.2f} | " + " | ".join(cells) + " |")
        lines.append("")
    points = [r for r in rec.find("e2e") if "skipped" not in r]
    ceiling: dict[str, int] = next((r["rows_per_s"] for r in raws if r["variant"] == "torchscript"), {})
    if points:
        lines += [f"### conveyor end to end: {BENCH_MODEL} (TorchScript) on "
                  f"{args.device}, {args.api_workers} API processes, {args.instances} inference "
                  f"process(es), "
                  f"load from {points[0].get('client', '?')}", "",
                  "The ceiling is the raw TorchScript model's rows/s (input on the device) at "
                  "the batch size nearest the point's mean batch per request. µs per request: "
                  "each process group's CPU time over the requests answered; compute: the "
                  "model's own time per batch, over its requests.", "",
                  "| protocol | c | req/s | of ceiling | p50 ms | p99 ms | errors | mean batch "
                  "per request | GPU util % | µs/request: API / worker / Redis / client | "
                  "compute µs/request |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for p in points:
            util = (p.get("gpu_util") or {}).get("util_mean_pct", "-")
            us = p.get("us_per_request") or {}
            ceil = _nearest(ceiling, p.get("mean_batch_per_request"))
            share = f"{p['req_per_s'] / ceil:.0%} of {ceil:,}" if ceil else "-"
            lines.append(f"| {p['protocol']} | {p['concurrency']} | {p['req_per_s']:,.0f} | {share} | "
                         f"{p['p50_ms']} | {p['p99_ms']} | {p['errors']} | "
                         f"{p['mean_batch_per_request']} | {util} | "
                         + " / ".join(str(us.get(k, "-")) for k in ("api", "worker", "redis", "client"))
                         + f" | {p.get('compute_us_per_request', '-')} |")
        lines.append("")
    plain = [r for r in rec.find("plain") if "skipped" not in r]
    if plain:
        best = {p["concurrency"]: p["req_per_s"] for p in points if p["protocol"] == "binary"}
        lines += ["### The plain FastAPI wrapper (bench/gpu_plain.py) on the same device", "",
                  "| c | req/s | p50 ms | p99 ms | errors | GPU util % | CPU s (wrapper / client) "
                  "| conveyor at this c |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in plain:
            util = (r.get("gpu_util") or {}).get("util_mean_pct", "-")
            conv = best.get(r["concurrency"])
            ratio = f"{conv / r['req_per_s']:.1f}×" if conv and r["req_per_s"] else "-"
            lines.append(f"| {r['concurrency']} | {r['req_per_s']:,.0f} | {r['p50_ms']} | "
                         f"{r['p99_ms']} | {r['errors']} | {util} | {r['cpu_s']['plain']} / "
                         f"{r['cpu_s']['client']} | {ratio} |")
        lines.append("")
    for r in rec.find("oom_result"):
        lines += ["### OOM on the device", "",
                  f"- passed: **{r['passed']}** (simulated: {r['simulated']}); limit "
                  f"{r['limit_rows']} rows; all requests answered 200 and right: "
                  f"{r['all_requests_ok']}; oom_count {r['oom_count']}; heartbeat row_cap "
                  f"{r['row_caps']}; batches taken by size (before OOM splits) {r['taken_batch_sizes']}", ""]
    lines += ["Phases: " + ", ".join(f"{k}: {v}" for k, v in rec.find("summary")[-1]["phases"].items())
              if rec.find("summary") else "", ""]
    return "\n".join(lines)


def _nearest(rows_per_s: dict[str, int], batch: float | None) -> int | None:
    """The raw rows/s measured at the batch size nearest ``batch``."""
    if not rows_per_s or not batch:
        return None
    size = min(rows_per_s, key=lambda b: abs(int(b) - batch))
    return rows_per_s[size]
