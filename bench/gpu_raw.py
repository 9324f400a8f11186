"""The GPU benchmark's raw phase: the model without conveyor, the ceiling the end-to-end
figures are read against. Batch-1 latency and rows/s at several batch sizes, eager and
TorchScript, with the input already on the device; then conveyor's own backend (load_model +
predict: numpy in, copies both ways, numpy out), i.e. the inference process without the
serving stack. The phase also exports the model repository the later phases serve.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.gpu_models import BENCH_MODEL, NETS, export_repository, logits, seeded_images
from bench.gpu_record import Recorder


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def time_calls(call: Callable[[], Any], device: str, calls: int, warmup: int) -> dict[str, float]:
    """Per-call wall time (synchronised) of ``call``: p50, p99, mean, in ms."""
    for _ in range(warmup):
        call()
    _sync(device)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return {"p50_ms": round(statistics.median(times), 3), "p99_ms": round(pct(times, 0.99), 3),
            "mean_ms": round(statistics.fmean(times), 3), "calls": calls}


def rows_per_s(call: Callable[[], Any], rows: int, device: str, seconds: float, warmup: int) -> float:
    """Rows/s running ``call`` back to back for ``seconds`` (synchronised at the ends)."""
    for _ in range(warmup):
        call()
    _sync(device)
    calls = 0
    start = time.perf_counter()
    while True:
        call()
        calls += 1
        if calls % 4 == 0 or rows >= 32:
            _sync(device)
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                return calls * rows / elapsed


MANY = 48
"""Distinct images sent at once to check the answers of batched requests."""


class RawPhase:
    """Exports the repository into ``repo`` and times the model; ``reference`` (the eager
    logits of ``seeded_images(1)``) is what the end-to-end answers are compared with, kept
    even when a later step of the phase fails."""

    def __init__(self, rec: Recorder, args: argparse.Namespace, repo: Path) -> None:
        self.rec = rec
        self.args = args
        self.repo = repo
        self.reference: Any = None
        self.many: list[Any] = []
        """The logits of ``seeded_images(1, seed=100 + i)``, i < MANY, one at a time."""

    def run(self) -> None:
        import torch

        args = self.args
        device = args.device
        exported = export_repository(self.repo, device, NETS[args.net][1](), BENCH_MODEL, args.max_batch,
                                     args.oom_rows, args.instances)
        model, traced = exported.eager, exported.traced
        self.rec.emit("raw_model", dtype=str(model.mean.dtype), memory_format="channels_last",
                      params=sum(p.numel() for p in model.parameters()))
        self.rec.emit("repository", path=str(exported.repo),
                      model_pt_mib=round((exported.repo / BENCH_MODEL / "model.pt").stat().st_size
                                         / 2**20, 1))
        one_image = seeded_images(1)
        self.reference = logits(model, one_image, device)
        self.rec.emit("raw_reference", finite=bool(torch.isfinite(torch.from_numpy(self.reference)).all()),
                      argmax=int(self.reference.argmax()),
                      logit_absmax=float(abs(self.reference).max()))
        one = torch.from_numpy(one_image).to(device)
        with torch.inference_mode():
            for variant, module in (("eager", model), ("torchscript", traced)):
                lat = time_calls(functools.partial(module, one), device, args.latency_calls, warmup=20)
                rates = {}
                for bs in args.raw_batches:
                    x = torch.from_numpy(seeded_images(bs, seed=bs)).to(device)
                    rates[str(bs)] = round(rows_per_s(functools.partial(module, x), bs, device,
                                                      args.raw_seconds, warmup=5))
                self.rec.emit("raw", variant=variant, input="on device", batch1=lat,
                              rows_per_s=rates)
        diff = float(abs(logits(traced, one_image, device) - self.reference).max())
        self.rec.emit("raw_trace_check", max_abs_diff_vs_eager=diff)
        # one image at a time, as each request's answer should read however it is batched
        self.many = [logits(traced, seeded_images(1, seed=100 + i), device)
                     for i in range(MANY)]
        del model, traced, exported
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        self._backend_raw()

    def _backend_raw(self) -> None:
        """conveyor's backend without the serving stack: numpy in, copies, numpy out."""
        import torch

        from batching.repository_scan import load_model_config
        from workers.backends import load_model

        args = self.args
        folder = self.repo / BENCH_MODEL
        loaded = load_model(load_model_config(folder), folder, args.device)
        one = {"image": seeded_images(1)}
        lat = time_calls(functools.partial(loaded.predict, one), "cpu", args.latency_calls, warmup=20)
        rates = {}
        for bs in [b for b in args.raw_batches if b <= args.max_batch]:
            batch = {"image": seeded_images(bs, seed=bs)}
            rates[str(bs)] = round(rows_per_s(functools.partial(loaded.predict, batch), bs, "cpu",
                                              args.raw_seconds, warmup=3))
        out = loaded.predict(one)["logits"]
        diff = float(abs(out - self.reference).max()) if self.reference is not None else None
        self.rec.emit("raw", variant="conveyor backend (torchscript, numpy in/out)",
                      input="numpy on host", batch1=lat, rows_per_s=rates,
                      max_abs_diff_vs_eager=diff)
        del loaded
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
