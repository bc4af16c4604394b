"""Private pools for tests and benchmarks.

Starting a VM from a slot is thinvm.vm.pooled: the pool knows nothing of VMs
but their leases, so thinvm.vm may import it and not the other way round.
"""

import contextlib
import os
from collections.abc import Iterator

from thinvm.paths import cache_dir
from thinvm.pool.daemon import spawn_daemon, stop, wait_free
from thinvm.pool.store import Pool, PoolSpec, configure


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
