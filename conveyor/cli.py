"""The ``conveyor`` console script."""

from __future__ import annotations

import argparse

from conveyor import bench_cli, jobs_cli, launcher, models_cli


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="conveyor", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="start Redis (if needed), the API, a worker and Flower")
    run.add_argument("--host", default=None,
                     help="address every listener binds (default: CONVEYOR_HOST, 127.0.0.1)")
    jobs_cli.add_parser(commands)
    models_cli.add_parser(commands)
    bench_cli.add_parser(commands)
    args = parser.parse_args(argv)
    if args.command == "run":
        return launcher.run(args.host)
    if args.command == "jobs":
        return jobs_cli.run(args)
    if args.command == "models":
        return models_cli.run(args)
    if args.command == "bench":
        return bench_cli.run(args)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
