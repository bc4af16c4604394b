"""`thinvm up|status|balloon|migrate|down|exec`: detached VMs by name,
a thin layer over thinvm.vm.registry."""

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator

from thinvm.errors import ThinvmError
from thinvm.guest.agent import shell_line
from thinvm.pool import cli as pool_cli
from thinvm.progress import ProgressLine
from thinvm.qemu import builds
from thinvm.units import format_size, parse_size, seconds, seconds_or_zero
from thinvm.vm import balloon, migrate, registry, resize
from thinvm.vm import trim as vm_trim
from thinvm.vm.machine import VM, BalloonOptions, VMConfig
from thinvm.vm.stack import caps_for

EXEC_DESCRIPTION = """\
Run a command in the guest and exit with its status.

Everything after '--' is the guest's argv, passed word for word: no
shell sees it, so spaces, quotes, '$' and '>' arrive as given.  For
shell syntax, ask for a shell:

  thinvm exec vm1 -- sh -c 'dd if=/dev/zero of=/tmp/f bs=1M count=8 2>/dev/null'
"""


def vm_name(text: str) -> str:
    """argparse type: a name a detached VM can have (registry.check_name)."""
    try:
        return registry.check_name(text)
    except ThinvmError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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
    parser.add_argument(
        "--deflate-on-oom",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="let the guest take memory back from the balloon rather than run out "
        "(default: on; docs/architecture.md, 'Balloon safety')",
    )
    parser.add_argument("--free-page-hint", action="store_true")
    parser.add_argument("--free-page-reporting", action="store_true")
    parser.add_argument(
        "--ranges", action="store_true", help="offer page-range ballooning (--build patched)"
    )
    parser.add_argument(
        "--virtio-mem",
        default="0",
        metavar="SIZE",
        help="a virtio-mem device the guest can grow by, beyond --memory (docs/resize.md)",
    )
    parser.add_argument(
        "--virtio-mem-plugged",
        default="0",
        metavar="SIZE",
        help="how much of --virtio-mem the guest has at start (default 0: it boots with "
        "--memory and grows with 'thinvm resize')",
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
        virtio_mem=parse_size(args.virtio_mem),
        virtio_mem_plugged=parse_size(args.virtio_mem_plugged),
    )


def cmd_up(args: argparse.Namespace) -> int:
    config = config_from_args(args, args.name)
    if args.pool is not None:
        config.pool = str(pool_cli.pool_root(args.pool))
    try:
        vm = registry.up(config)
    except PermissionError as exc:
        raise _pool_permission_error(config.pool, exc) from exc
    if vm.pool_note:
        print(f"thinvm: {args.name}: {vm.pool_note}", file=sys.stderr)
    memory = format_size(config.memory)
    if config.virtio_mem:
        memory += f" + up to {format_size(config.virtio_mem)} by virtio-mem"
    print(
        f"{args.name}: up (pid {vm.pid}, {vm.accel}, {memory}, "
        f"agent ready after {vm.boot_seconds:.1f} s); serial log {vm.serial_log}"
    )
    if vm.pool_lease is not None:
        print(f"{args.name}: RAM from {vm.pool_lease.describe()}")
    if config.virtio_mem_plugged:
        _wait_initial_plug(config)
    return 0


def _pool_permission_error(pool: str | None, exc: PermissionError) -> Exception:
    """A warm pool this user may not use, said in one line (a system pool,
    /var/lib/thinvm/pool, is root's); any other PermissionError goes on."""
    if pool is None or not str(exc.filename or "").startswith(pool):
        return exc
    return ThinvmError(
        f"cannot use the warm pool at {pool}: permission denied on {exc.filename}; "
        "a pool is used by the user who started it (root for the system pool): run as "
        "that user, or start the VM without --pool"
    )


def _wait_initial_plug(config: VMConfig) -> None:
    """`up` returns with the guest at the size asked for, or says why not."""
    line = ProgressLine(f"{config.name}: ")
    with registry.attached(config.name) as vm:
        try:
            seconds = resize.wait_plugged(
                vm, config.virtio_mem_plugged, progress=_resize_progress(line)
            )
        finally:
            line.done()
    print(f"{config.name}: {format_size(config.virtio_mem_plugged)} plugged after {seconds:.1f} s")


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
                line += _held_note(vm)
            if vm.config.virtio_mem:
                line += f", {resize.describe(vm)}"
            print(line)
    return 0


