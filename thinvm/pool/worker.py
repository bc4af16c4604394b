"""The worker: fills, scrubs and shrinks slots, one action per step (serve runs it)."""

import contextlib
import errno
import os
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TextIO

from thinvm.host import HostError
from thinvm.host.cgroups import cgroup_usage, join_cgroup, set_cgroup_limit
from thinvm.host.hugepages import hugepages_free, nr_hugepages, set_nr_hugepages
from thinvm.host.procs import users_of
from thinvm.pool.files import allocated, fill_chunk, punch
from thinvm.pool.model import (
    Action,
    Policy,
    PoolConfig,
    PoolError,
    PoolState,
    Slot,
    decide,
    growth_block,
    reap,
)
from thinvm.pool.owned import open_slot
from thinvm.pool.probes import owner_alive, owner_of, read_pressure
from thinvm.pool.store import Pool
from thinvm.progress import ProgressLine
from thinvm.units import MiB, format_size

# The pool's own processes (Python, page tables) on top of the slots.
CGROUP_HEADROOM = 256 * MiB
# Work units: between two, the filler re-checks budget, pressure and stop.
TMPFS_CHUNK = 64 * MiB
HUGETLBFS_CHUNK = 256 * MiB


# -- the worker's cgroup and CPU priority -------------------------------------


def cgroup_limit(kind: str, policy: Policy) -> int:
    """The pool's cgroup limit: tmpfs pages are charged there, huge pages are not."""
    return (policy.budget if kind == "tmpfs" else 0) + CGROUP_HEADROOM


def idle_priority() -> None:
    """SCHED_IDLE and nice 19: the pool only runs on otherwise idle CPUs."""
    with contextlib.suppress(OSError):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    with contextlib.suppress(OSError):
        os.nice(19 - os.nice(0))


# -- the worker (daemon or one-shot) -----------------------------------------


def _chunk(kind: str) -> int:
    return HUGETLBFS_CHUNK if kind == "hugetlbfs" else TMPFS_CHUNK


class PoolLog:
    """The worker's output: running figures on a progress line, events on lines of their own."""

    def __init__(self, prefix: str = "pool: ", stream: TextIO | None = None) -> None:
        self.prefix = prefix
        self.stream = stream
        self._line = ProgressLine(prefix, stream=stream)
        self._open = False

    def progress(self, text: str) -> None:
        self._line.update(text)
        self._open = True

    def event(self, text: str) -> None:
        self._line.done(text)
        self._line = ProgressLine(self.prefix, stream=self.stream)
        self._open = False

    def close(self) -> None:
        if self._open:
            self._line.done()
            self._open = False


