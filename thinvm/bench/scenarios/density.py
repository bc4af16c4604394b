"""Host memory held by guests that free memory: density and density-budget."""

import contextlib
from collections.abc import Callable

from thinvm.bench.probe import (
    MemoryCgroup,
    SyscallCounter,
    memory_cgroup,
    spawn_in,
)
from thinvm.bench.scenarios.common import (
    TOUCH_LEAVE,
    parallel,
)
from thinvm.bench.scenarios.params import (
    float_param,
    int_param,
)
from thinvm.bench.scenarios.spec import ScenarioSpec
from thinvm.bench.types import BenchOptions, Metrics, RunContext, Scenario, Variant
from thinvm.errors import ThinvmError
from thinvm.guest import workload
from thinvm.host.memory import wait_settled
from thinvm.units import MiB, format_size, parse_size
from thinvm.vm.machine import VM

# Several guests' memory together moves in bigger steps than one guest's.
DENSITY_SETTLE_STEP = 8 * MiB


def make_density(opts: BenchOptions, params: dict[str, str], size: int) -> Scenario:
    guests = int_param(params, "guests")
    fraction = float_param(params, "touch")
    settle_max = float_param(params, "settle_max")

    def variant(reporting: bool) -> Callable[[RunContext], Metrics]:
        def run(ctx: RunContext) -> Metrics:
            with contextlib.ExitStack() as stack:
                vms: list[VM] = []
                ctx.step(f"booting {guests} guests")
                for i in range(guests):
                    vm = opts.vm_class(opts.vm_config(f"b-dense{i}", size, reporting=reporting))
                    vms.append(stack.enter_context(vm.start(wait_agent=False)))
                for vm in vms:
                    vm.wait_agent()

                def touch(vm: VM) -> int:
                    free = workload.meminfo(vm.agent)["MemFree"] - TOUCH_LEAVE
                    amount = max(0, min(int(size * fraction), free))
                    workload.touch(vm.agent, amount)
                    return amount

                def held() -> int:
                    return sum(vm.host_memory().rss for vm in vms)

                pids = [vm.pid or 0 for vm in vms]
                with SyscallCounter(pids, opts.counter) as counter:
                    ctx.step(f"{guests} guests touch {fraction:.0%} of their RAM, then free it")
                    touched = parallel(vms, touch)
                    peak = held()
                    ctx.step("waiting for host memory to settle")
                    settled = wait_settled(held, settle_max, step=DENSITY_SETTLE_STEP)
                    final, settle_s = settled.value, settled.last_drop_s
            assert counter.counts is not None
            return {
                "held_bytes": final,
                "held_per_guest_bytes": final / guests,
                "peak_bytes": peak,
                "settle_s": settle_s,
                "discard_calls": counter.counts.discard,
                "touched_bytes": sum(touched),
            }

        return run

    return Scenario(
        name="density",
        title="host memory held by guests after they free memory",
        description=(
            f"{guests} guests of {format_size(size)} boot together, each touches "
            f"{fraction:.0%} of its RAM (at most its free memory less "
            f"{format_size(TOUCH_LEAVE)}) and frees it. Then the host memory the QEMU "
            "processes still hold (sum of RSS) is measured once it stops falling (no drop "
            f"over 8 MiB for 4 s, at most {settle_max:g} s). With free page reporting "
            "(`free-page-reporting=on`) the guest reports freed 2 MiB+ blocks and QEMU "
            "discards them; without it the host keeps everything the guests ever touched."
        ),
        variants=[
            Variant("reporting-off", variant(False), "no free page reporting"),
            Variant("reporting-on", variant(True), "free-page-reporting=on"),
        ],
        main_metric="held_bytes",
        second_metric="settle_s",
        params={
            "size": format_size(size),
            "guests": guests,
            "touch": fraction,
            "settle_max_s": settle_max,
        },
    )


