"""Detached VMs by name (`thinvm up`): run directories, listing, attaching,
and the switchovers that change which QEMU a name means.

A detached VM lives in run_dir()/NAME; its state.json names the QEMU (pid,
config).  Several processes use one VM at once (CLI commands, the balance
controller, tests), each through a QMP monitor and agent turn of its own
(thinvm.vm.machine).  What they must never see is the moment a name
changes hands: a local migration replaces the run directory and its QEMU,
`down` removes them.  So every name has a lock, run_dir()/.NAME.lock,
outside the directory a switchover replaces:

- readers (attach) hold it shared while they read state.json and connect;
- `up`, `down`, a migration's switchover and operator targets hold it
  exclusively, for as long as the name is in flux.

A reader that comes during a switchover waits for it and then attaches to
the QEMU that took over, instead of failing on the one that quit.
"""

import contextlib
import re
import secrets
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from thinvm.errors import ThinvmError
from thinvm.host.locks import FileLock
from thinvm.paths import run_dir
from thinvm.vm import migrate
from thinvm.vm.machine import VM, UnreadableState, VMConfig, kill_unreachable, read_state_file

# How long a client waits for a switchover (a QEMU quitting, a VM booting).
LOCK_TIMEOUT = 150.0
# How long a migration waits for a running guest command to finish.
AGENT_QUIET_TIMEOUT = 10.0


# A VM's name is a file name (its run directory, its lock .NAME.lock), a
# word in QEMU's `-name thinvm-NAME` (where a comma would end the value)
# and part of its socket paths, which a UNIX socket address limits to 107
# bytes: 64 characters leave room for those under the default run
# directory (~/.cache/thinvm/run/NAME/qmp-3.sock).
NAME_MAX = 64
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")


def check_name(name: str) -> str:
    """`name` if it can name a detached VM, else ThinvmError saying why not."""
    if len(name) > NAME_MAX or not _NAME_RE.fullmatch(name):
        shown = name if len(name) <= 40 else f"{name[:20]}...{name[-8:]}"
        raise ThinvmError(
            f"bad VM name {shown!r} ({len(name)} characters): use 1 to {NAME_MAX} ASCII "
            "letters, digits, '-' or '_', starting with a letter or digit"
        )
    return name


def rundir(name: str) -> Path:
    return run_dir() / check_name(name)


def names() -> list[str]:
    """Detached VMs that are up, by name (directories with a state file)."""
    if not run_dir().is_dir():
        return []
    found = (p.parent.name for p in run_dir().glob("*/state.json"))
    return sorted(name for name in found if _NAME_RE.fullmatch(name) and len(name) <= NAME_MAX)


@contextlib.contextmanager
def name_lock(name: str, exclusive: bool = False, timeout: float = LOCK_TIMEOUT) -> Iterator[None]:
    """Hold NAME's lock: shared to read which QEMU it is, exclusive to change it."""
    run_dir().mkdir(parents=True, exist_ok=True)
    lock = FileLock(run_dir() / f".{rundir(name).name}.lock")
    if not lock.acquire(timeout, exclusive=exclusive):
        raise ThinvmError(
            f"VM {name!r} is being started, stopped or migrated by another command "
            f"(waited {timeout:.0f} s): retry when it is done"
        )
    try:
        yield
    finally:
        lock.release()


def attach(name: str, monitor: bool = True) -> VM:
    """Connect to the detached VM called `name` (a monitor and agent of our own)."""
    with name_lock(name):
        return VM.attach(rundir(name), monitor=monitor)


@contextlib.contextmanager
def attached(name: str, monitor: bool = True) -> Iterator[VM]:
    """A detached VM, attached for one command; it keeps running after."""
    vm = attach(name, monitor=monitor)
    try:
        yield vm
    finally:
        vm.disconnect()


def vm_class() -> type[VM]:
    """The class of the VMs `up` starts and a migration starts into: VM,
    or, in thinvm's source tree under the test suite's profile, the
    suite's (thinvm.testing: its guests boot through PVH, with its kernel
    arguments, from kept boots), so that the thinvm commands a test runs
    start the guests the test's own do.  This is the only place thinvm
    asks for thinvm.testing; the thinvm package leaves it out."""
    try:
        from thinvm.testing import keptboot
    except ModuleNotFoundError as exc:
        if exc.name != "thinvm.testing":
            raise
        return VM
    return keptboot.vm_class()


def up(config: VMConfig) -> VM:
    """Start a detached VM called config.name; returns it disconnected."""
    directory = rundir(config.name)
    with name_lock(config.name, exclusive=True):
        if (directory / "state.json").exists():
            raise ThinvmError(
                f"VM {config.name!r} exists already: 'thinvm down {config.name}' first"
            )
        shutil.rmtree(directory, ignore_errors=True)
        vm = vm_class()(config, rundir=directory, detached=True)
        try:
            vm.start()
            vm.save_state()
        except BaseException:
            vm.kill()
            shutil.rmtree(directory, ignore_errors=True)
            raise
        # The VM runs on without us: close our QMP and agent connections
        # now, not at interpreter exit.
        vm.disconnect()
    return vm


