"""Leases: the VM side of the pool (acquire a slot, bind it to QEMU, release it)."""

import os
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path

from thinvm.errors import ThinvmError
from thinvm.host.procs import proc_start_time
from thinvm.pool.daemon import kick
from thinvm.pool.model import Owner, PoolEmpty, bind, reap, release, take
from thinvm.pool.owned import check_slot
from thinvm.pool.probes import owner_alive, owner_of
from thinvm.pool.store import Pool
from thinvm.units import format_size


@dataclass
class Lease:
    """A slot a VM maps; release() when its QEMU is gone."""

    root: Path
    index: int
    path: str
    size: int
    kind: str
    page_size: int
    token: str

    def bind(self, pid: int) -> None:
        """From now on the slot belongs to QEMU process `pid`."""
        start = proc_start_time(pid)
        if start is None:
            return  # QEMU died at once; the lease stays ours until VM.kill()
        with Pool(self.root).locked() as state:
            bind(state, self.index, self.token, Owner(pid, start))

    def release(self) -> None:
        release_vm(self.root, self, None)

    def describe(self) -> str:
        return f"warm pool slot {self.index} ({self.kind}, {format_size(self.size)})"


def acquire(root: str | Path | None, memory: int, vm: str) -> Lease:
    """Lease the best free slot for `memory`; PoolEmpty if there is none."""
    pool = Pool(root)
    if not pool.exists():
        raise PoolEmpty(f"no warm pool at {pool.root} (start one with 'thinvm pool start')")
    token = secrets.token_hex(8)
    with pool.locked() as state:
        reap(state, owner_alive)
        slot = take(state, memory, owner_of(os.getpid()), vm, token)
        # QEMU maps the slot by its name: it must still be the pool's own
        # file.  Refused, the slot stays free (the state is not written).
        check_slot(slot.path)
        cfg = state.config
    return Lease(pool.root, slot.index, slot.path, slot.size, cfg.kind, cfg.page_size, token)


def release_vm(root: str | Path | None, lease: Lease | None, pid: int | None) -> None:
    """A VM is gone (its QEMU reaped): mark its slot dirty and get it scrubbed.

    Called from VM.kill(), so it never raises; a lease it cannot return is
    found by the pool's reaper once its owner is dead.
    """
    pool = Pool(lease.root if lease is not None else root)
    try:
        if not pool.exists():
            return
        with pool.locked() as state:
            slot = release(state, token=lease.token if lease is not None else None, pid=pid)
            daemon = state.daemon
        if slot is not None:
            kick(pool.root, daemon)
    except (OSError, ThinvmError) as exc:
        print(f"thinvm: warning: could not return a warm pool slot: {exc}", file=sys.stderr)
