"""What the scenarios share: the stacks they compare and guest-side steps."""

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from thinvm.bench.types import Best, Metrics, RunContext, Variant
from thinvm.errors import ThinvmError
from thinvm.guest import workload
from thinvm.guest.agent import AgentClient
from thinvm.host.memory import host_meminfo, wait_settled
from thinvm.units import MiB, format_size
from thinvm.vm.machine import VM
from thinvm.vm.stack import STOCK_BEST, THINVM, Stack

TOUCH_LEAVE = 96 * MiB  # free memory a "touch most of RAM" leaves the guest


LEGACY = Stack()  # stock QEMU and driver, no extras
STOCK_HINT = replace(STOCK_BEST, hint=True)  # stock-best plus free page hinting


@dataclass(frozen=True)
class Candidate:
    """One configuration a migration scenario measures: a stack, and migration
    parameters on top of the usual ones (transport.MIGRATION_PARAMS, CHANNELS)."""

    name: str
    stack: Stack
    description: str
    params: dict[str, Any] = field(default_factory=dict)


ONE_CHANNEL: dict[str, Any] = {"multifd-channels": 1}
_STOCK = "stock QEMU and driver"
_THINVM = "patched QEMU, our driver"

# What every migration scenario compares (issue 19): the best stock setup is
# not decided beforehand but measured in the same run, among these.  Free
# page hinting may cost more than it saves once reporting runs, and one
# multifd channel may beat two on 2 CPUs; legacy is also a column of its own.
STOCK_CANDIDATES: list[Candidate] = [
    Candidate(
        "stock-hint-mfd2", STOCK_HINT, f"{_STOCK}; hinting + reporting, multifd (2 channels)"
    ),
    Candidate("stock-mfd2", STOCK_BEST, f"{_STOCK}; reporting, multifd (2 channels)"),
    Candidate(
        "stock-hint-mfd1",
        STOCK_HINT,
        f"{_STOCK}; hinting + reporting, multifd (1 channel)",
        ONE_CHANNEL,
    ),
    Candidate(
        "stock-mfd1",
        STOCK_BEST,
        f"{_STOCK}; reporting, multifd (1 channel)",
        ONE_CHANNEL,
    ),
    Candidate(
        "stock-hint",
        replace(STOCK_HINT, multifd=False),
        f"{_STOCK}; hinting + reporting, one stream",
    ),
    Candidate("stock-reporting", Stack(reporting=True), f"{_STOCK}; reporting, one stream"),
    Candidate("legacy", LEGACY, f"{_STOCK}, no extras, one stream"),
]
# thinvm's own default is likewise the measured best of its options.
THINVM_CANDIDATES: list[Candidate] = [
    Candidate(
        "thinvm-hint",
        replace(THINVM, hint=True),
        f"{_THINVM}; hinting + reporting + page ranges, sparse-ram, multifd (2 channels)",
    ),
    Candidate(
        "thinvm-no-hint",
        THINVM,
        f"{_THINVM}; reporting + page ranges, sparse-ram, multifd (2 channels)",
    ),
]
MIGRATION_CANDIDATES = STOCK_CANDIDATES + THINVM_CANDIDATES


def chosen_row(
    row: str,
    candidates: Sequence[Candidate],
    make: Callable[[Candidate], Callable[[RunContext], Metrics]],
    description: str,
    *,
    rename: Callable[[str], str] = lambda name: name,
    what: str = "",
    reference: str | None = None,
    row_reference: str | None = None,
) -> tuple[list[Variant], Best]:
    """Every candidate as a variant named `rename`(its name), and the row
    `row` that carries the figures of the best of them.

    `what` opens each description; `reference` is the row the candidates'
    ratios are taken against and `row_reference` the chosen row's (default:
    the baseline).
    """
    variants = [
        Variant(rename(c.name), make(c), what + c.description, reference=reference)
        for c in candidates
    ]
    best = Best(row, tuple(v.name for v in variants), what + description, row_reference)
    return variants, best