def _held_note(vm: VM) -> str:
    """What an operator's hold means, for the status line.

    Without virtio-mem both `thinvm balloon` and `thinvm resize` record a
    balloon target.  With it, `resize` records the total size and `balloon`
    a balloon target, and the state does not say which: name neither size,
    only that the VM stays where it is and how to release it.
    """
    name = vm.config.name
    if vm.config.virtio_mem:
        return f" (held by an operator; 'thinvm resize {name} auto' releases it)"
    target = format_size(vm.operator_target or 0)
    return f" (held at {target}; 'thinvm balloon {name} auto' releases it)"


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
        if not args.force:
            balloon.check_guest_floor(vm, target)
        before = vm.host_memory().rss
        back_to = vm.operator_target or balloon.query(vm).actual
        with _held(vm, target):
            seconds = balloon.move(vm, target, back_to=back_to, timeout=args.timeout)
        after = vm.host_memory().rss
        print(
            f"{args.name}: actual {format_size(balloon.query(vm).actual)} after {seconds:.2f} s; "
            f"host RSS {format_size(before)} -> {format_size(after)}"
        )
    return 0


@contextlib.contextmanager
def _held(vm: VM, target: int) -> Iterator[None]:
    """Hold the VM at `target` for an operator (registry.set_operator_target).

    Recorded first, so that a balance controller leaves the VM alone from
    now on rather than undoing the target while we wait for it.  If the
    guest does not get there, the hold before this command is restored
    (none: the controller manages the VM again), so that a failed command
    does not lock the controller out of a VM nobody holds any more.
    """
    previous = vm.operator_target
    registry.set_operator_target(vm, target)
    try:
        yield
    except BaseException as exc:
        with contextlib.suppress(ThinvmError, OSError):
            registry.set_operator_target(vm, previous)
        if isinstance(exc, ThinvmError):
            raise ThinvmError(f"{exc}; {_hold_note(vm.config.name, previous)}") from exc
        raise


def _hold_note(name: str, previous: int | None) -> str:
    if previous is None:
        return f"{name} is not held: the balance controller manages it again"
    return f"{name} is held at {format_size(previous)} as before"


def _resize_progress(line: ProgressLine) -> resize.Progress:
    return lambda now, wanted: line.update(f"{format_size(now)} of {format_size(wanted)}")


def cmd_resize(args: argparse.Namespace) -> int:
    with registry.attached(args.name) as vm:
        if args.size == "auto":
            registry.set_operator_target(vm, None)
            print(f"{args.name}: size left to the balance controller")
            return 0
        plan = resize.plan_for(vm, parse_size(args.size))
        if plan.note:
            _warn(f"{args.name}: {plan.note}")
        if plan.lever is resize.Lever.BALLOON:
            return _resize_by_balloon(vm, plan, args)
        # As 'thinvm balloon' does: a balance controller leaves it there
        # (recorded as the total with virtio-mem).  A request the guest
        # does not meet in time stands (docs/resize.md), and so does the hold.
        registry.set_operator_target(vm, plan.size)
        before = vm.host_memory().rss
        line = ProgressLine(f"{args.name}: ")
        try:
            result = resize.apply(vm, plan, args.timeout, _resize_progress(line))
        finally:
            line.done()
        after = vm.host_memory().rss
    _print_resized(args.name, result, before, after)
    return 0


def _resize_by_balloon(vm: VM, plan: resize.Plan, args: argparse.Namespace) -> int:
    """`thinvm resize` on a VM without virtio-mem: as `thinvm balloon` does."""
    if not args.force:
        balloon.check_guest_floor(vm, plan.target)
    before = vm.host_memory().rss
    back_to = vm.operator_target or balloon.query(vm).actual
    with _held(vm, plan.target):
        seconds = balloon.move(vm, plan.target, back_to=back_to, timeout=args.timeout)
    after = vm.host_memory().rss
    result = resize.ResizeResult(plan.lever, balloon.query(vm).actual, seconds)
    _print_resized(vm.config.name, result, before, after)
    return 0


