"""Trim a VM's guest: the guest gives back cold memory (thinvm.guest.trim)
and the host waits until free page reporting has returned it.  `thinvm
trim NAME` and the trim step of `thinvm migrate --trim`."""

import argparse
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager

from thinvm.guest.trim import TrimResult, trim_guest
from thinvm.guest.trim import report as trim_report
from thinvm.units import parse_size, seconds
from thinvm.vm.machine import VM


def trim(
    vm: VM, max_bytes: int = 0, timeout: float = 30.0, settle_timeout: float = 60.0
) -> TrimResult:
    """Trim `vm`'s guest and wait until the host got the memory back."""
    balloon = vm.config.balloon
    return trim_guest(
        vm.agent,
        lambda: vm.host_memory().rss,
        balloon.enabled and balloon.free_page_reporting,
        max_bytes,
        timeout,
        settle_timeout,
    )


Attach = Callable[[str], AbstractContextManager[VM]]


def cmd_trim(args: argparse.Namespace, attached: Attach) -> int:
    max_bytes = parse_size(args.max_bytes) if args.max_bytes else 0
    with attached(args.name) as vm:
        result = trim(vm, max_bytes=max_bytes, timeout=args.timeout)
    return trim_report(result, args.name, args.json)


def add_parser(
    sub: "argparse._SubParsersAction[argparse.ArgumentParser]", attached: Attach
) -> None:
    p = sub.add_parser(
        "trim", help="have a VM's guest give back cold memory now (docs/working-set.md)"
    )
    p.add_argument("name")
    p.add_argument("--max-bytes", help="give back at most this much, e.g. 512M (default: all)")
    p.add_argument(
        "--timeout", type=seconds, default=30.0, help="seconds the guest may spend reclaiming"
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=lambda args: cmd_trim(args, attached))


def before_migration(vm: VM, name: str) -> TrimResult:
    """Trim ahead of a migration: one line either way, never an error."""
    result = trim(vm)
    if result.trimmed:
        print(result.describe(name), flush=True)
    else:
        print(f"thinvm: {name}: not trimmed, migrating anyway: {result.note}", file=sys.stderr)
    return result
