"""`thinvm resize`'s size rules, without a guest."""

import pytest

from thinvm.errors import ThinvmError
from thinvm.units import GiB, MiB
from thinvm.vm.machine import BalloonOptions, VMConfig
from thinvm.vm.resize import lever, plan

BLOCK = 2 * MiB
VMEM = VMConfig(name="v", memory=512 * MiB, virtio_mem=1 * GiB)
BALLOON_ONLY = VMConfig(name="b", memory=2 * GiB)


def test_virtio_mem_is_the_lever_where_there_is_one() -> None:
    assert lever(VMEM) == "virtio-mem"
    assert lever(BALLOON_ONLY) == "balloon"
    neither = VMConfig(name="n", balloon=BalloonOptions(enabled=False))
    with pytest.raises(ThinvmError, match="neither virtio-mem nor a balloon"):
        lever(neither)


def test_virtio_mem_size_is_the_guest_total() -> None:
    assert plan(VMEM, 1 * GiB, BLOCK).target == 512 * MiB
    assert plan(VMEM, 512 * MiB, BLOCK).target == 0  # all unplugged: base only
    whole = plan(VMEM, 1536 * MiB, BLOCK)
    assert (whole.target, whole.size, whole.note) == (1 * GiB, 1536 * MiB, "")


def test_virtio_mem_rounds_down_to_a_whole_block_and_says_so() -> None:
    # Down, as the balance controller does (thinvm.vm.resize.requested_size):
    # never more than asked.
    down = plan(VMEM, 513 * MiB, BLOCK)
    assert (down.target, down.size) == (0, 512 * MiB)
    assert "not a whole number of 2.00 MiB virtio-mem blocks: resizing to 512.00 MiB" in down.note
    almost = plan(VMEM, 1 * GiB + 1000 * 1024, BLOCK)
    assert (almost.target, almost.size) == (512 * MiB, 1 * GiB) and almost.note


def test_virtio_mem_refuses_sizes_outside_base_and_max() -> None:
    with pytest.raises(ThinvmError, match=r"below its base memory 512\.00 MiB"):
        plan(VMEM, 400 * MiB, BLOCK)
    with pytest.raises(ThinvmError, match=r"above its maximum 1.50 GiB \(512.00 MiB base"):
        plan(VMEM, 1536 * MiB + 1, BLOCK)


def test_the_balloon_lever_takes_what_the_balloon_can_leave() -> None:
    assert plan(BALLOON_ONLY, 1 * GiB, 1).target == 1 * GiB
    for size in (0, 2 * GiB + 1):
        with pytest.raises(ThinvmError, match="its balloon can leave it between"):
            plan(BALLOON_ONLY, size, 1)
