"""Open-loop points at fixed offered rates, with what every request got.

``python -m bench.fixed_rate mlp_medium 1500,2000,2500`` starts the stack as
:mod:`bench.sweep` does (one per run), prints its closed-loop capacity, sends Poisson (or
``--arrivals on-off``) arrivals at each rate, ``--rounds`` times (1 s warm-up, then
``--seconds`` measured, ``parameters.timeout`` = ``--timeout-ms``, by default
``--target-ms``; round ``k`` draws its arrivals from ``--seed`` + ``k``, by default the
rate) and prints the goodput (200s within the target, per second), the count of each
status, the 200s that came after the target, the requests the inference process shed
unrun (``conveyor_shed_total``; the other 503s are the API's) and where the served
requests' time went (mean queue time, batch size and run time, from /metrics). Where the
sweep takes shares of a capacity it measures once, this takes absolute rates: on a host
whose speed drifts, alternate runs of two variants at the same rates compare them.
"""

from __future__ import annotations

import argparse
import collections
import tempfile
from pathlib import Path

from bench import sweep
from bench.models import write_repository
from bench.sweep_report import Setting

SERVED = ("conveyor_queue_duration_seconds_sum", "conveyor_queue_duration_seconds_count",
          "conveyor_batch_execution_seconds_sum", "conveyor_batch_execution_seconds_count",
          "conveyor_rows_total", "conveyor_shed_total")
"""The /metrics figures of where the served requests' time went, and of those shed."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("rates", type=lambda s: [float(v) for v in s.split(",")],
                        help="offered requests per second, comma-separated")
    parser.add_argument("--window-us", type=int, default=None,
                        help="a fixed window (max_queue_delay_us) instead of the adaptive policy")
    parser.add_argument("--intra-op", type=int, default=None,
                        help="cpu_threads.intra_op of the model (default: derived from the cores)")
    parser.add_argument("--arrivals", choices=sorted(sweep.ARRIVALS), default="poisson")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each rate")
    parser.add_argument("--seed", type=int, default=None,
                        help="of the first round's arrivals (default: the rate)")
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--target-ms", type=float, default=50.0)
    parser.add_argument("--timeout-ms", type=float, default=None,
                        help="each request's parameters.timeout (default: --target-ms)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="conveyor-fixed-rate-") as folder:
        run(args, Path(folder))


def run(args: argparse.Namespace, work: Path) -> None:
    """Every rate of ``args`` on one stack whose repository and logs are in ``work``."""
    setting = Setting(args.window_us is None, args.window_us or 0)
    repo = work / "repo"
    write_repository(repo)
    sweep.write_config(repo, args.model, setting, args.target_ms)
    if args.intra_op is not None:
        with (repo / args.model / "config.yaml").open("a") as config:
            config.write(f"cpu_threads:\n  intra_op: {args.intra_op}\n")
    body = sweep.request_body(args.model, int((args.timeout_ms or args.target_ms) * 1000))
    with sweep.conveyor(args.model, repo, work, body) as stack:
        print(f"closed-loop capacity: {sweep.capacity_rps(stack, 2.0):.0f} req/s", flush=True)
        for rate in args.rates:
            for k in range(args.rounds):
                before = stack.metric(*SERVED)
                seed = (int(rate) if args.seed is None else args.seed) + k
                times = sweep.ARRIVALS[args.arrivals](rate, 1.0 + args.seconds, seed)
                out = sweep.drive(stack, times, 1.0, sweep.connections_for(rate))
                statuses = dict(sorted(collections.Counter(out.statuses).items()))
                late = out.count(200) - out.good(args.target_ms)
                after = stack.metric(*SERVED)
                q_s, q_n, x_s, x_n, rows, shed = (b - a for a, b in zip(before, after, strict=True))
                print(f"{setting.label} {args.arrivals} {rate:.0f} req/s: goodput "
                      f"{out.good(args.target_ms) / args.seconds:.0f} req/s, statuses "
                      f"{statuses}, late 200s {late}, shed by the worker {shed:.0f}, mean queue "
                      f"{q_s / max(q_n, 1) * 1e3:.1f} ms, batch {rows / max(x_n, 1):.1f} rows "
                      f"run in {x_s / max(x_n, 1) * 1e3:.1f} ms, lost {out.lost}, new connections "
                      f"{out.extra_connections}, "
                      f"send lag p99 {out.lag_p99_ms():.1f} ms", flush=True)


if __name__ == "__main__":
    main()
