"""resize (issue 22): its variants, VM shapes and parameter checks, without guests."""

import pytest

from thinvm.bench import scenarios as bench_scenarios
from thinvm.bench.scenarios import resize
from thinvm.bench.types import BenchOptions, Scenario
from thinvm.errors import ThinvmError
from thinvm.units import GiB, MiB
from thinvm.vm.machine import VMConfig


def build(size: int | None = None, **params: str) -> Scenario:
    options = BenchOptions(size=size, params=dict(params))
    return bench_scenarios.get("resize").build(options)


def test_defaults_are_the_issues_guest_and_its_four_levers() -> None:
    scenario = build()
    assert scenario.params["size"] == "8.00 GiB"
    assert scenario.params["small"] == "1.00 GiB"
    assert [v.name for v in scenario.variants] == [
        "stock-balloon",
        "thinvm-balloon",
        "virtio-mem-stock",
        "virtio-mem-thinvm",
    ]
    assert scenario.baseline_name == "stock-balloon"
    [target] = scenario.targets
    assert (target.variant, target.reference, target.metric) == (
        "thinvm-balloon",
        "stock-balloon",
        "grow_ms",
    )
    assert target.at_most == pytest.approx(0.1)


def test_only_thinvm_variants_run_the_patched_build_and_sparse_ram() -> None:
    stacks = {lv.name: lv.stack for lv in resize.LEVERS}
    assert {name for name, stack in stacks.items() if stack.build == "patched"} == {
        "thinvm-balloon",
        "virtio-mem-thinvm",
    }
    for stack in stacks.values():
        assert stack.sparse == (stack.build == "patched")
        # Hinting costs more than it saves once reporting runs; none uses it.
        assert stack.reporting and not stack.hint
    assert stacks["thinvm-balloon"].ranges and stacks["thinvm-balloon"].driver == "thinvm"


@pytest.mark.parametrize("lever", resize.LEVERS, ids=lambda lv: lv.name)
def test_every_lever_starts_with_the_full_size_available(lever: resize.Lever) -> None:
    base = VMConfig(name="b-resize", memory=8 * GiB)
    config = resize.lever_config(base, lever, 8 * GiB, 1 * GiB)
    assert config.max_memory == 8 * GiB
    if lever.virtio_mem:
        assert config.memory == 1 * GiB
        assert config.virtio_mem == config.virtio_mem_plugged == 7 * GiB
    else:
        assert config.virtio_mem == 0 and config.memory == 8 * GiB


@pytest.mark.parametrize("small", ["8G", "9G", "100M", "0"])
def test_small_must_be_below_the_guest_in_whole_memory_blocks(small: str) -> None:
    with pytest.raises(ThinvmError, match="small="):
        build(8 * GiB, small=small)


def test_a_smaller_run_keeps_its_shape() -> None:
    scenario = build(2 * GiB, small="512M")
    assert scenario.params["small"] == f"{512 * MiB // MiB}.00 MiB"
