"""fleet-overcommit (issue 47, density under libvirt): which host and QEMU
each variant's domains get, and how the budget's slice is read."""

from pathlib import Path

import pytest

from thinvm.bench.probe import MemoryCgroup
from thinvm.bench.scenarios import fleet, fleet_overcommit
from thinvm.bench.scenarios.fleet_overcommit import HOST_OF_BUILD, VARIANTS, SliceBudget
from thinvm.bench.types import BenchOptions
from thinvm.errors import ThinvmError
from thinvm.guest import image as guest_image
from thinvm.host.cgroups import CGROUP_FS
from thinvm.units import MiB

IMAGE = guest_image.DiskImage(Path("/img"), "6.1", "6.1.0-test", "root=/dev/vda rw")


def test_every_stock_row_runs_on_debians_qemu_and_thinvm_on_ours() -> None:
    kind = fleet.CLUSTERS[fleet_overcommit.CLUSTER]
    assert kind.packaged and kind.systemd
    for name, setup, _text in VARIANTS:
        host = HOST_OF_BUILD[setup.stack.build]
        assert (host in kind.stock) == (name != "thinvm"), name
        run = fleet.FleetRun(setup.stack, cluster=fleet_overcommit.CLUSTER, name="bench-oc-0")
        spec = run.domain(IMAGE, 1024 * MiB, Path("/shared"))
        # Plain XML: reporting on every row, no sparse-ram capability anywhere.
        assert spec.free_page_reporting and spec.sparse_ram is None, name
        assert spec.emulator == fleet.PACKAGED_BINARY[setup.stack.build], name
    # The anchors of issue 47's density target are all rows here.
    names = {name for name, _setup, _text in VARIANTS}
    assert {"reporting", "stock-reclaimer", "proxmox", "mom", "thinvm"} <= names


def test_only_the_reference_runs_without_a_budget() -> None:
    unlimited = [name for name, setup, _text in VARIANTS if not setup.limited]
    assert unlimited == ["unconstrained"]


def test_the_slice_is_named_below_the_memory_root_and_counts_its_own_ooms(
    tmp_path: Path,
) -> None:
    path = CGROUP_FS / "memory" / "thinvm" / "thinvm-x-h1" / "machine.slice"
    assert SliceBudget(MemoryCgroup(path), 0).name == "thinvm/thinvm-x-h1/machine.slice"
    (tmp_path / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 5\n")
    assert SliceBudget(MemoryCgroup(tmp_path), 3).oom_kills() == 2


def test_the_scenario_judges_thinvm_against_every_anchor() -> None:
    scenario = fleet_overcommit.SPEC.build(BenchOptions())
    assert scenario.main_metric == "fit_guests" and scenario.baseline == "reporting"
    judged = {t.variant for t in scenario.targets}
    assert judged == {"reporting", "stock-reclaimer", "proxmox", "mom"}
    assert all(t.reference == "thinvm" and t.at_most == 1 / 1.5 for t in scenario.targets)


def test_every_row_bounds_the_translation_cache_and_the_record_says_so() -> None:
    scenario = fleet_overcommit.SPEC.build(BenchOptions())
    assert scenario.params["tb_cache"] == "32.00 MiB"
    assert "translation cache is bounded to 32.00 MiB" in scenario.description
    wider = fleet_overcommit.SPEC.build(BenchOptions(params={"tb-cache": "64M"}))
    assert wider.params["tb_cache"] == "64.00 MiB"
    with pytest.raises(ThinvmError, match="translation cache"):
        fleet_overcommit.SPEC.build(BenchOptions(params={"tb-cache": "1536K"}))
