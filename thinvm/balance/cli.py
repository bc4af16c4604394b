"""`thinvm balance run|status`: a thin layer over thinvm.balance.daemon."""

import argparse
import json
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from thinvm.balance.backends import (
    CgroupBudget,
    DomainRssBudget,
    HostSource,
    LibvirtBackend,
    RssBudget,
    ThinvmBackend,
    VmBackend,
    WholeHost,
)
from thinvm.balance.daemon import (
    Controller,
    claim_state,
    default_state_path,
    format_status,
    load_status,
)
from thinvm.balance.model import VmLimits
from thinvm.balance.policies import POLICIES, make_policy
from thinvm.errors import ThinvmError
from thinvm.units import parse_size

# `balance run`'s exit status for arguments it cannot run with, as
# argparse's own usage errors: thinvm-balance.service does not restart
# on it (RestartPreventExitStatus=), since the same arguments would fail
# the same way again.
CONFIG_ERROR = 2


class ConfigError(ThinvmError):
    """The arguments of `balance run` do not make a controller."""


def _limits_factory(args: argparse.Namespace) -> "LimitsFromArgs":
    floor = parse_size(args.floor) if args.floor else None
    if args.floor_fraction is not None and not 0 < args.floor_fraction <= 1:
        raise ConfigError(f"--floor-fraction must be in (0, 1], not {args.floor_fraction}")
    return LimitsFromArgs(floor, args.floor_fraction)


class LimitsFromArgs:
    """Per-VM floor from --floor / --floor-fraction; ceiling = the VM's RAM."""

    def __init__(self, floor: int | None, fraction: float | None) -> None:
        self.floor, self.fraction = floor, fraction

    def __call__(self, max_memory: int) -> VmLimits:
        default = VmLimits.default_for(max_memory)
        floor = default.floor
        if self.fraction is not None:
            floor = int(max_memory * self.fraction)
        if self.floor is not None:
            floor = self.floor
        return VmLimits(floor=min(floor, max_memory), ceiling=max_memory)


def _log(line: str) -> None:
    print(line, flush=True)


def host_path_view(root: str) -> Callable[[str], Path]:
    """Where a controller that sees the host's root at `root` (a container
    with it mounted there) finds a path libvirt gave on the host, such as
    the agent channel's socket."""
    if not Path(root).is_dir():
        raise ConfigError(f"--host-root {root}: not a directory")
    return lambda path: Path(root) / path.lstrip("/")


def controller_from(args: argparse.Namespace) -> Controller:
    """The controller `balance run ARGS` runs; ConfigError if there is none."""
    if args.interval <= 0:
        raise ConfigError(f"--interval must be positive, not {args.interval}")
    if args.cycles is not None and args.cycles < 0:
        raise ConfigError(f"--cycles must be 0 or more, not {args.cycles}")
    if args.cgroup and args.budget:
        raise ConfigError("--cgroup and --budget both set a budget: give one")
    try:
        backend: VmBackend
        if args.host_root and not args.connect:
            raise ConfigError("--host-root maps libvirt's paths: it needs --connect")
        if args.connect:
            outside = host_path_view(args.host_root) if args.host_root else Path
            backend = LibvirtBackend(args.connect, names=args.vm, log=_log, outside=outside)
        else:
            backend = ThinvmBackend(names=args.vm, log=_log)
        host: HostSource = WholeHost()
        if args.cgroup:
            host = CgroupBudget(args.cgroup)
        elif args.budget and isinstance(backend, LibvirtBackend):
            host = DomainRssBudget(parse_size(args.budget), backend)
        elif args.budget and isinstance(backend, ThinvmBackend):
            host = RssBudget(parse_size(args.budget), backend.pids)
        return Controller(
            backend=backend,
            host=host,
            policy=make_policy(args.policy),
            interval=args.interval,
            state_path=Path(args.state) if args.state else default_state_path(),
            dry_run=args.dry_run,
            default_limits=_limits_factory(args),
            log=_log,
            verbose=args.verbose,
        )
    except ConfigError:
        raise
    except ThinvmError as exc:  # a size or a policy name that does not parse
        raise ConfigError(str(exc)) from exc


def cmd_run(args: argparse.Namespace) -> int:
    try:
        controller = controller_from(args)
    except ConfigError as exc:
        print(f"thinvm: error: {exc}", file=sys.stderr)
        return CONFIG_ERROR
    assert controller.state_path is not None
    lock = claim_state(controller.state_path)
    try:
        controller.resume()
        _log(
            f"balance: policy {args.policy}, backend {controller.backend.name}, "
            f"every {args.interval:g} s"
            f"{' (dry run: no targets are set)' if args.dry_run else ''}; "
            f"state {controller.state_path}"
        )
        stop = _StopOnSignal()
        controller.run(cycles=args.cycles, stop=stop)
        if stop.signum is not None:
            name = signal.Signals(stop.signum).name
            _log(f"balance: stopped by {name} after cycle {controller.cycle - 1}")
    finally:
        lock.release()
    return 0


class _StopOnSignal:
    """SIGTERM, SIGINT or SIGHUP ends the loop between cycles.

    The process-wide handler raises SystemExit wherever the signal lands,
    often inside a QMP exchange, which left a traceback in the log of every
    stop and could cut a cycle between saving a target and sending it.  A
    second signal still exits at once.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: object) -> None:
        if self.signum is not None:
            raise SystemExit(128 + signum)
        self.signum = signum

    def __call__(self) -> bool:
        return self.signum is not None


def cmd_status(args: argparse.Namespace) -> int:
    data = load_status(Path(args.state) if args.state else default_state_path())
    print(json.dumps(data, indent=1) if args.json else "\n".join(format_status(data)))
    return 0


def add_parsers(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    group = sub.add_parser("balance", help="automatic balloon controller (docs/balance.md)")
    bsub = group.add_subparsers(dest="balance_command", required=True)
    p = bsub.add_parser("run", help="run the controller in the foreground")
    p.add_argument("--policy", default="thinvm", choices=sorted(POLICIES))
    p.add_argument("--dry-run", action="store_true", help="print decisions, set nothing")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between cycles (5)")
    p.add_argument("--connect", metavar="URI", help="libvirt domains at URI, not thinvm VMs")
    p.add_argument(
        "--host-root",
        metavar="DIR",
        help="with --connect: the host's / is mounted at DIR here (a container)",
    )
    p.add_argument(
        "--vm", action="append", default=[], help="manage only this VM/domain (repeatable)"
    )
    p.add_argument("--cgroup", help="the guests share this memory cgroup's limit")
    p.add_argument("--budget", help="the guests share this much host RSS (e.g. 48G)")
    p.add_argument("--floor", help="never balloon a guest below this (default: 1/4 of its RAM)")
    p.add_argument("--floor-fraction", type=float, help="floor as a fraction of guest RAM")
    p.add_argument("--cycles", type=int, help="stop after this many cycles")
    p.add_argument("--state", help=f"state file (default {default_state_path()})")
    p.add_argument("--verbose", "-v", action="store_true", help="also log decisions to hold")
    p.set_defaults(func=cmd_run)
    p = bsub.add_parser("status", help="per-VM targets and why, from the state file")
    p.add_argument("--state")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_status)