def _print_resized(name: str, result: resize.ResizeResult, before: int, after: int) -> None:
    print(
        f"{name}: {format_size(result.size)} by {result.lever} after "
        f"{result.seconds:.2f} s; host RSS {format_size(before)} -> {format_size(after)}"
    )


def _warn(note: str) -> None:
    print(f"thinvm: {note}", file=sys.stderr)


def _progress_printer() -> tuple[ProgressLine, migrate.Progress]:
    line = ProgressLine()
    return line, lambda info: line.update(migrate.describe_progress(info))


def cmd_migrate(args: argparse.Namespace) -> int:
    with registry.attached(args.name) as src:
        caps = caps_for(src.config.build, sparse=args.sparse, postcopy=args.postcopy is not None)
        if args.trim:
            vm_trim.before_migration(src, args.name)
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
    in_postcopy = f", {format_size(result.postcopy_bytes)} of it in postcopy"
    print(
        f"{args.name}: migrated in {result.total_time_ms} ms (downtime {result.downtime_ms} ms), "
        f"{format_size(result.transferred)} sent, {result.normal_pages} normal + "
        f"{result.zero_pages} zero pages" + (in_postcopy if args.postcopy is not None else "")
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


def _add_sizing(
    sub: "argparse._SubParsersAction[argparse.ArgumentParser]",
    command: str,
    func: Callable[[argparse.Namespace], int],
    help_text: str,
    size: str,
) -> None:
    """`thinvm COMMAND NAME SIZE|auto`: an operator's size, which a balance
    controller then leaves alone until `thinvm COMMAND NAME auto`."""
    p = sub.add_parser(command, help=help_text)
    p.add_argument("name", type=vm_name)
    p.add_argument(
        "size",
        help=f"{size}; a balance controller then leaves the VM there until "
        f"'thinvm {command} NAME auto'",
    )
    p.add_argument(
        "--timeout",
        type=seconds,
        default=300.0,
        help="seconds the guest may take to get there; if it does not, the target and "
        "the hold are set back to what they were (default: %(default)s)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="a balloon target below what the guest uses plus "
        f"{format_size(balloon.GUEST_HEADROOM)} (refused without it)",
    )
    p.set_defaults(func=func)


def add_parsers(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser("up", help="start a VM in the background")
    p.add_argument("--name", type=vm_name, default="thinvm")
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
    p.add_argument("name", nargs="?", type=vm_name)
    p.set_defaults(func=cmd_status)

    _add_sizing(
        sub,
        "balloon",
        cmd_balloon,
        "set the balloon so the guest keeps SIZE ('auto': leave it to thinvm balance)",
        "what the guest keeps, e.g. 1G",
    )
    _add_sizing(
        sub,
        "resize",
        cmd_resize,
        "grow or shrink a VM to SIZE in total, by virtio-mem if it has it, else the balloon",
        "the guest's total memory, e.g. 1G (virtio-mem: rounded to its blocks)",
    )

    p = sub.add_parser("migrate", help="live-migrate a VM to a new local QEMU")
    p.add_argument("name", type=vm_name)
    p.add_argument("--uri", help="migrate to an existing destination, e.g. tcp:127.0.0.1:4444")
    p.add_argument(
        "--sparse", action="store_true", help="skip RAM the host never populated (sparse-ram)"
    )
    p.add_argument(
        "--postcopy",
        type=seconds_or_zero,
        metavar="SECONDS",
        help="switch to postcopy this long after the start (0: at once); with --uri the "
        "destination must have postcopy-ram on",
    )
    p.add_argument("--trim", action="store_true", help="first have the guest give back cold memory")
    p.set_defaults(func=cmd_migrate)

    vm_trim.add_parser(sub, registry.attached)

    p = sub.add_parser("down", help="stop a VM")
    p.add_argument("name", nargs="?", type=vm_name)
    p.add_argument("--all", action="store_true")
    p.set_defaults(func=cmd_down)

    p = sub.add_parser(
        "exec",
        help="run a command in the guest",
        description=EXEC_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("name", type=vm_name)
    p.add_argument("command", nargs="*", help="the guest's argv, after '--'")
    p.add_argument("--timeout", type=seconds, default=300.0, help="seconds (default: %(default)s)")
    p.set_defaults(func=cmd_exec)
