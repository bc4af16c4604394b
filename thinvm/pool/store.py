"""The pool on disk: pool.json under a file lock, and setting a pool up (configure)."""

import contextlib
import fcntl
import json
import os
import subprocess
import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from thinvm.host.hugepages import hugepages_free
from thinvm.host.memory import host_meminfo
from thinvm.host.mounts import Mount, mount_of, mounts
from thinvm.paths import cache_dir, write_json_atomic
from thinvm.pool.files import PAGE_SIZE
from thinvm.pool.model import (
    KINDS,
    Policy,
    PoolConfig,
    PoolError,
    PoolState,
    Slot,
    check_interval,
)
from thinvm.pool.owned import claim_directory, open_slot
from thinvm.units import format_size

STATE_FILE = "pool.json"
LOCK_FILE = "lock"
LOG_FILE = "daemon.log"
TMPFS_DIR = "/dev/shm"


def default_root() -> Path:
    return cache_dir() / "pool"


@dataclass
class PoolSpec:
    """How to set a pool up; None fields keep the current (or default) value."""

    slots: list[int] | None = None  # one size per slot, bytes
    kind: str = "auto"  # auto | hugetlbfs | tmpfs
    directory: str | None = None  # where slot files go (on hugetlbfs or tmpfs)
    budget: int | None = None  # default: the sum of the slots
    watermark: int | None = None
    psi_threshold: float | None = None
    psi_path: str | None = None
    interval: float | None = None
    cooldown: float | None = None
    reserve_hugepages: bool = False  # root: mount hugetlbfs, grow vm.nr_hugepages
    cgroup: bool = True


_locked_here: set[tuple[str, int]] = set()  # (pool, thread) holding the lock


class Pool:
    """A pool directory: pool.json, its lock and the daemon log."""

    def __init__(self, root: str | Path | None = None) -> None:
        self.root = Path(root) if root is not None else default_root()

    @property
    def state_file(self) -> Path:
        return self.root / STATE_FILE

    @property
    def log_file(self) -> Path:
        return self.root / LOG_FILE

    @property
    def cgroup_name(self) -> str:
        return f"thinvm-{self.root.name}"

    def exists(self) -> bool:
        return self.state_file.is_file()

    @contextlib.contextmanager
    def _flock(self) -> Iterator[None]:
        # flock() locks an open file: taking it again in the same thread
        # would wait for itself forever, so that is a bug, said loudly.
        key = (str(self.root.resolve()), threading.get_ident())
        if key in _locked_here:
            raise RuntimeError(f"pool lock {self.root} taken twice in one process")
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / LOCK_FILE, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            _locked_here.add(key)
            try:
                yield
            finally:
                _locked_here.discard(key)

    def _load(self) -> PoolState:
        try:
            return PoolState.from_json(json.loads(self.state_file.read_text()))
        except FileNotFoundError:
            raise PoolError(
                f"no warm pool at {self.root}: start one with 'thinvm pool start'"
            ) from None

    def _store(self, state: PoolState) -> None:
        write_json_atomic(self.state_file, state.to_json())

    @contextlib.contextmanager
    def locked(self) -> Iterator[PoolState]:
        """The state, read and written back under the pool's lock."""
        with self._flock():
            state = self._load()
            before = state.to_json()
            yield state
            if state.to_json() != before:
                self._store(state)

    def read(self) -> PoolState:
        with self._flock():
            return self._load()

    def slot_path(self, directory: str, index: int) -> str:
        return os.path.join(directory, f"slot-{index}.mem")


