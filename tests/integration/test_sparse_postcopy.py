"""sparse-ram with postcopy (qemu/patches 0012; 0005 for the hole runs), real guest.

QEMU's own test of "unpopulated at setup, written during the migration,
still dirty at the switchover" (0014, dirty-at-switchover) writes with
qtest, which marks QEMU's dirty bitmap directly; here a real guest
writes through its own page tables.
"""

from dataclasses import replace
from typing import Any

import pytest

from tests.conftest import VMFactory
from thinvm.guest import workload
from thinvm.units import GiB, MiB
from thinvm.vm import migrate
from thinvm.vm.machine import VM, VMConfig
from thinvm.vm.stack import THINVM

pytestmark = pytest.mark.guest

PAGE = 4096
# thinvm's stack as it runs postcopy: QEMU 10.0 has no multifd with postcopy.
STACK = replace(THINVM, multifd=False)
POSTCOPY = {**STACK.caps, "postcopy-ram": True}
DURING = "/dev/shm/written-during-migration"
SEED = 61
WRITTEN = 32 * MiB
# The first pass has ~80 MiB of populated memory to send after a kept
# boot: at this rate it is far from done at the switchover, which comes
# a few seconds in, so no bitmap sync comes between the writes and it.
PRECOPY_BANDWIDTH = 2 * MiB
# With preempt, the background trickles after the switchover, so that
# the destination guest's reads are what fetch the written pages.
TRICKLE = 4 * MiB


def start_pair(make_vm: VMFactory, caps: dict[str, bool]) -> tuple[VM, VM]:
    config = VMConfig(
        name="sparse-postcopy-dirty",
        build=STACK.build,
        guest_driver=STACK.driver,
        memory=1 * GiB,
        balloon=STACK.balloon(),
    )
    src = make_vm(config)
    dst = make_vm(config, incoming=True)
    migrate.set_capabilities(dst, caps)
    return src, dst


def checksum(vm: VM) -> str:
    return vm.agent.check(f"md5sum {DURING}").stdout.split()[0]


def migration_info(vm: VM) -> dict[str, Any]:
    info: dict[str, Any] = vm.qmp("query-migrate")
    return info


def write_during_first_pass(src: VM, populated_before: int) -> str:
    """The guest writes WRITTEN bytes of pattern into fresh memory while
    the first pass runs; the checksum of what it wrote."""
    migrate.wait_status(src, ("active",))  # setup's hole walk is done
    syncs_at_start = migration_info(src)["ram"]["dirty-sync-count"]
    workload.pattern_write(src.agent, WRITTEN, seed=SEED, path=DURING)
    written = checksum(src)

    info = migration_info(src)
    assert info["status"] == "active", f"precopy ended before the switchover: {info}"
    assert info["ram"]["dirty-sync-count"] == syncs_at_start, (
        "a bitmap sync came between the guest's writes and the switchover, so not all "
        f"of them are dirty at it; lower PRECOPY_BANDWIDTH: {info['ram']}"
    )
    # Most of the guest's fresh pages were never populated on the host.
    grown = src.host_memory().anonymous - populated_before
    assert grown >= WRITTEN // 2, (
        "the guest's writes did not land in memory the host had left unpopulated "
        f"(source RSS grew {grown >> 20} MiB for {WRITTEN >> 20} MiB written)"
    )
    return written


def read_back_in_postcopy(src: VM, dst: VM) -> None:
    """The destination guest verifies the pattern while the background
    trickles: its reads fault the pages in from the source."""
    migrate.wait_destination_status(dst, "running")
    dst.wait_agent(timeout=120)
    check = workload.pattern_verify(dst.agent, seed=SEED, path=DURING)
    assert check.ok, f"destination read wrong data in postcopy: {check}"
    info = migration_info(src)
    assert info["status"] == "postcopy-active", f"the background sent it all first: {info}"
    assert info["ram"]["postcopy-requests"] > 1000, "the guest's reads did not fault"
    migrate.set_parameters(src, {"max-postcopy-bandwidth": 0})


@pytest.mark.parametrize("preempt", [False, True], ids=["plain", "preempt"])
def test_postcopy_fetches_pages_written_into_holes_during_precopy(
    make_vm: VMFactory, record_property: Any, preempt: bool
) -> None:
    """A page the host never populated when the migration started (so the
    first pass left it out), written by the guest during precopy and still
    dirty at the switchover, reaches the destination with its data.

    Once the migration is active, the guest writes 32 MiB of pattern into
    fresh tmpfs pages, most of them holes on the host at setup (asserted
    from the source's RSS).  The switchover comes while the first pass is
    still going, with no bitmap sync since the setup one (asserted): every
    page written is dirty at the switchover, and those that were holes
    were never sent before it.  The source lists them for discarding, and
    the destination must fetch them rather than place a zero page as for
    the pages left out (0012).  Plain postcopy sends the rest uncapped, so
    the guest's faults race the background; with preempt the background
    trickles and the guest's reads fetch the pages on the preempt channel.
    A lost write fails the pattern check and the checksum, which the guest
    took on the source.

    Under TCG (what `--accel auto` picks where KVM runs guests slower, as
    on the test machines; the test records the accelerator that ran) the
    dirty log is TCG's own: the guest's stores set QEMU's dirty bitmap
    through the softmmu TLB, and the bitmap sync at the switchover
    collects them.  So this covers the real guest's writes, the bitmap
    sync and 0005's second look at the hole runs (which must not drop what
    is written after it); 0005's clear of the remote dirty log is a no-op
    under TCG, as only KVM's memory listener has log_clear.  The KVM
    dirty-log ioctls are exercised only on a host where the probe picks
    KVM, and then by this same test.
    """
    caps = {**POSTCOPY, "postcopy-preempt": True} if preempt else POSTCOPY
    src, dst = start_pair(make_vm, caps)
    record_property("accel", src.accel)
    print(f"accelerator: {src.accel}")
    populated_before = src.host_memory().anonymous
    uri = migrate.start_incoming(dst, migrate.free_port())
    migrate.set_capabilities(src, caps)
    migrate.set_parameters(src, {"max-bandwidth": PRECOPY_BANDWIDTH})
    if preempt:
        migrate.set_parameters(src, {"max-postcopy-bandwidth": TRICKLE})
    src.qmp("migrate", uri=uri)
    written = write_during_first_pass(src, populated_before)

    migrate.start_postcopy(src)
    if preempt:
        read_back_in_postcopy(src, dst)
    info = migrate.wait_migration(src, 120)
    assert info["status"] == "completed", info
    migrate.wait_destination_status(dst, "running")
    dst.wait_agent(timeout=60)

    ram = info["ram"]
    assert ram["sparse-skipped"] > 0, f"the source left nothing out: {ram}"
    assert ram["postcopy-bytes"] >= WRITTEN, f"the written pages did not go in postcopy: {ram}"
    check = workload.pattern_verify(dst.agent, seed=SEED, path=DURING)
    assert check.ok and check.pages == WRITTEN // PAGE, check
    assert checksum(dst) == written, "the written memory differs from the source's"
