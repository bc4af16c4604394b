"""A warm pool of pre-zeroed, pre-populated guest RAM (docs/warm-pool.md).

Starting a VM with all of its RAM preallocated makes the kernel zero every
page while QEMU waits.  The pool pays for that ahead of time, at idle CPU
priority and in its own cgroup, in files that QEMU then maps with
`memory-backend-file,share=on,prealloc=on`:

- hugetlbfs slots: fallocate() allocates and zeroes every huge page, so
  QEMU's preallocation only maps them (2048 faults for 4 GiB);
- tmpfs slots: fallocate() plus a write fault on every page
  (MADV_POPULATE_WRITE), so the pages exist and are zero; QEMU still maps
  them 4 KiB at a time.

A slot moves through these states, recorded in `pool.json` and changed
only under the pool's file lock:

             fill             lease              VM gone
     empty --------> free ---------> leased ------------> dirty
       ^ ^             |                                    |
       | +-------------+ shrink: punch (pressure, budget)   |
       +----------------------------------------------------+
                   scrub: punch the whole file

A slot file can hold a guest's data only while it is leased or dirty.  The
only way back to free is a punch of the whole file that leaves no block
allocated (checked), with no process holding the file open or mapped
(checked), followed by a fill that only ever writes zeros.  A slot is
leased only when free.

Modules, by responsibility:

- model: slots, policy and state; the pure decisions (leasing, grow/shrink);
- files: allocating, zero-filling and punching slot files;
- owned: the slot directory and slot files, touched only if they are the pool's alone;
- probes: what the pool measures on the host (thinvm.host: PSI, meminfo, processes);
- store: pool.json under the pool's lock; configure() sets a pool up;
- lease: the VM side (acquire, bind, release);
- worker: fills, scrubs and shrinks (serve runs it as daemon or one-shot);
- daemon: spawning, waking, waiting on and stopping the worker and the pool;
- report: `thinvm pool status`;
- start: private pools for tests and benchmarks (a VM on a slot: thinvm.vm.pooled);
- __main__: `python -m thinvm.pool serve ROOT [--once]`, how the worker is spawned.
"""

from thinvm.pool.daemon import (
    StopReport,
    kick,
    spawn_daemon,
    stop,
    wait_free,
    wait_until,
)
from thinvm.pool.files import (
    PAGE_SIZE,
    allocated,
    fallocate,
    fill_chunk,
    is_zero,
    populate_zeros,
    punch,
)
from thinvm.pool.lease import (
    Lease,
    acquire,
    release_vm,
)
from thinvm.pool.model import (
    DEFAULT_COOLDOWN,
    DEFAULT_INTERVAL,
    DEFAULT_PSI_THRESHOLD,
    DEFAULT_WATERMARK,
    KINDS,
    MIN_INTERVAL,
    PSI_PATH,
    Action,
    Owner,
    Policy,
    PoolConfig,
    PoolEmpty,
    PoolError,
    PoolState,
    Pressure,
    Slot,
    bind,
    check_interval,
    choose_slot,
    decide,
    growth_block,
    pressure_reason,
    reap,
    release,
    shortage,
    take,
)
from thinvm.pool.owned import (
    UnsafePath,
    check_slot,
    claim_directory,
    directory_problem,
    open_slot,
    remove_slot,
    slot_problem,
)
from thinvm.pool.probes import (
    owner_alive,
    owner_of,
    read_pressure,
)
from thinvm.pool.report import (
    PoolStatus,
    SlotStatus,
    format_status,
    status,
)
from thinvm.pool.start import temporary_pool
from thinvm.pool.store import (
    LOCK_FILE,
    LOG_FILE,
    STATE_FILE,
    TMPFS_DIR,
    Pool,
    PoolSpec,
    configure,
    default_root,
)
from thinvm.pool.worker import (
    CGROUP_HEADROOM,
    HUGETLBFS_CHUNK,
    TMPFS_CHUNK,
    PoolLog,
    Worker,
    cgroup_limit,
    idle_priority,
    serve,
)

__all__ = [
    "CGROUP_HEADROOM",
    "DEFAULT_COOLDOWN",
    "DEFAULT_INTERVAL",
    "DEFAULT_PSI_THRESHOLD",
    "DEFAULT_WATERMARK",
    "HUGETLBFS_CHUNK",
    "KINDS",
    "LOCK_FILE",
    "LOG_FILE",
    "MIN_INTERVAL",
    "PAGE_SIZE",
    "PSI_PATH",
    "STATE_FILE",
    "TMPFS_CHUNK",
    "TMPFS_DIR",
    "Action",
    "Lease",
    "Owner",
    "Policy",
    "Pool",
    "PoolConfig",
    "PoolEmpty",
    "PoolError",
    "PoolLog",
    "PoolSpec",
    "PoolState",
    "PoolStatus",
    "Pressure",
    "Slot",
    "SlotStatus",
    "StopReport",
    "UnsafePath",
    "Worker",
    "acquire",
    "allocated",
    "bind",
    "cgroup_limit",
    "check_interval",
    "check_slot",
    "choose_slot",
    "claim_directory",
    "configure",
    "decide",
    "default_root",
    "directory_problem",
    "fallocate",
    "fill_chunk",
    "format_status",
    "growth_block",
    "idle_priority",
    "is_zero",
    "kick",
    "open_slot",
    "owner_alive",
    "owner_of",
    "populate_zeros",
    "pressure_reason",
    "punch",
    "read_pressure",
    "reap",
    "release",
    "release_vm",
    "remove_slot",
    "serve",
    "shortage",
    "slot_problem",
    "spawn_daemon",
    "status",
    "stop",
    "take",
    "temporary_pool",
    "wait_free",
    "wait_until",
]