def _pick_backing(pool: Pool, spec: PoolSpec, total: int) -> tuple[str, str, int, str | None]:
    """(kind, directory, page size, our own mount) for a new pool."""
    subdir = f"thinvm-{pool.root.name}"
    if spec.directory is not None:
        m = mount_of(spec.directory)
        if m is None or m.fstype not in KINDS:
            raise PoolError(f"{spec.directory} is on neither hugetlbfs nor tmpfs")
        if spec.kind != "auto" and spec.kind != m.fstype:
            raise PoolError(f"{spec.directory} is on {m.fstype}, not {spec.kind}")
        return m.fstype, spec.directory, _page_size(m, spec.directory), None
    if spec.kind not in ("auto", *KINDS):
        raise PoolError(f"unknown pool kind {spec.kind!r}: use auto, hugetlbfs or tmpfs")
    if spec.kind in ("auto", "hugetlbfs"):
        huge = [m for m in mounts() if m.fstype == "hugetlbfs"]
        usable = [m for m in huge if os.access(m.point, os.W_OK)]
        if usable:
            m = usable[0]
            size = _page_size(m, m.point)
            if (
                spec.kind == "hugetlbfs"
                or spec.reserve_hugepages
                or (hugepages_free(size) * size >= total)
            ):
                return "hugetlbfs", os.path.join(m.point, subdir), size, None
        elif spec.reserve_hugepages:
            point = pool.root / "hugetlbfs"
            point.mkdir(parents=True, exist_ok=True)
            proc = subprocess.run(
                ["mount", "-t", "hugetlbfs", "-o", "mode=0700", "none", str(point)],
                capture_output=True,
                text=True,
            )
            if proc.returncode != 0:
                raise PoolError(f"cannot mount hugetlbfs on {point}: {proc.stderr.strip()}")
            size = os.statvfs(point).f_bsize
            return "hugetlbfs", str(point / subdir), size, str(point)
        elif spec.kind == "hugetlbfs":
            raise PoolError(
                "no hugetlbfs is mounted: mount one (mount -t hugetlbfs none /dev/hugepages) "
                "or pass --reserve-hugepages"
            )
    return "tmpfs", os.path.join(TMPFS_DIR, subdir), PAGE_SIZE, None


def _page_size(m: Mount, path: str) -> int:
    return os.statvfs(path).f_bsize if m.fstype == "hugetlbfs" else PAGE_SIZE


def configure(root: str | Path | None, spec: PoolSpec) -> PoolState:
    """Create the pool, or update the policy of an existing one."""
    if spec.interval is not None:
        check_interval(spec.interval)
    pool = Pool(root)
    with pool._flock():
        if pool.exists():
            state = pool._load()
            sizes = [s.size for s in state.slots]
            if spec.slots is not None and sorted(spec.slots) != sorted(sizes):
                raise PoolError(
                    f"the pool at {pool.root} has slots {_describe_sizes(sizes)}: "
                    "'thinvm pool stop' first to change them"
                )
            if spec.kind not in ("auto", state.config.kind):
                raise PoolError(
                    f"the pool at {pool.root} is {state.config.kind}: "
                    "'thinvm pool stop' first to change it"
                )
            _apply_policy(state.config.policy, spec)
            pool._store(state)
            return state
        if not spec.slots:
            raise PoolError("a new pool needs slots: pass e.g. --slot 4G --count 2")
        check_fits_host(spec.slots, host_meminfo()["MemTotal"])
        kind, directory, page, mounted = _pick_backing(pool, spec, sum(spec.slots))
        bad = [s for s in spec.slots if s <= 0 or s % page]
        if bad:
            raise PoolError(
                f"slot size {format_size(bad[0])} is not a multiple of the "
                f"{kind} page size {format_size(page)}"
            )
        policy = Policy(budget=sum(spec.slots))
        _apply_policy(policy, spec)
        config = PoolConfig(
            kind=kind,
            directory=directory,
            page_size=page,
            policy=policy,
            cgroup=pool.cgroup_name if spec.cgroup else None,
            mounted=mounted,
            manage_hugepages=kind == "hugetlbfs" and spec.reserve_hugepages,
        )
        claim_directory(directory)
        slots = []
        for index, size in enumerate(spec.slots):
            path = pool.slot_path(directory, index)
            fd = open_slot(path, create=True)
            try:
                # A file left from an earlier pool may hold a guest's data.
                state_name = "dirty" if os.fstat(fd).st_blocks else "empty"
                if os.fstat(fd).st_size != size:
                    os.ftruncate(fd, size)
            finally:
                os.close(fd)
            slots.append(Slot(index=index, size=size, path=path, state=state_name))
        state = PoolState(config=config, slots=slots)
        pool._store(state)
        return state


def check_fits_host(slots: Sequence[int], memory: int) -> None:
    """Refuse slots that could never be filled on this host.

    A bare number is MiB (as QEMU's -m), so `--slot 67108864` asks for 64 TiB:
    the slot files would be created sparse and the pool would never fill them.
    """
    total = sum(slots)
    if total > memory:
        raise PoolError(
            f"slots of {format_size(total)} in all exceed this host's memory "
            f"({format_size(memory)}); sizes without a unit are MiB: write e.g. 4G"
        )


def _apply_policy(policy: Policy, spec: PoolSpec) -> None:
    for name in ("budget", "watermark", "psi_threshold", "psi_path", "interval", "cooldown"):
        value = getattr(spec, name)
        if value is not None:
            setattr(policy, name, value)


def _describe_sizes(sizes: Sequence[int]) -> str:
    counts = Counter(sizes)
    return ", ".join(f"{n} x {format_size(size)}" for size, n in sorted(counts.items()))