def migration_rows(
    make: Callable[[Candidate], Callable[[RunContext], Metrics]],
    *,
    prefix: str = "",
    what: str = "",
    reference: str | None = None,
) -> tuple[list[Variant], list[Best]]:
    """Every candidate as a variant named `prefix` + its name, and the chosen
    rows `prefix`stock-best and `prefix`thinvm.

    `what` opens each description; `reference` is the row the candidates'
    and thinvm's ratios are taken against (default: the baseline), and
    stock-best's is always the baseline.
    """

    def rename(name: str) -> str:
        return prefix + name

    stock, stock_best = chosen_row(
        f"{prefix}stock-best",
        STOCK_CANDIDATES,
        make,
        "the best stock configuration measured",
        rename=rename,
        what=what,
        reference=reference,
    )
    thinvm, thinvm_best = chosen_row(
        f"{prefix}thinvm",
        THINVM_CANDIDATES,
        make,
        "thinvm's best option measured",
        rename=rename,
        what=what,
        reference=reference,
        row_reference=reference,
    )
    return stock + thinvm, [stock_best, thinvm_best]


# thinvm's QEMU side with the guest kernel's own balloon driver.
THINVM_STOCK_DRIVER = Stack(
    build="patched", driver="stock", reporting=True, sparse=True, multifd=True
)


def touch_most(vm: VM, leave: int = TOUCH_LEAVE) -> Metrics:
    """The guest faults in (and frees) all but `leave` of its free memory."""
    size = max(0, workload.meminfo(vm.agent)["MemFree"] - leave)
    result = workload.touch(vm.agent, size)
    return {"touched_bytes": size, "touch_guest_s": float(result["ms"]) / 1000}


def fits_reserved(memory: int) -> bool:
    """Whether a reserved mapping of `memory` passes the overcommit check."""
    info = host_meminfo()
    return memory <= info["MemTotal"] + info.get("SwapTotal", 0)


def hold_then_idle(
    ctx: RunContext, src: VM, stack: Stack, used: int, seed: int, idle: float
) -> Metrics:
    """The idle guest of the migration and save scenarios: it writes `used`
    bytes of data (a pattern the destination can verify), touches and frees
    the rest of its RAM, idles, and lets free page reporting settle."""
    ctx.note("boot_s", src.boot_seconds)
    if used:
        ctx.step(f"guest writes a {format_size(used)} pattern")
        workload.pattern_write(src.agent, used, seed)
    ctx.step("guest touches its free memory")
    metrics = touch_most(src)
    time.sleep(idle)
    if stack.reporting:
        ctx.step("waiting for free page reporting to settle")
        wait_settled(lambda: src.host_memory().rss, timeout=60)
    metrics["src_rss_bytes"] = src.host_memory().rss
    return metrics


def timed_in_guest(vm: VM, command: str) -> float:
    """Run `command` in the guest; the seconds it took by the guest's clock.

    Timed inside, not around the agent round trip: the agent serves one
    request at a time, and a controller's trim holding it for a moment is
    not time the workload spent (getting memory, reading)."""
    return timed_by_agent(vm.agent, command)


def timed_by_agent(agent: AgentClient, command: str, timeout: float = 300.0) -> float:
    """timed_in_guest for any agent connection (a libvirt domain's too)."""
    out = agent.check(
        f"read t0 _ </proc/uptime; {command} >/dev/null; read t1 _ </proc/uptime; echo $t0 $t1",
        timeout=timeout,
    ).stdout.split()
    return float(out[-1]) - float(out[-2])


def verify_pattern(dst: VM, ctx: RunContext, seed: int) -> None:
    ctx.step("verifying the pattern on the destination")
    check = workload.pattern_verify(dst.agent, seed)
    if not check.ok:
        raise ThinvmError(
            f"pattern check failed on the destination: {check.bad} of {check.pages} "
            f"pages differ, first at page {check.first_bad}"
        )


def parallel(vms: list[VM], func: Callable[[VM], Any]) -> list[Any]:
    with ThreadPoolExecutor(max_workers=len(vms)) as pool:
        return list(pool.map(func, vms))