class Worker:
    """Fills, scrubs and shrinks slots; one action per step."""

    def __init__(
        self,
        pool: Pool,
        stop: threading.Event,
        out: PoolLog | None = None,
    ) -> None:
        self.pool = pool
        self.stop = stop
        self.out = out
        self.me = owner_of(os.getpid())
        self.fill_after = 0.0  # monotonic time; set by a shrink

    def step(self) -> Action:
        current = self.pool.read().config
        self._sync_cgroup_limit(current, current.policy)
        with self.pool.locked() as state:
            reap(state, owner_alive)
            cfg = state.config
            held = {s.index: allocated(s.path) for s in state.slots}
            action = decide(
                state.slots,
                held,
                read_pressure(cfg.policy),
                cfg.policy,
                spare=self._spare(cfg, state.slots),
                cooling=time.monotonic() < self.fill_after,
            )
            state.note = f"{action.kind}: {action.reason}" if action.reason else action.kind
            if action.index is None:
                return action
            slot = state.slots[action.index]
            slot.state = "filling" if action.kind == "fill" else "scrubbing"
            slot.owner, slot.error = self.me, ""
            slot = replace(slot)
        try:
            if action.kind == "fill":
                done, why = self._fill(slot, cfg)
            else:
                error = self._scrub(slot)
        except BaseException:
            self._finish(slot, "dirty", "interrupted")  # content unknown: scrub again
            raise
        if action.kind == "fill":
            self._finish(slot, "free" if done else "empty", "" if done else why)
            return action if done else Action("idle", slot.index, why)
        try:
            # Before the slot shows as empty: whoever reads the pool's status
            # then must find its huge pages back with the kernel, not still
            # reserved in vm.nr_hugepages.  The slot is ours ("scrubbing")
            # until _finish, and only leased slots hold pages back (_owed).
            if action.kind == "shrink" and not error and cfg.manage_hugepages:
                self._try_give_back_hugepages(cfg, slot.index)
        finally:
            self._finish(slot, "dirty" if error else "empty", error)
        if error:
            return Action("idle", slot.index, error)
        if action.kind == "shrink":
            self.fill_after = time.monotonic() + cfg.policy.cooldown
            self.log(f"slot {slot.index}: given back ({action.reason})")
        return action

    def progress(self, text: str) -> None:
        if self.out is not None:
            self.out.progress(text)

    def log(self, text: str) -> None:
        if self.out is not None:
            self.out.event(text)

    def _finish(self, slot: Slot, new_state: str, error: str) -> None:
        with self.pool.locked() as state:
            current = state.slots[slot.index]
            if current.owner == self.me and current.state in ("filling", "scrubbing"):
                current.state, current.owner, current.error = new_state, None, error

    def _held(self) -> int:
        return sum(allocated(s.path) for s in self.pool.read().slots)

    def _fill(self, slot: Slot, cfg: PoolConfig) -> tuple[bool, str]:
        chunk = _chunk(cfg.kind)
        label = f"slot {slot.index} ({cfg.kind}, {format_size(slot.size)})"
        started = time.monotonic()
        try:
            fd = open_slot(slot.path)
        except OSError as exc:
            return False, f"{label}: {exc.strerror}"
        except PoolError as exc:
            return False, str(exc)
        try:
            if os.fstat(fd).st_size != slot.size:
                os.ftruncate(fd, slot.size)
            for offset in range(0, slot.size, chunk):
                if self.stop.is_set():
                    return False, "stopped"
                length = min(chunk, slot.size - offset)
                # Filling is in order, so what the file holds is a prefix.
                have = os.fstat(fd).st_blocks * 512
                new = max(0, min(length, offset + length - have))
                if new:
                    policy = self.pool.read().config.policy  # may change at run time
                    self._sync_cgroup_limit(cfg, policy)
                    remaining = slot.size - have
                    block = growth_block(
                        read_pressure(policy), policy, self._held(), remaining, self._spare(cfg)
                    )
                    if block is not None:
                        return False, f"not filling: {block}"
                    if cfg.manage_hugepages:
                        self._reserve_hugepages(cfg, new)
                    elif cfg.kind == "hugetlbfs" and self._spare(cfg) < new:
                        return False, (
                            f"{label}: not enough free huge pages (the rest are in use or "
                            "owed to leased slots): raise vm.nr_hugepages or pass "
                            "--reserve-hugepages"
                        )
                fill_chunk(fd, cfg.kind, offset, length)
                done = offset + length
                rate = done / MiB / max(time.monotonic() - started, 1e-3)
                self.progress(
                    f"{label}: filled {format_size(done)} of {format_size(slot.size)} "
                    f"({rate:.0f} MiB/s)"
                )
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                hint = (
                    "not enough huge pages: raise vm.nr_hugepages or pass --reserve-hugepages"
                    if cfg.kind == "hugetlbfs"
                    else f"{cfg.directory} is full"
                )
                return False, f"{label}: {hint}"
            return False, f"{label}: {exc.strerror}"
        except (PoolError, HostError) as exc:
            return False, str(exc)
        finally:
            os.close(fd)
        seconds = time.monotonic() - started
        self.log(f"{label}: free, filled in {seconds:.2f} s")
        return True, ""

    def _scrub(self, slot: Slot) -> str:
        """Punch the whole file; '' if nothing of it is left, else why not."""
        users = users_of(slot.path, exclude=os.getpid())
        if users:
            return f"still open in process {', '.join(map(str, users))}: not scrubbed"
        try:
            fd = open_slot(slot.path, create=True)
        except OSError as exc:
            return f"opening slot {slot.index}: {exc.strerror}"
        except PoolError as exc:
            return str(exc)
        try:
            size = os.fstat(fd).st_size
            if size:
                punch(fd, 0, size)
            if size != slot.size:
                os.ftruncate(fd, slot.size)
            left = os.fstat(fd).st_blocks * 512
        except OSError as exc:
            return f"punching slot {slot.index}: {exc.strerror}"
        finally:
            os.close(fd)
        if left:
            return f"slot {slot.index} still holds {format_size(left)} after punching"
        self.log(f"slot {slot.index}: punched, nothing left allocated")
        return ""

    def _owed(self, cfg: PoolConfig, slots: Sequence[Slot]) -> int:
        """Huge pages punched out of leased slots (balloon, reporting).

        A guest may touch those again (deflate) and its QEMU then faults a
        free huge page into the file; were none left, QEMU would die of
        SIGBUS.  So the pool never fills with, nor gives back, that many.
        """
        if cfg.kind != "hugetlbfs":
            return 0
        leased = [s for s in slots if s.state == "leased"]
        return sum(-(-max(0, s.size - allocated(s.path)) // cfg.page_size) for s in leased)

    def _spare(self, cfg: PoolConfig, slots: Sequence[Slot] | None = None) -> int:
        """Bytes of free huge pages the pool may fill (no cost to the host).

        Pass `slots` when holding the pool's lock (it is not reentrant).
        """
        if cfg.kind != "hugetlbfs":
            return 0
        if slots is None:
            slots = self.pool.read().slots
        owed = self._owed(cfg, slots)
        return max(0, hugepages_free(cfg.page_size) - owed) * cfg.page_size

    def _sync_cgroup_limit(self, cfg: PoolConfig, policy: Policy) -> None:
        """Keep the cgroup limit at budget + headroom as the budget changes.

        The limit is lowered only once the slots fit under it: the shrink
        punches slots first.  Lowered earlier, it would make the kernel
        reclaim the slots' tmpfs pages, which on a host with swap means
        writing pre-zeroed memory out to swap only to punch it afterwards
        (without swap the write just fails).
        """
        if cfg.cgroup is None:
            return
        limit = cgroup_limit(cfg.kind, policy)
        held = cgroup_usage(cfg.cgroup)
        if held is not None and held.usage is not None and held.usage > limit:
            return
        with contextlib.suppress(HostError):
            set_cgroup_limit(cfg.cgroup, limit)

    def _reserve_hugepages(self, cfg: PoolConfig, cost: int) -> None:
        page_size = cfg.page_size
        need = -(-cost // page_size) - self._spare(cfg) // page_size
        if need <= 0:
            return
        before = nr_hugepages(page_size)
        after = set_nr_hugepages(page_size, before + need)
        with self.pool.locked() as state:
            state.hugepages_added += max(0, after - before)
        if after < before + need:
            raise PoolError(
                f"the kernel gave only {after - before} of {need} more "
                f"{format_size(page_size)} pages (memory too fragmented or too little free)"
            )

    def _try_give_back_hugepages(self, cfg: PoolConfig, index: int) -> None:
        """A failed vm.nr_hugepages write does not stop the pool: the pages
        stay counted in hugepages_added, so the next shrink, or the
        daemon's exit, gives them back."""
        try:
            self._give_back_hugepages(cfg)
        except HostError as exc:
            self.log(f"slot {index}: huge pages not given back yet: {exc}")

    def _give_back_hugepages(self, cfg: PoolConfig) -> None:
        """Shrink the kernel's huge page pool by what a shrink freed."""
        spare = self._spare(cfg) // cfg.page_size
        with self.pool.locked() as state:
            count = min(state.hugepages_added, spare)
            if count <= 0:
                return
            before = nr_hugepages(cfg.page_size)
            after = set_nr_hugepages(cfg.page_size, before - count)
            state.hugepages_added -= max(0, before - after)


def serve(
    root: str | Path | None,
    *,
    once: bool = False,
    out: PoolLog | None = None,
) -> PoolState:
    """Run the pool's worker in this process until stopped (or, once, until idle).

    The process drops to idle CPU priority and joins the pool's cgroup, so
    all of the zeroing is charged there.  SIGTERM/SIGINT stop it after the
    current chunk; SIGUSR1 wakes it (a slot was released).
    """
    pool = Pool(root)
    state = pool.read()
    cfg = state.config
    idle_priority()
    if cfg.cgroup is not None:
        with contextlib.suppress(HostError):  # over the limit: shrinking comes first
            join_cgroup(cfg.cgroup, cgroup_limit(cfg.kind, cfg.policy))
    stop, wake = threading.Event(), threading.Event()

    def on_stop(_signum: int, _frame: object) -> None:
        stop.set()
        wake.set()

    def on_wake(_signum: int, _frame: object) -> None:
        wake.set()

    handlers = {signal.SIGTERM: on_stop, signal.SIGINT: on_stop, signal.SIGUSR1: on_wake}
    previous = {sig: signal.signal(sig, h) for sig, h in handlers.items()}
    worker = Worker(pool, stop, out)
    try:
        if not once:
            with pool.locked() as state:
                reap(state, owner_alive)
                if state.daemon is not None and state.daemon != worker.me:
                    raise PoolError(f"a pool daemon runs already (pid {state.daemon.pid})")
                state.daemon = worker.me
        last_note = ""
        while not stop.is_set():
            action = worker.step()
            if action.kind == "shrink" and not once:
                # Let the host's pressure figures catch up before the next one.
                wake.wait(pool.read().config.policy.interval)
                wake.clear()
            if action.kind != "idle":
                continue
            if action.reason != last_note:
                worker.log(action.reason)
                last_note = action.reason
            if once:
                break
            wake.wait(pool.read().config.policy.interval)
            wake.clear()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        with contextlib.suppress(PoolError, OSError), pool.locked() as state:
            if state.daemon == worker.me:
                state.daemon = None
    return pool.read()
