"""``lockmgr-bench``: lockmgr against threading.Lock and friends, side by side in one run.

Run ``lockmgr-bench --quick`` (or ``python -m lockmgr.bench --quick``); ``--help`` lists the
scenarios and options. The table goes to stdout, progress to stderr (a line rewritten in
place on a terminal, a line per step elsewhere). ``--plot SAVED.json`` draws a run that
``--json`` saved, without measuring.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import sys
from collections.abc import Callable
from typing import Any

from ._asyncio import ASYNC_BASELINE, ASYNC_SCENARIOS, async_implementations
from ._host import HOST_BASELINE, HOST_SUBJECTS, host
from ._limits import REFERENCE as LIMITS_REFERENCE
from ._limits import limits, limits_subjects
from ._measure import Progress, Results, Settings, progress
from ._output import contention_report, contention_runs, header, machine, plot, report_lines, table
from ._servers import PAIRS_BASELINE, postgres_processes, redis_server, server_pairs
from ._singleflight import SINGLEFLIGHT_BASELINE, SINGLEFLIGHT_SUBJECTS, singleflight
from ._threads import (
    ASKED_FOR_ONLY,
    BASELINE,
    PG_SCENARIOS,
    SCENARIOS,
    _engine_module,
    implementations,
)


def parse_args(argv: list[str] | None, impl_names: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="lockmgr-bench",
        description="Compare lockmgr with threading.Lock and friends on this machine.",
    )
    parser.add_argument("--quick", action="store_true", help="short runs: the whole suite in about 2 minutes on a 2-core "
                             "machine (more when it is busy)")
    parser.add_argument("--scenario", action="append",
                        choices=[*SCENARIOS, *ASYNC_SCENARIOS, "host", "limits", "singleflight",
                                 "server-pairs", "distributed"],
                        help="run only this scenario (repeatable; default: all but "
                             "distributed, which runs only when named: it needs --pg-dsn, "
                             "--redis and lockmgr[compare])")
    parser.add_argument("--impl", action="append", choices=impl_names,
                        help="run only this implementation (repeatable; default: all)")
    parser.add_argument("--threads", type=_positive, default=4, help="threads for hot-key, many-keys and fairness (default 4; scaling uses 1, 2 and the CPU count)")
    parser.add_argument("--keys", type=_positive, default=1000, help="distinct keys for many-keys (default 1000)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--plot", metavar="PATH.png|SAVED.json",
                        help="also draw the results into PATH.png (needs lockmgr[plot]); "
                             "given a run saved by --json instead, measure nothing: print "
                             "that run's tables and draw it into SAVED.png beside it "
                             "(--impl picks implementations of it)")
    parser.add_argument("--contention-report", metavar="PATH.png",
                        help="instead of the scenarios: run hot-key and a skewed many-keys "
                             "with lockmgr's metrics on and draw the wait-time histograms and "
                             "the hot keys (needs lockmgr[plot])")
    parser.add_argument("--pg-dsn", metavar="DSN",
                        help="add PostgreSQL (lockmgr[postgres]) to hot-key and many-keys: "
                             "threads of one process, and one process per thread; and to "
                             "server-pairs, beside bare psycopg and libpq loops; distributed "
                             "takes it as a postgresql:// URL (the form tooz reads); host "
                             "puts PgLockManager on it beside lockmgr.host")
    parser.add_argument("--redis", metavar="URL|start",
                        help="server-pairs beside redis-py's Lock, and distributed beside the "
                             "Redis locks, on this Redis server ('start': a throwaway "
                             "redis-server on 127.0.0.1)")
    return parser.parse_args(argv)


#: What ``--scenario distributed`` imports beside lockmgr (module: the package bringing it),
#: all in ``lockmgr[compare]``.
COMPARE_MODULES = {"psycopg": "psycopg", "redis": "redis", "redis_lock": "python-redis-lock",
                   "pottery": "pottery", "tooz": "tooz", "psycopg2": "psycopg2-binary"}


def distributed_refusal(pg_dsn: str | None, redis: str | None) -> str | None:
    """Why ``--scenario distributed`` cannot run with these options here, if it cannot."""
    if not (pg_dsn and redis):
        return "distributed needs --pg-dsn and --redis"
    if not pg_dsn.startswith(("postgresql://", "postgres://")):
        return "distributed needs --pg-dsn as a postgresql:// URL (the form tooz reads)"
    missing = [package for module, package in COMPARE_MODULES.items()
               if importlib.util.find_spec(module) is None]
    if missing:
        return (f"distributed needs lockmgr[compare] ({', '.join(missing)} missing here): "
                "pip install 'lockmgr[compare]'")
    return None


def _option(argv: list[str], name: str) -> str | None:
    """An option's value before argparse runs (it decides which implementations exist)."""
    for index, argument in enumerate(argv):
        if argument == name and index + 1 < len(argv):
            return argv[index + 1]
        if argument.startswith(name + "="):
            return argument.split("=", 1)[1]
    return None


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


