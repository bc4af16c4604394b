"""`thinvm bench`: run a benchmark scenario (docs/benchmarks.md)."""

import argparse
import json
from pathlib import Path

from thinvm.bench import citations, results, runner
from thinvm.bench.quiet import QuietGate
from thinvm.errors import ThinvmError
from thinvm.paths import REPO
from thinvm.units import parse_size


def cmd_status(write: bool) -> int:
    """`thinvm bench status`: check (or, with --write, rewrite) every figure
    in README.md, docs/ and bench/notes.md that cites a record."""
    root = REPO
    if write:
        print(f"{citations.rewrite(root)} figures rewritten from their records")
    verdicts = citations.check_all(root)
    print("\n".join(citations.report(verdicts)))
    bad = [v for v in verdicts if not v.ok]
    print(f"{len(verdicts) - len(bad)} of {len(verdicts)} cited figures hold")
    print("downtime rule, newest record of each migration scenario:")
    for name, path in results.latest_results(runner.RESULTS_DIR).items():
        for prefix, downtime in results.downtime_verdicts(json.loads(path.read_text())).items():
            rows = f", {prefix}rows" if prefix else ""
            print(f"  {name} ({path.stem}{rows}): {downtime.describe()}")
    return 1 if bad else 0


def cmd_bench(args: argparse.Namespace) -> int:
    if args.scenario == "status":
        return cmd_status(args.write)
    options = runner.BenchOptions(
        size=parse_size(args.size) if args.size else None,
        runs=args.runs,
        variants=[v for v in (args.variants or "").split(",") if v],
        params=dict(_key_value(p) for p in args.param),
        build=args.build,
        kernel=args.kernel,
        accel=args.accel,
        counter=args.counter,
        net=args.net,
        quiet_load=args.quiet_load,
        quiet_wait=args.quiet_wait,
        pin_sides=not args.unpinned,
        guest_append=_guest_append(args.guest_append),
        resume=args.resume,
    )
    return runner.main(
        args.scenario,
        options,
        list_only=args.list,
        report_only=args.report,
        results_dir=Path(args.results) if args.results else runner.RESULTS_DIR,
        docs=None if args.no_docs else runner.DOCS_PATH,
    )


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ThinvmError(f"--param {text!r}: use KEY=VALUE")
    return key, value


def _guest_append(text: str) -> str:
    """--guest-append: kernel arguments on one line, as QEMU's -append takes them."""
    if any(c in text for c in "\n\r\0"):
        raise ThinvmError("--guest-append: kernel arguments on one line")
    return " ".join(text.split())


def add_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser("bench", help="run a benchmark scenario (docs/benchmarks.md)")
    p.add_argument(
        "scenario",
        nargs="?",
        help="scenario name (see --list), or 'status': check the figures the manuals "
        "cite from records",
    )
    p.add_argument(
        "--write", action="store_true", help="with 'status': rewrite cited figures from records"
    )
    p.add_argument("--size", help="main size of the scenario (default: per scenario)")
    p.add_argument("--runs", type=int, help="runs per variant (default: per scenario)")
    p.add_argument("--variants", help="comma-separated subset of the variants")
    p.add_argument("--param", action="append", default=[], help="scenario KEY=VALUE")
    p.add_argument("--build", default="stock", help="QEMU build: stock or patched")
    p.add_argument("--kernel", default="6.1", help="guest kernel: 6.1 or 6.12")
    p.add_argument("--accel", default="auto", help="auto, tcg or kvm")
    p.add_argument("--counter", default="auto", help="discard counter: auto, perf, strace")
    p.add_argument("--net", default="loopback", help="migrations over: loopback or veth")
    p.add_argument(
        "--guest-append",
        default="",
        metavar="ARGS",
        help="kernel arguments for every guest the scenario boots, e.g. init_on_alloc=0 "
        "(recorded in the record's parameters; not for the fleet scenarios' libvirt domains)",
    )
    p.add_argument(
        "--unpinned",
        action="store_true",
        help="let a migration's source and destination share every CPU "
        "(default: each on CPUs of its own, as on two hosts)",
    )
    p.add_argument(
        "--resume",
        metavar="STEM",
        help="finish an interrupted record (SCENARIO-STAMP, as its .runs.jsonl is named): "
        "give the same command again; only the runs it lacks are made, and only if the "
        "commit, builds, guest, parameters and gate are the same",
    )
    p.add_argument("--results", help="results directory (default bench/results)")
    p.add_argument("--no-docs", action="store_true", help="do not rewrite docs/benchmarks.md")
    p.add_argument(
        "--quiet-load",
        type=float,
        default=QuietGate.max_load,
        help="a run starts once the 1-minute load is below this (default: %(default)s)",
    )
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=QuietGate.max_wait_s,
        help="seconds a run waits for a quiet machine before it starts anyway and "
        "records what it saw; 0: do not wait (default: %(default)s)",
    )
    p.add_argument("--list", action="store_true", help="list scenarios and their defaults")
    p.add_argument(
        "--report", action="store_true", help="only regenerate docs/benchmarks.md and plots"
    )
    p.set_defaults(func=cmd_bench)
