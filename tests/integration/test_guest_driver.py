"""Our guest driver (guest/balloon, thinvm_balloon.ko) against stock QEMU.

Every feature the driver negotiates is exercised in a real 6.1 guest and
checked against numbers that must add up: page counters, `actual`, host
RSS, the guest's /proc/meminfo.
"""

import subprocess
import time

import pytest

from tests.conftest import VMFactory
from thinvm.guest import workload
from thinvm.guest.agent import AgentClient
from thinvm.paths import REPO
from thinvm.units import GiB, MiB, format_size
from thinvm.vm import balloon, migrate
from thinvm.vm.machine import VM, BalloonOptions, VMConfig

pytestmark = pytest.mark.guest

PAGE = 4096
PARAMS = "/sys/module/thinvm_balloon/parameters"


def ours(name: str, memory: int = 1 * GiB, **balloon_opts: bool) -> VMConfig:
    return VMConfig(
        name=name, memory=memory, guest_driver="thinvm", balloon=BalloonOptions(**balloon_opts)
    )


def counters(agent: AgentClient) -> dict[str, int]:
    out = agent.check(f"cd {PARAMS} && grep -H . *").stdout
    values = {}
    for line in out.splitlines():
        name, _, value = line.partition(":")
        if value.lstrip("-").isdigit():
            values[name] = int(value)
    return values


def inflate_touched(vm: VM, inflate: int) -> tuple[dict[str, int], int]:
    """Back all free guest memory on the host, then inflate by `inflate`.

    Returns the driver's counters and how far host RSS fell.
    """
    memory = vm.config.memory
    workload.touch_free_memory(vm.agent)
    rss_before = vm.host_memory().rss
    balloon.set_target(vm, memory - inflate)
    balloon.wait_actual(vm, memory - inflate)
    return counters(vm.agent), rss_before - vm.host_memory().rss


def test_our_driver_is_the_one_bound(make_vm: VMFactory) -> None:
    vm = make_vm(ours("drv-bound", 512 * MiB))
    modules = vm.agent.check("cat /proc/modules").stdout
    assert "thinvm_balloon" in modules
    assert "virtio_balloon " not in modules
    bound = vm.agent.check("ls /sys/bus/virtio/drivers/thinvm_balloon/").stdout.split()
    assert [d for d in bound if d.startswith("virtio")], bound