Step = tuple[str, Callable[[], None]]


def _plan(args: argparse.Namespace, impls: list[str], available: dict[str, Any],
          async_available: dict[str, Any], settings: Settings,
          results: Results) -> list[Step] | str:
    """The run's steps, each a label and what measures it; or why the options cannot run,
    found before anything is measured."""
    steps: list[Step] = []
    servers = args.pg_dsn or args.redis
    for scenario in args.scenario or [*SCENARIOS, "host", "limits", "singleflight",
                                      *(["server-pairs"] if servers else []), *ASYNC_SCENARIOS]:
        if scenario == "singleflight":
            steps += [(f"singleflight: {name}", functools.partial(singleflight, name, settings,
                                                                  results))
                      for name in SINGLEFLIGHT_SUBJECTS if name in impls]
        elif scenario == "limits":
            steps += [(f"limits: {name}", functools.partial(limits, name, engine, settings,
                                                            results))
                      for name, engine in limits_subjects().items()
                      if not args.impl or name in args.impl]
        elif scenario == "host":
            steps += [(f"host: {name}", functools.partial(host, name, args.pg_dsn, settings,
                                                          results))
                      for name in HOST_SUBJECTS if name in impls]
        elif scenario == "server-pairs":
            if not servers:
                return "server-pairs needs --pg-dsn or --redis (or both)"
            steps.append((scenario, functools.partial(_server_pairs, args, settings, results)))
        elif scenario == "distributed":
            refusal = distributed_refusal(args.pg_dsn, args.redis)
            if refusal:
                return refusal
            steps.append((scenario, functools.partial(_distributed, args, settings, results)))
        elif scenario in ASYNC_SCENARIOS:
            steps += [(f"{scenario}: {name}",
                       functools.partial(_run_async, scenario, name, async_available[name],
                                         settings, results))
                      for name in impls if name in async_available]
        else:
            for name in impls:
                if name not in available:
                    continue
                subject = available[name]()
                if subject.scenarios is None or scenario in subject.scenarios:
                    steps.append((f"{scenario}: {name}", functools.partial(
                        SCENARIOS[scenario], name, subject, settings, results)))
            if args.pg_dsn and scenario in PG_SCENARIOS:
                steps.append((f"{scenario}: postgres-processes", functools.partial(
                    postgres_processes, args.pg_dsn, scenario, settings, results)))
    return steps


def _server_pairs(args: argparse.Namespace, settings: Settings, results: Results) -> None:
    with contextlib.ExitStack() as stack:
        named = {"postgres": args.pg_dsn} if args.pg_dsn else {}
        if args.redis:
            named["redis-py"] = stack.enter_context(redis_server(args.redis))
        server_pairs(named, settings, results)


def _distributed(args: argparse.Namespace, settings: Settings, results: Results) -> None:
    from ._distributed import distributed

    with redis_server(args.redis) as redis_url:
        distributed(args.pg_dsn, redis_url, settings, results)


def _run_async(scenario: str, name: str, make: Callable[[], Any], settings: Settings,
               results: Results) -> None:
    ASYNC_SCENARIOS[scenario](name, make(), settings, results)


