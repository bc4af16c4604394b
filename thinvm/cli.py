"""The `thinvm` command: a thin layer over the library."""

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from thinvm import pool
from thinvm.balance import cli as balance_cli
from thinvm.errors import ThinvmError
from thinvm.fleet import cli as fleet_cli
from thinvm.guest.agent import shell_line
from thinvm.progress import ProgressLine
from thinvm.qemu import accel, builds
from thinvm.units import format_size, parse_size
from thinvm.vm import balloon, migrate, registry
from thinvm.vm.machine import BalloonOptions, VMConfig, install_signal_handlers


def add_vm_options(parser: argparse.ArgumentParser) -> None:
    """Options shared by every command that launches a guest."""
    parser.add_argument("--build", default="stock", help="QEMU build: stock or patched")
    parser.add_argument("--memory", "-m", default="2G", help="guest RAM (e.g. 2G, 512M)")
    parser.add_argument("--cpus", type=int, default=1)
    parser.add_argument("--accel", default="auto", help="auto, tcg or kvm")
    parser.add_argument("--kernel", default="6.1", help="guest kernel: 6.1 or 6.12")
    parser.add_argument(
        "--driver", default="stock", help="guest balloon driver: stock, thinvm, none, or a .ko"
    )
    parser.add_argument("--backend", default="ram", help="ram, memfd or file:PATH")
    parser.add_argument("--prealloc", action="store_true", help="preallocate guest RAM")
    parser.add_argument("--prealloc-threads", type=int, default=1)
    parser.add_argument(
        "--no-reserve", action="store_true", help="do not reserve swap/RAM for guest memory"
    )
    parser.add_argument("--no-balloon", action="store_true", help="no virtio-balloon device")
    parser.add_argument("--deflate-on-oom", action="store_true")
    parser.add_argument("--free-page-hint", action="store_true")
    parser.add_argument("--free-page-reporting", action="store_true")
    parser.add_argument(
        "--ranges", action="store_true", help="offer page-range ballooning (--build patched)"
    )


def config_from_args(args: argparse.Namespace, name: str = "thinvm") -> VMConfig:
    builds.check_flavour(args.build)
    if args.cpus < 1:
        raise ThinvmError(f"--cpus must be at least 1, not {args.cpus}")
    return VMConfig(
        name=name,
        build=args.build,
        memory=parse_size(args.memory),
        cpus=args.cpus,
        accel=args.accel,
        kernel=args.kernel,
        guest_driver=args.driver,
        backend=args.backend,
        prealloc=args.prealloc,
        prealloc_threads=args.prealloc_threads,
        reserve=not args.no_reserve,
        balloon=BalloonOptions(
            enabled=not args.no_balloon,
            deflate_on_oom=args.deflate_on_oom,
            free_page_hint=args.free_page_hint,
            free_page_reporting=args.free_page_reporting,
            ranges=args.ranges,
        ),
    )


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


