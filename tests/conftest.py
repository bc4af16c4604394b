"""Fixtures for tests that boot real guests under QEMU."""

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest

from thinvm.fleet.cluster import Host, virsh
from thinvm.vm.machine import VM, VMConfig


def qemu_pids(name: str | None = None) -> set[int]:
    """QEMU processes this test process started, or any thinvm VM called `name`.

    Owned VMs are our children; detached ones (`thinvm up`) are found by
    name.  Other thinvm users on the machine are not counted.
    """
    if name is None:
        cmd = ["pgrep", "-P", str(os.getpid()), "-f", "qemu-system-x86_64"]
    else:
        cmd = ["pgrep", "-f", f"qemu-system-x86_64 -name thinvm-{name} "]
    out = subprocess.run(cmd, capture_output=True, text=True).stdout
    return {int(pid) for pid in out.split()}


# What a thinvm command must never print: a traceback, or asyncio's
# complaints about a QMP connection that outlived its event loop.
CLI_NOISE = ("Traceback", "Exception ignored", "Task was destroyed", "no running event loop")


def assert_clean_stderr(stderr: str, what: str) -> None:
    for word in CLI_NOISE:
        assert word not in stderr, f"{what} printed {word!r}:\n{stderr}"


def thinvm_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    """Run `thinvm ARGS` as a user would; its stderr must be free of tracebacks."""
    proc = subprocess.run(
        [sys.executable, "-m", "thinvm.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    assert_clean_stderr(proc.stderr, f"thinvm {' '.join(args)}")
    return proc


def thinvm_ok(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """thinvm_cli(); with check, a failure is an assertion error with its stderr."""
    proc = thinvm_cli(*args)
    if check and proc.returncode != 0:
        raise AssertionError(f"thinvm {' '.join(args)} failed: {proc.stderr}")
    return proc


@pytest.fixture(autouse=True)
def no_orphan_qemu() -> Iterator[None]:
    """Every test must leave no QEMU process of its own behind."""
    before = qemu_pids()
    yield
    left = qemu_pids() - before
    for pid in left:
        subprocess.run(["kill", "-9", str(pid)], check=False)
    assert not left, f"test left QEMU processes behind: {sorted(left)}"


VMFactory = Callable[..., VM]


@pytest.fixture
def make_vm() -> Iterator[VMFactory]:
    """Start VMs that are shut down at the end of the test, pass or fail."""
    vms: list[VM] = []

    def factory(config: VMConfig | None = None, *, incoming: bool = False) -> VM:
        vm = VM(config or VMConfig(name="test"), incoming=incoming)
        vms.append(vm)
        return vm.start()

    yield factory
    for vm in vms:
        vm.shutdown()


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def memstat(h: Host, name: str) -> dict[str, int]:
    """`virsh dommemstat` of a cluster guest (KiB; "actual" is the balloon's target)."""
    out = virsh(h, "dommemstat", name)
    return {k: int(v) for k, v in (line.split() for line in out.splitlines() if line.strip())}
