"""The guest reclaimers a VM backend reaches through each guest's agent.

Both backends, thinvm's own VMs and libvirt domains, talk to the same
agent over a virtio-serial port; only how they find its socket differs.
This keeps what they do with it in one place: read the reclaimer's
counters (at most every refresh period), switch its background mode,
and run bounded trims in the background, remembering the cache floor a
trim could not go below.
"""

import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from thinvm.balance.model import BadGuestData, Reclaimer, guest_count
from thinvm.errors import AgentBusy, GuestError, ThinvmError
from thinvm.guest import trim
from thinvm.guest.agent import AgentClient
from thinvm.units import format_size

# How often the guest reclaimer's counters are read again: they serve the
# status line and the trim-first rule, neither of which needs them fresher.
RECLAIMER_REFRESH_SECONDS = 30.0
RECLAIMER_TIMEOUT = 5.0  # for the agent's answer, once it is our turn
# How long a cycle waits for an agent busy with someone else's command (a
# workload's, a trim): the agent serves one request at a time, and waiting
# RECLAIMER_TIMEOUT for it held every VM's cycle 5 s.  Asked again next cycle.
RECLAIMER_WAIT = 0.2
# A controller-driven trim holds the guest's agent (which serves one
# request at a time) this long at most, plus its compaction.
TRIM_SECONDS = 2.0
# How long what a trim could not take counts as hot: the guest's working
# set moves, and an older floor would keep its new cold cache from the host.
TRIM_FLOOR_SECONDS = 60.0
# Why a trim stopped short of its bytes, when what it left is hot.
TRIM_STOPS_AT_HOT = ("floor", "refaults", "pressure", "no_progress")


def cache_floor_of(trim_reply: dict[str, Any]) -> int:
    """The page cache a trim found it could not take (bytes).

    Always the agent's floor, which counts the active file list; when the
    trim stopped at that floor, on refaults, on pressure or for lack of
    progress, the cache it left is hot too.  Without it the controller saw
    the cache above its own estimate of the floor as cold and asked to
    trim 23 MiB every second for a minute (overcommit probe, 2026-11-26).
    """
    floor = guest_count(trim_reply.get("floor_bytes", 0), "floor_bytes")
    if trim_reply.get("stop") in TRIM_STOPS_AT_HOT:
        floor = max(floor, guest_count(trim_reply.get("cache_after", 0), "cache_after"))
    return floor


class GuestReclaimers:
    """Per guest (by name): its reclaimer's counters, its trims in flight
    and the cache floor its last trim found.  `errors` collects what a
    guest said that cannot be right, as that guest's error."""

    def __init__(self, log: Callable[[str], None], errors: list[str]) -> None:
        self.log = log
        self.errors = errors
        # name -> (when read, the reclaimer or None if the agent has none)
        self._known: dict[str, tuple[float, Reclaimer | None]] = {}
        self._trims: dict[str, threading.Thread] = {}  # in flight
        # name -> (when the last trim answered, the cache it could not take)
        self._cache_floors: dict[str, tuple[float, int]] = {}

    def forget(self, name: str) -> None:
        """A guest gone (or replaced by another of the same name)."""
        self._known.pop(name, None)
        self._cache_floors.pop(name, None)

    def reclaimer(self, name: str, agent: AgentClient) -> Reclaimer | None:
        """The reclaimer, with the cache floor its last trim (if recent) found."""
        known = self._counters(name, agent)
        answered, floor = self._cache_floors.get(name, (0.0, 0))
        if known is None or time.monotonic() - answered > TRIM_FLOOR_SECONDS:
            return known
        return replace(known, cache_floor=floor)

    def _counters(self, name: str, agent: AgentClient) -> Reclaimer | None:
        """The reclaimer's counters, read at most every refresh period."""
        read_at, known = self._known.get(name, (0.0, None))
        if time.monotonic() - read_at < RECLAIMER_REFRESH_SECONDS:
            return known
        try:
            counters = trim.reclaimer_status(agent, timeout=RECLAIMER_TIMEOUT, wait=RECLAIMER_WAIT)
        except AgentBusy:
            # Asked again next cycle.  Until it answers, a guest whose
            # reclaimer was never read counts as one without: until
            # 2026-11-26 that lasted a whole refresh period, in which the
            # first overcommit guest, busy reading its disk when the
            # controller started, was ballooned like a guest that cannot
            # trim (0-6 balloon targets a pass, the other guests none).
            return known
        except (GuestError, OSError, ValueError):
            # Silent or gone for a moment: what it said last still holds;
            # ask again next period.
            self._known[name] = (time.monotonic(), known)
            return known
        try:
            known = Reclaimer.from_counters(counters) if counters is not None else None
        except BadGuestData as exc:
            # An agent that sends garbage has no reclaimer to count on.
            self.errors.append(f"{name}: guest reclaimer ignored: {exc}")
            known = None
        self._known[name] = (time.monotonic(), known)
        return known

    def set_background(self, name: str, agent: AgentClient, on: bool) -> None:
        """Switch the reclaimer's background mode; AgentBusy if the agent is
        serving someone else (the policy asks again next cycle)."""
        try:
            counters = trim.set_background(
                agent, on, timeout=RECLAIMER_TIMEOUT, wait=RECLAIMER_WAIT
            )
        except AgentBusy:
            raise
        except (GuestError, OSError, ValueError) as exc:
            raise ThinvmError(f"guest agent: {exc}") from exc
        if counters is None:
            raise ThinvmError("the guest agent predates the reclaimer")
        self._known[name] = (time.monotonic(), Reclaimer.from_counters(counters))

    def trim(self, name: str, agent: AgentClient, max_bytes: int) -> bool:
        """Start a bounded trim of the guest in the background; False if one
        is still running.  The cycle does not wait for it: the guest's
        agent answers only when the trim and its compaction are done."""
        running = self._trims.get(name)
        if running is not None and running.is_alive():
            return False

        def run() -> None:
            reply, why = trim.request_trim(agent, max_bytes, TRIM_SECONDS)
            if reply is None:
                self.log(f"{name}: trim of {format_size(max_bytes)} not done: {why}")
                return
            try:
                got = guest_count(reply.get("reclaimed_bytes_trim", 0), "reclaimed_bytes_trim")
                reclaimer, floor = Reclaimer.from_counters(reply), cache_floor_of(reply)
            except BadGuestData as exc:
                self.errors.append(f"{name}: trim answer ignored: {exc}")
                return
            stop = str(reply.get("stop", "?"))[:40]
            self.log(f"{name}: trimmed {format_size(got)} (stopped: {stop})")
            self._known[name] = (time.monotonic(), reclaimer)
            self._cache_floors[name] = (time.monotonic(), floor)

        thread = threading.Thread(target=run, name=f"trim-{name}", daemon=True)
        self._trims[name] = thread
        thread.start()
        return True

    def close(self) -> None:
        for thread in self._trims.values():
            thread.join(timeout=TRIM_SECONDS + trim.COMPACT_SLACK)
        self._trims.clear()
