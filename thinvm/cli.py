"""The `thinvm` command: a thin layer over the library."""

import argparse
import importlib.util
import json
import sys
from collections.abc import Callable, Sequence

from thinvm.balance import cli as balance_cli
from thinvm.errors import ThinvmError
from thinvm.fleet import cli as fleet_cli
from thinvm.pool import cli as pool_cli
from thinvm.qemu import accel, builds
from thinvm.units import parse_size
from thinvm.vm import cli as vm_cli
from thinvm.vm.machine import install_signal_handlers


def cmd_version(args: argparse.Namespace) -> int:
    for flavour in builds.FLAVOURS:
        try:
            info = builds.find_build(flavour).describe()
        except ThinvmError as exc:
            info = {"flavour": flavour, "error": str(exc)}
        print(json.dumps(info) if args.json else _format_build(info))
    return 0


def cmd_accel(args: argparse.Namespace) -> int:
    """Print the accelerator `--accel auto` picks (first call runs the probe)."""
    result = accel.probe_cached(builds.find_build(args.build))
    if args.json:
        print(json.dumps(result))
    else:
        print(result["choice"])
    return 0


def _format_build(info: dict[str, object]) -> str:
    if "error" in info:
        return f"{info['flavour']:8} {info['error']}"
    patches = ", ".join(str(p) for p in info["patches"]) or "none"  # type: ignore[attr-defined]
    return (
        f"{info['flavour']:8} {info['version']}  debian {info['debian_version']}  "
        f"patch-hash {info['patch_hash']}  patches: {patches}"
    )


def cmd_demo(args: argparse.Namespace) -> int:
    from thinvm import demo

    return demo.run(memory=parse_size(args.memory))


def cmd_no_bench(_args: argparse.Namespace) -> int:
    raise ThinvmError(
        "this thinvm has no benchmarks (the thinvm package leaves them out): "
        "run 'thinvm bench' from a thinvm source tree, after 'make setup'"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="thinvm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    fleet_cli.add_parsers(sub)

    p = sub.add_parser("version", help="QEMU builds and their patch hashes")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_version)

    p = sub.add_parser("accel", help="the accelerator --accel auto picks, from a timed probe")
    p.add_argument("--build", default="patched", choices=builds.FLAVOURS)
    p.add_argument("--json", action="store_true", help="also the probe's timings")
    p.set_defaults(func=cmd_accel)

    vm_cli.add_parsers(sub)

    p = sub.add_parser("demo", help="the flagship scenario on the stock and the thinvm stack")
    p.add_argument("--memory", default="2G")
    p.set_defaults(func=cmd_demo)

    add_bench_parser(sub)

    pool_cli.add_parsers(sub)
    balance_cli.add_parsers(sub)
    return parser


def add_bench_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """`thinvm bench` where the benchmarks are: a thinvm source tree (the
    thinvm package leaves thinvm.bench out, packaging/build-debs.sh)."""
    if importlib.util.find_spec("thinvm.bench") is None:
        p = sub.add_parser("bench", help="(not installed) benchmarks run from a thinvm source tree")
        p.add_argument("words", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
        p.set_defaults(func=cmd_no_bench)
        return
    from thinvm.bench import cli as bench_cli  # only in a source tree

    bench_cli.add_parser(sub)


# Subcommands whose words after the first `--` are a guest's argv.
GUEST_ARGV_COMMANDS = (("exec",), ("fleet", "exec"))


def split_guest_argv(argv: Sequence[str]) -> tuple[list[str], list[str] | None]:
    """Cut a guest command's argv off at the first `--`, before argparse.

    argparse drops a `--` inside a `nargs` list (`exec vm -- sh -- x`
    would lose it) and its handling of `--` differs between Python
    versions, so what follows `--` never goes through it.
    """
    argv = list(argv)
    for prefix in GUEST_ARGV_COMMANDS:
        if tuple(argv[: len(prefix)]) == prefix and "--" in argv:
            cut = argv.index("--")
            return argv[:cut], argv[cut + 1 :]
    return argv, None


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    head, guest_argv = split_guest_argv(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(head)
    if guest_argv is not None:
        args.command = [*args.command, *guest_argv]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    install_signal_handlers()
    args = parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except ThinvmError as exc:
        print(f"thinvm: error: {exc}", file=sys.stderr)
        return 1
    except PermissionError as exc:
        # A file or directory of root's (a system pool, another user's run
        # directory): one line, not a traceback.
        where = f" on {exc.filename}" if exc.filename else ""
        print(
            f"thinvm: error: permission denied{where}: run as a user who may use it",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt:
        print("thinvm: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