def test_inflate_deflate_counts_rss_and_unload(make_vm: VMFactory) -> None:
    memory = 1 * GiB
    vm = make_vm(ours("drv-inflate", memory))
    before = workload.meminfo(vm.agent)
    inflate = 512 * MiB
    c, dropped = inflate_touched(vm, inflate)
    assert c["inflated_pages"] == inflate // PAGE
    assert c["inflate_requests"] == inflate // PAGE // 256  # 256 PFNs per request
    assert dropped >= 0.9 * inflate, f"host RSS dropped by only {format_size(dropped)}"
    # Without deflate-on-OOM ballooned memory leaves MemTotal.
    assert workload.meminfo(vm.agent)["MemTotal"] == before["MemTotal"] - inflate

    balloon.set_target(vm, memory - inflate // 2)
    balloon.wait_actual(vm, memory - inflate // 2)
    c = counters(vm.agent)
    assert c["inflated_pages"] == inflate // 2 // PAGE
    assert c["deflated_total"] == inflate // 2 // PAGE

    # Unloading with the balloon inflated hands every page back.
    vm.agent.check("rmmod thinvm_balloon")
    after = workload.meminfo(vm.agent)
    assert after["MemTotal"] == before["MemTotal"]
    assert after["MemFree"] >= before["MemFree"] - 64 * MiB
    assert balloon.query(vm).actual == memory
    # Loading it again inflates back to the host's target.
    vm.agent.check("insmod /lib/modules/thinvm/virtio_balloon.ko")
    balloon.wait_actual(vm, memory - inflate // 2)


def test_statistics_match_guest_meminfo(make_vm: VMFactory) -> None:
    vm = make_vm(ours("drv-stats"))
    balloon.enable_stats(vm, 1)
    stats = balloon.wait_stats(vm)["stats"]
    meminfo = workload.meminfo(vm.agent)
    assert stats["stat-total-memory"] == meminfo["MemTotal"]
    assert abs(stats["stat-free-memory"] - meminfo["MemFree"]) < 32 * MiB
    assert abs(stats["stat-available-memory"] - meminfo["MemAvailable"]) < 32 * MiB
    assert abs(stats["stat-disk-caches"] - meminfo["Cached"]) < 32 * MiB
    assert stats["stat-minor-faults"] > 0
    # Every tag QEMU knows arrives filled (none left at -1).
    assert all(value >= 0 for value in stats.values()), stats
    assert counters(vm.agent)["stats_updates"] > 0


def test_deflate_on_oom_lets_the_guest_survive(make_vm: VMFactory) -> None:
    memory = 1 * GiB
    vm = make_vm(ours("drv-oom", memory, deflate_on_oom=True))
    target = 256 * MiB
    balloon.set_target(vm, target)
    balloon.wait_actual(vm, target, timeout=180)
    free = workload.meminfo(vm.agent)["MemAvailable"]
    want = free + 256 * MiB  # more than the guest has outside the balloon
    result = vm.agent.check(f"thinvm-mem touch {want // MiB}", timeout=300)
    assert result.json()["touched_mib"] == want // MiB
    c = counters(vm.agent)
    assert c["oom_deflations"] > 0 and c["oom_deflated_pages"] > 0
    assert balloon.query(vm).actual > target  # the balloon shrank
    assert "Killed process" not in vm.agent.check("dmesg").stdout


def test_free_page_reporting_lowers_host_rss(make_vm: VMFactory) -> None:
    vm = make_vm(ours("drv-report", 1 * GiB, free_page_reporting=True))
    touched = 512 * MiB
    pid = vm.agent.check(f"thinvm-mem hold {touched // MiB}").json()["pid"]
    held = vm.host_memory().rss
    vm.agent.check(f"kill {pid}")
    deadline = time.monotonic() + 60
    while held - vm.host_memory().rss < 0.75 * touched and time.monotonic() < deadline:
        time.sleep(0.5)
    assert held - vm.host_memory().rss >= 0.75 * touched
    c = counters(vm.agent)
    assert c["report_requests"] > 0
    assert c["report_pages"] * PAGE >= 0.75 * touched


def _migrate_after_free(make_vm: VMFactory, hint: bool) -> migrate.MigrationResult:
    config = ours(f"drv-hint-{int(hint)}", free_page_hint=hint)
    src = make_vm(config)
    workload.touch_free_memory(src.agent, leave=160 * MiB)
    workload.pattern_write(src.agent, 64 * MiB, seed=51)
    dst = make_vm(config, incoming=True)
    result = migrate.migrate(src, dst)
    if hint:
        assert counters(dst.agent)["hint_blocks"] > 0
    assert workload.pattern_verify(dst.agent, seed=51).ok
    src.shutdown()
    dst.shutdown()
    return result


def test_free_page_hinting_lowers_migrated_bytes(make_vm: VMFactory) -> None:
    without = _migrate_after_free(make_vm, hint=False)
    with_hint = _migrate_after_free(make_vm, hint=True)
    # The touched-then-freed memory (~700 MiB of garbage) is skipped.
    assert with_hint.transferred < without.transferred - 256 * MiB, (
        format_size(with_hint.transferred),
        format_size(without.transferred),
    )


def test_module_builds_for_both_kernels() -> None:
    for series in ("6.1", "6.12"):
        proc = subprocess.run(
            [str(REPO / "guest" / "balloon" / "build.sh"), series],
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.strip().splitlines()[-1].endswith("thinvm_balloon.ko")


def assert_no_bad_pages(agent: AgentClient) -> None:
    """The page allocator found nothing wrong with the pages the balloon gave back."""
    dmesg = agent.check("dmesg").stdout
    assert "Bad page" not in dmesg, dmesg[-3000:]  # bad_page(): "BUG: Bad page state"


def test_612_guest_inflates_and_deflates_by_ranges(make_vm: VMFactory) -> None:
    """6.12 with our driver and page ranges in the default (movable) mode.

    init_on_free=1 turns on the allocator's checks of every page it is given back, tail
    pages of high-order frees included (6.12 skips them otherwise): deflating hands whole
    pageblocks back as one block (`deflated_blocks`), and every page of it must be clean.
    """
    config = ours("drv-612", 1 * GiB, ranges=True)
    config.kernel = "6.12"
    config.build = "patched"
    config.append = "init_on_free=1"
    vm = make_vm(config)
    assert vm.agent.check("uname -r").stdout.startswith("6.12")
    balloon.set_target(vm, 512 * MiB)
    balloon.wait_actual(vm, 512 * MiB)
    c = counters(vm.agent)
    assert c["inflated_pages"] == 512 * MiB // PAGE
    assert c["whole_blocks_held"] == 0
    balloon.set_target(vm, 1 * GiB)
    balloon.wait_actual(vm, 1 * GiB)
    c = counters(vm.agent)
    assert c["inflated_pages"] == 0
    assert c["deflated_blocks"] >= c["huge_blocks"] * 9 // 10 > 0, c
    assert_no_bad_pages(vm.agent)


def test_ranges_inflate_whole_huge_pages_and_deflate(make_vm: VMFactory) -> None:
    """Our driver + patched QEMU with x-ranges=on (docs/protocol/balloon-ranges.md)."""
    memory = 1 * GiB
    config = ours("drv-ranges", memory, ranges=True)
    config.build = "patched"
    vm = make_vm(config)
    inflate = 512 * MiB
    c, dropped = inflate_touched(vm, inflate)
    assert c["inflated_pages"] == inflate // PAGE
    assert c["huge_blocks"] > 0  # the device offered its 2 MiB THP granule
    assert 0 < c["range_requests"] <= 8  # 512 MiB in a handful of round trips
    # Every inflate request was a range request: no PFN arrays at all.
    assert c["inflate_requests"] <= c["range_requests"]
    device = "/machine/peripheral/balloon0"
    discards = vm.qmp("qom-get", path=device, property="range-discards")
    assert 0 < discards <= 512 * inflate // GiB  # the bound: 512 per GiB
    assert vm.qmp("qom-get", path=device, property="guest-errors") == 0
    assert dropped >= 0.9 * inflate, f"host RSS dropped by only {format_size(dropped)}"

    balloon.set_target(vm, memory)
    balloon.wait_actual(vm, memory)
    c = counters(vm.agent)
    assert c["inflated_pages"] == 0
    # Split blocks came back whole: one free per 2 MiB, not 512.
    assert c["deflated_blocks"] >= c["huge_blocks"] * 9 // 10, c
    assert workload.meminfo(vm.agent)["MemTotal"] >= memory - 256 * MiB
    assert_no_bad_pages(vm.agent)


HUGE_2M = "/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages"
MEMORY_BLOCKS = "/sys/devices/system/memory"


def hugepages_granted(agent: AgentClient, want: int) -> int:
    """Ask the guest kernel for `want` 2 MiB huge pages; return how many it got, then free them."""
    out = agent.check(f"echo {want} > {HUGE_2M}; cat {HUGE_2M}; echo 0 > {HUGE_2M}").stdout
    return int(out.split()[0])


def offline_and_back(agent: AgentClient, block: str) -> bool:
    """Offline a guest memory block (migrating what it holds away) and online it again."""
    state = f"{MEMORY_BLOCKS}/memory{block}/state"
    return agent.run(f"echo offline > {state} && echo online > {state}").status == 0


def offlinable_blocks(agent: AgentClient, count: int) -> list[str]:
    """The highest `count` memory blocks the guest can offline now."""
    listing = agent.check(f"ls {MEMORY_BLOCKS} | sed -n 's/^memory//p' | sort -rn").stdout
    found = []
    for block in listing.split():
        if offline_and_back(agent, block):
            found.append(block)
        if len(found) == count:
            break
    return found


def start_ranges_guest(make_vm: VMFactory, name: str, keep_whole_blocks: bool) -> VM:
    """A 3 GiB guest with page ranges; our module loaded by hand with the given mode."""
    config = ours(name, 3 * GiB, ranges=True)
    config.build = "patched"
    # The image loads the driver as virtio_balloon; load it ourselves instead.
    config.append = "thinvm.nomods=virtio_balloon"
    vm = make_vm(config)
    flag = "Y" if keep_whole_blocks else "N"
    vm.agent.check(f"insmod /lib/modules/thinvm/virtio_balloon.ko keep_whole_blocks={flag}")
    balloon.wait_actual(vm, 3 * GiB)
    return vm


def inflate_and_offline(vm: VM, blocks: list[str]) -> tuple[dict[str, int], list[bool]]:
    """Inflate by 2 GiB, then try to offline each block; return counters and results."""
    balloon.set_target(vm, 1 * GiB)
    balloon.wait_actual(vm, 1 * GiB)
    c = counters(vm.agent)
    return c, [offline_and_back(vm.agent, b) for b in blocks]


def test_ranges_balloon_blocks_stay_movable(make_vm: VMFactory) -> None:
    """Range blocks are split into movable balloon pages: memory holding them can still be
    offlined while inflated, and after deflate the guest gets as many huge pages as before
    (review item 8)."""
    vm = start_ranges_guest(make_vm, "drv-movable", keep_whole_blocks=False)
    huge_before = hugepages_granted(vm.agent, 100_000)
    # One block (128 MiB): each balloon page an offline moves costs a round
    # trip to the host under TCG; balloon_migrate shows that they moved.
    blocks = offlinable_blocks(vm.agent, 1)
    assert len(blocks) == 1, blocks

    migrated_before = workload.vmstat(vm.agent)["balloon_migrate"]
    c, offlined = inflate_and_offline(vm, blocks)
    assert c["huge_blocks"] > 0  # 2 MiB blocks, each sent as one range
    assert c["whole_blocks_held"] == 0  # none held unmovable
    assert all(offlined), list(zip(blocks, offlined, strict=True))
    assert workload.vmstat(vm.agent)["balloon_migrate"] > migrated_before

    balloon.set_target(vm, 3 * GiB)
    balloon.wait_actual(vm, 3 * GiB)
    c = counters(vm.agent)
    assert c["inflated_pages"] == 0
    assert c["deflated_blocks"] > 0  # freed whole, still movable while held
    assert_no_bad_pages(vm.agent)
    huge_after = hugepages_granted(vm.agent, 100_000)
    # A few pageblocks may be in use by the agent's own work meanwhile.
    assert huge_after >= huge_before - 8, (huge_before, huge_after)


def test_keep_whole_blocks_blocks_memory_offlining(make_vm: VMFactory) -> None:
    """The opt-in fast mode holds unmovable 2 MiB blocks: offlining memory that holds them
    fails while inflated. This is what the default mode avoids (and what the test above
    would catch)."""
    vm = start_ranges_guest(make_vm, "drv-whole", keep_whole_blocks=True)
    blocks = offlinable_blocks(vm.agent, 6)
    assert len(blocks) == 6, blocks
    c, offlined = inflate_and_offline(vm, blocks)
    assert c["whole_blocks_held"] > 0
    assert not all(offlined), list(zip(blocks, offlined, strict=True))


OURS_KO = "/lib/modules/thinvm/virtio_balloon.ko"  # the image ships ours under this name
INTREE_KO = "/lib/modules/thinvm/intree/virtio_balloon.ko"  # Debian's, not loaded at boot
DMESG_TROUBLE = ("Oops", "BUG:", "WARNING:", "Call Trace", "refcount_t", "Bad page")


def module_refcount(agent: AgentClient, name: str) -> int | None:
    """The use count /proc/modules (lsmod) shows for `name`, None when it is not loaded."""
    for line in agent.check("cat /proc/modules").stdout.splitlines():
        fields = line.split()
        if fields[0] == name:
            return int(fields[2])
    return None


def bound_devices(agent: AgentClient, driver: str) -> list[str]:
    out = agent.run(f"ls /sys/bus/virtio/drivers/{driver}/").stdout
    return [d for d in out.split() if d.startswith("virtio")]


def rmmod_cleanly(agent: AgentClient, name: str) -> None:
    """rmmod `name`; it must exit 0, leave no trace in /proc/modules and nothing in dmesg."""
    agent.check("dmesg -c >/dev/null")
    result = agent.run(f"rmmod {name}", timeout=120)
    dmesg = agent.check("dmesg").stdout
    left = module_refcount(agent, name)
    assert result.status == 0, (result.status, result.stderr, left, dmesg[-4000:])
    assert left is None, (left, dmesg[-4000:])
    assert not [t for t in DMESG_TROUBLE if t in dmesg], dmesg[-4000:]


@pytest.mark.parametrize("kernel", ["6.1", "6.12"])
def test_unload_reload_and_swap_to_the_intree_driver(make_vm: VMFactory, kernel: str) -> None:
    """Unload our driver and load it again, then swap to the in-tree virtio_balloon as
    fleet's use_intree_driver does, on the device stock-best runs (statistics, free page
    reporting, no hinting) plus deflate-on-OOM, with a stats request answered and some
    memory ballooned.

    On 6.12 that rmmod used to be killed (exit 137), leaving thinvm_balloon at use count
    -1, stuck in its exit: virtio_pci there cannot delete a queue that follows an unnamed
    entry (the absent hinting queue), see tb_find_vqs(). The in-tree driver passes such
    gaps too, so it is not unloaded here."""
    memory = 1 * GiB
    config = ours(f"drv-swap-{kernel}", memory, free_page_reporting=True, deflate_on_oom=True)
    config.kernel = kernel
    vm = make_vm(config)
    assert vm.agent.check("uname -r").stdout.startswith(kernel + ".")
    assert module_refcount(vm.agent, "thinvm_balloon") == 0
    assert bound_devices(vm.agent, "thinvm_balloon")
    balloon.enable_stats(vm, 1)
    balloon.wait_stats(vm)
    balloon.set_target(vm, memory - 64 * MiB)
    balloon.wait_actual(vm, memory - 64 * MiB)

    rmmod_cleanly(vm.agent, "thinvm_balloon")
    assert balloon.query(vm).actual == memory  # the balloon went back first
    vm.agent.check(f"insmod {OURS_KO}")
    assert module_refcount(vm.agent, "thinvm_balloon") == 0
    assert bound_devices(vm.agent, "thinvm_balloon")
    balloon.wait_actual(vm, memory - 64 * MiB)  # reloaded, it follows the target again
    assert counters(vm.agent)["inflated_pages"] == 64 * MiB // PAGE

    rmmod_cleanly(vm.agent, "thinvm_balloon")
    vm.agent.check(f"insmod {INTREE_KO}")
    assert module_refcount(vm.agent, "virtio_balloon") == 0
    assert module_refcount(vm.agent, "thinvm_balloon") is None
    assert bound_devices(vm.agent, "virtio_balloon")
    balloon.set_target(vm, memory - 32 * MiB)
    balloon.wait_actual(vm, memory - 32 * MiB)  # the in-tree driver has the device