def down(name: str) -> list[str]:
    """Stop a detached VM and remove its run directory; returns notes for the user."""
    notes: list[str] = []
    directory = rundir(name)
    with name_lock(name, exclusive=True):
        try:
            vm = VM.attach(directory)
            try:
                vm.shutdown()
            finally:
                vm.disconnect()
        except UnreadableState as exc:
            notes.append(
                f"warning: its state file {exc.path} is unreadable ({exc.reason}): "
                "looking for its QEMU by the pid file and QMP sockets in its run directory"
            )
            notes.append(_kill_unreachable(directory))
        except ThinvmError as exc:
            notes.append(str(exc))
            # Its QEMU may still run without a monitor we can reach.
            if (pid := kill_unreachable(directory)) is not None:
                notes.append(f"killed QEMU pid {pid}")
        _discard(directory)
    return notes


def _kill_unreachable(directory: Path) -> str:
    """kill_unreachable(), said in a note."""
    if (pid := kill_unreachable(directory)) is not None:
        return f"killed QEMU pid {pid}"
    return "no QEMU of this VM is running (none found by pid file or QMP socket)"


def _discard(directory: Path) -> None:
    """Remove a VM's run directory, renamed out of the way first.

    Clients waiting for a lock file in it poll by path with O_CREAT; a
    plain rmtree would race with them (a file re-created behind it, and
    the directory left behind, in the way of the QEMU taking it over).
    After the rename their opens fail, or find the successor's files.
    """
    if not directory.exists():
        return
    gone = directory.with_name(f".{directory.name}.gone-{secrets.token_hex(4)}")
    directory.rename(gone)
    shutil.rmtree(gone, ignore_errors=True)


def set_operator_target(vm: VM, target: int | None) -> None:
    """Record (or, with None, drop) an operator's balloon target in the VM's state.

    The balance controller leaves a VM with one alone (docs/balance.md).
    """
    name = vm.config.name
    with name_lock(name, exclusive=True):
        state = read_state_file(rundir(name))
        if state.get("pid") != vm.pid:
            raise ThinvmError(f"VM {name!r} was migrated or restarted meanwhile: retry")
        vm.operator_target = target
        vm.save_state()


def read_state(name: str) -> dict[str, Any]:
    """NAME's state.json: its QEMU's pid, config and operator target."""
    return read_state_file(rundir(name))


@contextlib.contextmanager
def _agent_quiet(vm: VM, warn: Callable[[str], None]) -> Iterator[None]:
    """Take the source's agent turn for a migration, so that guest commands
    do not straddle the switchover, where their answer would be lost.

    A command already running gets AGENT_QUIET_TIMEOUT to finish; commands
    that come meanwhile wait and then run on the destination (their lock
    file is replaced with the run directory, see FileLock).  A longer one
    does not hold the migration up: it goes on, and that command's answer
    is lost.
    """
    lock = FileLock(vm.rundir / "agent.lock")
    if not lock.acquire(AGENT_QUIET_TIMEOUT):
        warn(
            f"{vm.config.name}: a guest command (thinvm exec) is still running after "
            f"{AGENT_QUIET_TIMEOUT:.0f} s: migrating anyway; that command's answer will be lost"
        )
        yield
        return
    try:
        yield
    finally:
        lock.release()


def migrate_to_uri(
    src: VM,
    uri: str,
    caps: dict[str, bool],
    progress: migrate.Progress | None,
    postcopy_after: float | None,
    warn: Callable[[str], None] = lambda _note: None,
) -> migrate.MigrationResult:
    """Migrate a detached VM to a destination someone else started; it leaves this host."""
    with _agent_quiet(src, warn):
        result = migrate.migrate_to_uri(
            src, uri, caps=caps, progress=progress, postcopy_after=postcopy_after
        )
        with name_lock(src.config.name, exclusive=True):
            src.shutdown()
            _discard(src.rundir)
    return result


def migrate_locally(
    src: VM,
    caps: dict[str, bool],
    progress: migrate.Progress | None,
    postcopy_after: float | None,
    warn: Callable[[str], None] = lambda _note: None,
) -> migrate.MigrationResult:
    """Migrate a detached VM into a new local QEMU that then takes over its name."""
    with _agent_quiet(src, warn):
        return _migrate_locally(src, caps, progress, postcopy_after)


def _migrate_locally(
    src: VM,
    caps: dict[str, bool],
    progress: migrate.Progress | None,
    postcopy_after: float | None,
) -> migrate.MigrationResult:
    name = src.config.name
    # A fresh directory each time: a QEMU removes its sockets and pid file
    # by the paths it was started with when it quits, and the source of
    # the next migration is the QEMU started here.  A reused staging name
    # would let it remove its successor's sockets.
    run_dir().mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.incoming-", dir=run_dir()))
    dst = vm_class()(src.config, rundir=staging, incoming=True, detached=True)
    try:
        dst.start()
        result = migrate.migrate(
            src, dst, caps=caps, progress=progress, postcopy_after=postcopy_after
        )
    except BaseException:
        dst.kill()
        shutil.rmtree(staging, ignore_errors=True)
        raise
    # The switchover: the source must be gone before its successor takes
    # the run directory's paths (see above).  Clients of the name wait.
    with name_lock(name, exclusive=True):
        src.shutdown()
        _discard(src.rundir)
        # The sockets keep working after the rename: they are bound to inodes.
        staging.rename(src.rundir)
        dst.rundir = src.rundir
        dst.operator_target = src.operator_target
        dst.save_state()
    dst.disconnect()
    return result
