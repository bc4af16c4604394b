"""Starting a VM on a warm pool slot, timed like the `start` benchmark."""

import time
from dataclasses import dataclass, replace
from pathlib import Path

from thinvm.host.procs import process_age
from thinvm.pool.daemon import wait_free
from thinvm.pool.store import Pool
from thinvm.vm.machine import VM, VMConfig


@dataclass
class PoolStart:
    """A VM started from a warm slot, and how long it took."""

    vm: VM
    lease: str  # which slot, or why the VM fell back to ordinary preallocation
    pooled: bool
    qmp_s: float  # QEMU process start -> QMP answers (preallocation done)
    agent_s: float  # QEMU process start -> guest agent answers
    wait_slot_s: float  # waiting for a free slot (fill or scrub), before launch


def start_from_pool(
    config: VMConfig, root: str | Path | None = None, *, wait_slot: float = 600.0
) -> PoolStart:
    """Start a VM on a warm slot, timed like the `start` benchmark.

    Waits (up to `wait_slot` s, not counted) until a fitting slot is free,
    then launches; times are measured from the QEMU process's start.  The
    caller owns the VM (use it as a context manager); its slot is scrubbed
    in the background once it is shut down.
    """
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
