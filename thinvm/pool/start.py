"""Starting VMs from the pool, and private pools for tests and benchmarks."""

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from thinvm.host.procs import process_age
from thinvm.paths import cache_dir
from thinvm.pool.daemon import spawn_daemon, stop, wait_free
from thinvm.pool.store import Pool, PoolSpec, configure

if TYPE_CHECKING:
    from thinvm.vm.machine import VM, VMConfig


@dataclass
class PoolStart:
    """A VM started from a warm slot, and how long it took."""

    vm: "VM"
    lease: str  # which slot, or why the VM fell back to ordinary preallocation
    pooled: bool
    qmp_s: float  # QEMU process start -> QMP answers (preallocation done)
    agent_s: float  # QEMU process start -> guest agent answers
    wait_slot_s: float  # waiting for a free slot (fill or scrub), before launch


def start_from_pool(
    config: "VMConfig", root: str | Path | None = None, *, wait_slot: float = 600.0
) -> PoolStart:
    """Start a VM on a warm slot, timed like the `start` benchmark.

    Waits (up to `wait_slot` s, not counted) until a fitting slot is free,
    then launches; times are measured from the QEMU process's start.  The
    caller owns the VM (use it as a context manager); its slot is scrubbed
    in the background once it is shut down.
    """
    from thinvm.vm.machine import VM

    pool = Pool(root)
    started = time.monotonic()
    wait_free(pool.root, config.memory, wait_slot)
    waited = time.monotonic() - started
    vm = VM(replace(config, pool=str(pool.root)))
    vm.start(wait_agent=False)
    try:
        assert vm.pid is not None
        qmp_s = process_age(vm.pid)
        vm.wait_agent()
        agent_s = process_age(vm.pid)
    except BaseException:
        vm.kill()
        raise
    lease = vm.pool_lease.describe() if vm.pool_lease is not None else vm.pool_note
    return PoolStart(vm, lease, vm.pool_lease is not None, qmp_s, agent_s, waited)


@contextlib.contextmanager
def temporary_pool(
    kind: str,
    slot_size: int,
    count: int = 1,
    *,
    tag: str | None = None,
    budget: int | None = None,
    watermark: int = 0,
    daemon: bool = True,
    fill_timeout: float = 600.0,
) -> Iterator[Pool]:
    """A private pool for tests and benchmarks, gone afterwards.

    hugetlbfs pools mount their own hugetlbfs and grow vm.nr_hugepages as
    they fill; stopping shrinks it back, unmounts and removes the cgroup.
    With `daemon`, a background daemon fills it (waited for) and scrubs.
    """
    name = f"pool-{tag or os.getpid()}"
    root = cache_dir() / "pools" / name
    spec = PoolSpec(
        slots=[slot_size] * count,
        kind=kind,
        budget=budget,
        watermark=watermark,
        reserve_hugepages=kind == "hugetlbfs",
    )
    if Pool(root).exists():
        stop(root, force=True)
    configure(root, spec)
    try:
        if daemon:
            spawn_daemon(root)
            if budget is None:
                wait_free(root, timeout=fill_timeout)
        yield Pool(root)
    finally:
        stop(root, force=True)