def cmd_up(args: argparse.Namespace) -> int:
    config = config_from_args(args, args.name)
    if args.pool is not None:
        config.pool = str(_pool_root(args.pool))
    vm = registry.up(config)
    if vm.pool_note:
        print(f"thinvm: {args.name}: {vm.pool_note}", file=sys.stderr)
    print(
        f"{args.name}: up (pid {vm.pid}, {vm.accel}, {format_size(vm.config.memory)}, "
        f"agent ready after {vm.boot_seconds:.1f} s); serial log {vm.serial_log}"
    )
    if vm.pool_lease is not None:
        print(f"{args.name}: RAM from {vm.pool_lease.describe()}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    names = [args.name] if args.name else registry.names()
    if not names:
        print("no VMs running (start one with 'thinvm up')")
    for name in names:
        with registry.attached(name) as vm:
            status = vm.qmp("query-status")["status"]
            mem = vm.host_memory()
            line = (
                f"{name}: {status}, guest {format_size(vm.config.memory)}, "
                f"host RSS {format_size(mem.rss)} (THP {format_size(mem.anon_huge)})"
            )
            if vm.config.balloon.enabled:
                line += f", balloon actual {format_size(balloon.query(vm).actual)}"
            if vm.operator_target is not None:
                line += f" (held at {format_size(vm.operator_target)}: thinvm balloon)"
            print(line)
    return 0


def cmd_balloon(args: argparse.Namespace) -> int:
    with registry.attached(args.name) as vm:
        if not vm.config.balloon.enabled:
            raise ThinvmError(f"VM {args.name!r} has no balloon device")
        if args.size == "auto":
            registry.set_operator_target(vm, None)
            print(f"{args.name}: balloon left to the balance controller")
            return 0
        target = parse_size(args.size)
        balloon.check_target(vm, target)
        before = vm.host_memory().rss
        # Recorded first, so that a balance controller leaves the VM alone
        # from now on rather than undoing the target while we wait for it.
        registry.set_operator_target(vm, target)
        balloon.set_target(vm, target)
        seconds = balloon.wait_actual(vm, target, timeout=args.timeout)
        after = vm.host_memory().rss
        print(
            f"{args.name}: actual {format_size(balloon.query(vm).actual)} after {seconds:.2f} s; "
            f"host RSS {format_size(before)} -> {format_size(after)}"
        )
    return 0


def _warn(note: str) -> None:
    print(f"thinvm: {note}", file=sys.stderr)


def _progress_printer() -> tuple[ProgressLine, migrate.Progress]:
    line = ProgressLine()
    return line, lambda info: line.update(migrate.describe_progress(info))


def cmd_migrate(args: argparse.Namespace) -> int:
    with registry.attached(args.name) as src:
        if args.sparse and src.config.build != "patched":
            raise ThinvmError(
                "--sparse needs the patched QEMU build: start the VM with --build patched"
            )
        if args.postcopy is not None and args.postcopy < 0:
            raise ThinvmError(f"--postcopy {args.postcopy:g}: want seconds, 0 or more")
        # Said both ways: a VM that arrived by an earlier migration still has
        # the capabilities it was received with.
        caps = {"postcopy-ram": args.postcopy is not None}
        if src.config.build == "patched":
            caps["sparse-ram"] = args.sparse
        line, progress = _progress_printer()
        try:
            if args.uri:
                result = registry.migrate_to_uri(
                    src, args.uri, caps, progress, args.postcopy, warn=_warn
                )
            else:
                result = registry.migrate_locally(src, caps, progress, args.postcopy, warn=_warn)
        finally:
            line.done()
    postcopy = int(result.raw.get("ram", {}).get("postcopy-bytes", 0))
    print(
        f"{args.name}: migrated in {result.total_time_ms} ms (downtime {result.downtime_ms} ms), "
        f"{format_size(result.transferred)} sent, {result.normal_pages} normal + "
        f"{result.zero_pages} zero pages"
        + (f", {format_size(postcopy)} of it in postcopy" if args.postcopy is not None else "")
    )
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    names = registry.names() if args.all else [args.name]
    if not args.all and not args.name:
        raise ThinvmError("name a VM or pass --all")
    for name in names:
        for note in registry.down(name):
            print(f"{name}: {note}", file=sys.stderr)
        print(f"{name}: down")
    return 0


def cmd_exec(args: argparse.Namespace) -> int:
    line = shell_line(args.command)
    with registry.attached(args.name, monitor=False) as vm:
        result = vm.agent.run(line, timeout=args.timeout)
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    return result.status


def cmd_demo(args: argparse.Namespace) -> int:
    from thinvm import demo

    return demo.run(memory=parse_size(args.memory))


def cmd_bench(args: argparse.Namespace) -> int:
    from thinvm.bench import harness as bench

    options = bench.BenchOptions(
        size=parse_size(args.size) if args.size else None,
        runs=args.runs,
        variants=[v for v in (args.variants or "").split(",") if v],
        params=dict(_key_value(p) for p in args.param),
        build=args.build,
        kernel=args.kernel,
        accel=args.accel,
        counter=args.counter,
        net=args.net,
    )
    return bench.main(
        args.scenario,
        options,
        list_only=args.list,
        report_only=args.report,
        results_dir=Path(args.results) if args.results else bench.RESULTS_DIR,
        docs=None if args.no_docs else bench.DOCS_PATH,
    )


def _pool_root(text: str | None) -> Path:
    return Path(text).expanduser() if text else pool.default_root()


def _pool_spec(args: argparse.Namespace) -> pool.PoolSpec:
    if args.count < 1:
        raise ThinvmError(f"--count must be at least 1, not {args.count}")
    sizes = [parse_size(s) for s in args.slot]
    return pool.PoolSpec(
        slots=[size for size in sizes for _ in range(args.count)] if sizes else None,
        kind=args.kind,
        directory=args.files,
        budget=parse_size(args.budget) if args.budget else None,
        watermark=parse_size(args.watermark) if args.watermark else None,
        psi_threshold=args.psi,
        interval=args.interval,
        reserve_hugepages=args.reserve_hugepages,
        cgroup=not args.no_cgroup,
    )


def cmd_pool_start(args: argparse.Namespace) -> int:
    root = _pool_root(args.root)
    pool.configure(root, _pool_spec(args))
    if args.detach:
        pid = pool.spawn_daemon(root)
        print(f"pool daemon running (pid {pid}); log {pool.Pool(root).log_file}")
        return 0
    out = pool.PoolLog()
    try:
        pool.serve(root, out=out)
    finally:
        out.close()
    return 0


def cmd_pool_fill(args: argparse.Namespace) -> int:
    root = _pool_root(args.root)
    pool.configure(root, _pool_spec(args))
    out = pool.PoolLog()
    try:
        pool.serve(root, once=True, out=out)
    finally:
        out.close()
    print("\n".join(pool.format_status(pool.status(root))))
    return 0


def cmd_pool_status(args: argparse.Namespace) -> int:
    status = pool.status(_pool_root(args.root))
    print(json.dumps(status.to_json()) if args.json else "\n".join(pool.format_status(status)))
    return 0


def cmd_pool_stop(args: argparse.Namespace) -> int:
    report = pool.stop(_pool_root(args.root), force=args.force)
    print(f"pool stopped: {report.removed} slots removed")
    for name in report.left_to_vms:
        print(f"  {name or 'a VM'} keeps its slot's memory until it exits")
    return 0


def add_pool_parsers(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    group = sub.add_parser("pool", help="warm pool of pre-zeroed guest RAM (docs/warm-pool.md)")
    psub = group.add_subparsers(dest="pool_command", required=True)
    for name, func, text in (
        ("start", cmd_pool_start, "keep the slots filled (foreground unless --detach)"),
        ("fill", cmd_pool_fill, "fill and scrub the slots once, then exit"),
    ):
        p = psub.add_parser(name, help=text)
        p.add_argument("--root", help="pool state directory (default ~/.cache/thinvm/pool)")
        p.add_argument("--slot", action="append", default=[], help="slot size, e.g. 4G")
        p.add_argument("--count", type=int, default=1, help="slots of each --slot size")
        p.add_argument("--kind", default="auto", help="auto, hugetlbfs or tmpfs")
        p.add_argument("--files", help="directory for slot files (on hugetlbfs or tmpfs)")
        p.add_argument("--budget", help="most memory the slots may hold (default: their sum)")
        p.add_argument("--watermark", help="fill only while MemAvailable stays above (2G)")
        p.add_argument("--psi", type=float, help="shrink above this PSI some avg10, in %% (10)")
        p.add_argument("--interval", type=float, help="seconds between checks (2)")
        p.add_argument(
            "--reserve-hugepages",
            action="store_true",
            help="mount hugetlbfs if needed and grow vm.nr_hugepages as slots fill",
        )
        p.add_argument("--no-cgroup", action="store_true", help="no cgroup of its own")
        if name == "start":
            p.add_argument("--detach", action="store_true", help="run in the background")
        p.set_defaults(func=func)
    p = psub.add_parser("status", help="slots, what they hold, budget and pressure")
    p.add_argument("--root")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_pool_status)
    p = psub.add_parser("stop", help="stop the daemon and give all memory back")
    p.add_argument("--root")
    p.add_argument("--force", action="store_true", help="even with slots leased to VMs")
    p.set_defaults(func=cmd_pool_stop)


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ThinvmError(f"--param {text!r}: use KEY=VALUE")
    return key, value


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

    p = sub.add_parser("up", help="start a VM in the background")
    p.add_argument("--name", default="thinvm")
    add_vm_options(p)
    p.add_argument(
        "--pool",
        nargs="?",
        const="",
        metavar="ROOT",
        help="RAM from a warm pool slot (thinvm pool start), else preallocate",
    )
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("status", help="state, balloon and host memory of VMs")
    p.add_argument("name", nargs="?")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser(
        "balloon",
        help="set the balloon so the guest keeps SIZE ('auto': leave it to thinvm balance)",
    )
    p.add_argument("name")
    p.add_argument(
        "size",
        help="what the guest keeps, e.g. 1G; a balance controller then leaves the VM there "
        "until 'thinvm balloon NAME auto'",
    )
    p.add_argument("--timeout", type=float, default=300.0)
    p.set_defaults(func=cmd_balloon)

    p = sub.add_parser("migrate", help="live-migrate a VM to a new local QEMU")
    p.add_argument("name")
    p.add_argument("--uri", help="migrate to an existing destination, e.g. tcp:127.0.0.1:4444")
    p.add_argument(
        "--sparse", action="store_true", help="skip RAM the host never populated (sparse-ram)"
    )
    p.add_argument(
        "--postcopy",
        type=float,
        metavar="SECONDS",
        help="switch to postcopy this long after the start (0: at once); with --uri the "
        "destination must have postcopy-ram on",
    )
    p.set_defaults(func=cmd_migrate)

    p = sub.add_parser("down", help="stop a VM")
    p.add_argument("name", nargs="?")
    p.add_argument("--all", action="store_true")
    p.set_defaults(func=cmd_down)

    p = sub.add_parser(
        "exec",
        help="run a command in the guest",
        description=EXEC_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("name")
    p.add_argument("command", nargs="*", help="the guest's argv, after '--'")
    p.add_argument("--timeout", type=float, default=300.0)
    p.set_defaults(func=cmd_exec)

    p = sub.add_parser("demo", help="the flagship scenario on the stock and the thinvm stack")
    p.add_argument("--memory", default="2G")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("bench", help="run a benchmark scenario (docs/benchmarks.md)")
    p.add_argument("scenario", nargs="?", help="scenario name (see --list)")
    p.add_argument("--size", help="main size of the scenario (default: per scenario)")
    p.add_argument("--runs", type=int, help="runs per variant (default: per scenario)")
    p.add_argument("--variants", help="comma-separated subset of the variants")
    p.add_argument("--param", action="append", default=[], help="scenario KEY=VALUE")
    p.add_argument("--build", default="stock", help="QEMU build: stock or patched")
    p.add_argument("--kernel", default="6.1", help="guest kernel: 6.1 or 6.12")
    p.add_argument("--accel", default="auto", help="auto, tcg or kvm")
    p.add_argument("--counter", default="auto", help="discard counter: auto, perf, strace")
    p.add_argument("--net", default="loopback", help="migrations over: loopback or veth")
    p.add_argument("--results", help="results directory (default bench/results)")
    p.add_argument("--no-docs", action="store_true", help="do not rewrite docs/benchmarks.md")
    p.add_argument("--list", action="store_true", help="list scenarios and their defaults")
    p.add_argument(
        "--report", action="store_true", help="only regenerate docs/benchmarks.md and plots"
    )
    p.set_defaults(func=cmd_bench)

    add_pool_parsers(sub)
    balance_cli.add_parsers(sub)
    return parser


EXEC_DESCRIPTION = """\
Run a command in the guest and exit with its status.

Everything after '--' is the guest's argv, passed word for word: no
shell sees it, so spaces, quotes, '$' and '>' arrive as given.  For
shell syntax, ask for a shell:

  thinvm exec vm1 -- sh -c 'dd if=/dev/zero of=/tmp/f bs=1M count=8 2>/dev/null'
"""

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
    except KeyboardInterrupt:
        print("thinvm: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