def main(argv: list[str] | None = None) -> int:
    pg_dsn = _option(argv if argv is not None else sys.argv[1:], "--pg-dsn")
    available = implementations(pg_dsn)
    async_available = async_implementations()
    args = parse_args(argv, list(dict.fromkeys([*available, *async_available,
                                                *HOST_SUBJECTS, *SINGLEFLIGHT_SUBJECTS])))
    drawing = args.plot or args.contention_report
    if drawing and importlib.util.find_spec("matplotlib") is None:
        option = "--plot" if args.plot else "--contention-report"
        print(f"lockmgr-bench: {option} needs matplotlib: pip install 'lockmgr[plot]'",
              file=sys.stderr)
        return 2
    if args.redis and importlib.util.find_spec("redis") is None:
        print("lockmgr-bench: --redis needs redis-py: pip install 'lockmgr[bench]'",
              file=sys.stderr)
        return 2
    impls = args.impl or [name for name in dict.fromkeys([*available, *async_available,
                                                          *HOST_SUBJECTS, *SINGLEFLIGHT_SUBJECTS])
                           if name not in ASKED_FOR_ONLY]
    settings = Settings(quick=args.quick, threads=args.threads, keys=args.keys)
    if args.contention_report:
        report = contention_runs(_engine_module().LockManager, settings)
        print(header(machine()))
        print("\n".join(report_lines(report)))
        contention_report(report, args.contention_report)
        progress(f"wrote {args.contention_report}")
        return 0
    if args.plot and args.plot.endswith(".json"):
        return _draw_saved(args.plot, args.impl)
    results = Results()
    steps = _plan(args, impls, available, async_available, settings, results)
    if isinstance(steps, str):
        print(f"lockmgr-bench: {steps}", file=sys.stderr)
        return 2
    with Progress(len(steps)) as shown:
        for label, run in steps:
            shown.step(label)
            run()
    about = machine()  # after the runs: whether something they imported turned the GIL on
    columns = _measured_in_order(results, impls)
    _print_tables(about, results, columns)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump({"machine": about, "results": results.rows}, out, indent=2)
        progress(f"wrote {args.json}")
    if args.plot:
        plot(results, columns, args.plot)
        progress(f"wrote {args.plot}")
    return 0


def _measured_in_order(results: Results, impls: list[str]) -> list[str]:
    """The implementations that measured something, in the order asked (those added by
    the run itself, such as postgres-processes or redis-py, after them)."""
    measured = {row["impl"] for row in results.rows}
    return [name for name in dict.fromkeys([*impls, *(row["impl"] for row in results.rows)])
            if name in measured]


def _print_tables(about: dict[str, Any], results: Results, impls: list[str]) -> None:
    """The header, then up to six tables: the thread scenarios (ratios to threading.Lock),
    host (ratios to lockmgr.host), singleflight (ratios to a dict of futures), server-pairs (ratios to the bare libpq loop), the asyncio
    ones (ratios to one asyncio.Lock), and the distributed one (ratios to lockmgr over
    PostgreSQL), each with the implementations it measured as columns; then what the
    tables left out, and why."""
    print(header(about))
    for scenarios, baseline in ((set(SCENARIOS), BASELINE),
                                ({"host"}, HOST_BASELINE),
                                ({"singleflight"}, SINGLEFLIGHT_BASELINE),
                                ({"limits"}, LIMITS_REFERENCE),
                                ({"server-pairs"}, PAIRS_BASELINE),
                                (set(ASYNC_SCENARIOS), ASYNC_BASELINE),
                                ({"distributed"}, "lockmgr")):
        rows = [row for row in results.rows if row["scenario"] in scenarios]
        if not rows:
            continue
        print()
        # The host table's columns in its own order: lockmgr.host first, its ratios' base.
        order = [name for name in HOST_SUBJECTS if name in impls] if "host" in scenarios \
            else [*impls, LIMITS_REFERENCE] if "limits" in scenarios else impls
        print("\n".join(table(results, _measured_in_order(Results(rows), order), baseline,
                              scenarios)))
    if results.notes:
        print()
        print("\n".join(f"- {note}" for note in results.notes))


def _draw_saved(path: str, impls: list[str] | None) -> int:
    """``--plot SAVED.json``: the tables and the picture of a run ``--json`` saved."""
    try:
        with open(path, encoding="utf-8") as saved:
            report = json.load(saved)
        about, rows = report["machine"], report["results"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"lockmgr-bench: --plot {path}: not a run saved by --json ({exc})", file=sys.stderr)
        return 2
    results = Results([row for row in rows if impls is None or row["impl"] in impls])
    columns = _measured_in_order(results, impls or [])
    _print_tables(about, results, columns)
    picture = path.removesuffix(".json") + ".png"
    plot(results, columns, picture)
    progress(f"wrote {picture}")
    return 0
