"""`thinvm pool start|fill|status|stop`: a thin layer over thinvm.pool."""

import argparse
import json
import sys
from pathlib import Path

from thinvm import pool
from thinvm.errors import ThinvmError
from thinvm.units import parse_size


def pool_root(text: str | None) -> Path:
    return Path(text).expanduser() if text else pool.default_root()


def pool_spec(args: argparse.Namespace) -> pool.PoolSpec:
    if args.count < 1:
        raise ThinvmError(f"--count must be at least 1, not {args.count}")
    if args.interval is not None:
        pool.check_interval(args.interval)
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
    root = pool_root(args.root)
    pool.configure(root, pool_spec(args))
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
    root = pool_root(args.root)
    pool.configure(root, pool_spec(args))
    out = pool.PoolLog()
    try:
        pool.serve(root, once=True, out=out)
    finally:
        out.close()
    print("\n".join(pool.format_status(pool.status(root))))
    return 0


def cmd_pool_status(args: argparse.Namespace) -> int:
    status = pool.status(pool_root(args.root))
    print(json.dumps(status.to_json()) if args.json else "\n".join(pool.format_status(status)))
    return 0


def cmd_pool_stop(args: argparse.Namespace) -> int:
    report = pool.stop(pool_root(args.root), force=args.force)
    print(f"pool stopped: {report.removed} slots removed")
    for warning in report.warnings:
        print(f"thinvm: warning: {warning}", file=sys.stderr)
    for name in report.left_to_vms:
        print(f"  {name or 'a VM'} keeps its slot's memory until it exits")
    return 0


def add_parsers(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
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
        p.add_argument("--interval", type=float, help="seconds between checks, at least 0.1 (2)")
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