def make_density_budget(opts: BenchOptions, params: dict[str, str], size: int) -> Scenario:
    budget = parse_size(params["budget"])
    max_guests = int_param(params, "max_guests")
    fraction = float_param(params, "touch")
    settle_max = float_param(params, "settle_max")

    def variant(reporting: bool) -> Callable[[RunContext], Metrics]:
        def run(ctx: RunContext) -> Metrics:
            fit, held = 0, 0
            with memory_cgroup(budget) as cgroup, contextlib.ExitStack() as stack:
                vms: list[VM] = []
                for i in range(max_guests):
                    ctx.step(f"guest {i + 1}: booting ({fit} fit so far)")
                    try:
                        vms.append(_start_in(cgroup, stack, opts, f"b-budget{i}", size, reporting))
                        vm = vms[-1]
                        free = workload.meminfo(vm.agent)["MemFree"] - TOUCH_LEAVE
                        ctx.step(f"guest {i + 1}: touching and freeing")
                        workload.touch(vm.agent, max(0, min(int(size * fraction), free)))
                        wait_settled(cgroup.usage, settle_max, step=DENSITY_SETTLE_STEP)
                    except ThinvmError as exc:
                        ctx.note("stopped_by", str(exc)[:300])
                        break
                    if not all(v.alive() for v in vms):
                        ctx.note("stopped_by", "a guest was OOM-killed")
                        break
                    fit, held = i + 1, cgroup.usage()
                ctx.note("capped", fit == max_guests)
                oom, peak = cgroup.oom_kills(), cgroup.max_usage()
            return {
                "fit_guests": fit,
                "oom_guests": oom,
                "held_bytes": held,
                "peak_bytes": peak,
            }

        return run

    return Scenario(
        name="density-budget",
        title="how many guests fit under a memory cgroup budget",
        description=(
            f"Guests of {format_size(size)} start one after another inside a cgroup-v1 "
            f"memory cgroup limited to {format_size(budget)} (no swap). Each touches "
            f"{fraction:.0%} of its RAM and frees it; once the cgroup's usage settles the "
            "next one starts. A guest fits if it finished that cycle with every guest "
            "before it still alive; the first failure (the kernel's OOM killer ends a "
            f"QEMU, or a guest cannot boot) stops the run. At most {max_guests} guests "
            "are tried. `held` is the cgroup's usage with every fitting guest idle."
        ),
        variants=[
            Variant("reporting-off", variant(False), "no free page reporting"),
            Variant("reporting-on", variant(True), "free-page-reporting=on"),
        ],
        main_metric="fit_guests",
        second_metric="held_bytes",
        params={
            "size": format_size(size),
            "budget": format_size(budget),
            "max_guests": max_guests,
            "touch": fraction,
            "settle_max_s": settle_max,
        },
    )


def _start_in(
    cgroup: MemoryCgroup,
    stack: contextlib.ExitStack,
    opts: BenchOptions,
    name: str,
    size: int,
    reporting: bool,
) -> VM:
    vm = opts.vm_class(opts.vm_config(name, size, reporting=reporting))
    with spawn_in(cgroup):
        vm.start(wait_agent=False)
    # Kill rather than `quit` at the end: a QEMU the OOM killer is taking
    # down can still look alive and drop the QMP connection mid-command.
    stack.callback(vm.kill)
    vm.wait_agent()
    return vm


SPEC = ScenarioSpec(
    "density",
    "host memory held after guests free memory",
    make_density,
    "1G",
    "RAM per guest",
    default_runs=2,
    params={"guests": "3", "touch": "0.8", "settle_max": "30"},
)
BUDGET_SPEC = ScenarioSpec(
    "density-budget",
    "guests that fit under a memory cgroup",
    make_density_budget,
    "512M",
    "RAM per guest",
    default_runs=1,
    params={"budget": "1G", "max_guests": "8", "touch": "0.8", "settle_max": "20"},
)
