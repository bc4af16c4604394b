"""migrate-working-set (issue 20): its rows, sizes, counters and targets, without guests."""

import subprocess

import pytest

from thinvm.bench import scenarios as bench_scenarios
from thinvm.bench.scenarios import common, workingset
from thinvm.bench.types import BenchOptions, Scenario
from thinvm.errors import ThinvmError
from thinvm.guest import workload
from thinvm.units import GiB, MiB


def build(size: int | None = None, **params: str) -> Scenario:
    options = BenchOptions(size=size, params=dict(params))
    return bench_scenarios.get("migrate-working-set").build(options)


def test_defaults_are_the_issues_guest() -> None:
    scenario = build()
    assert scenario.params["size"] == "4.00 GiB"
    assert scenario.params["guest"] == "busybox"
    # Half the guest read once, 256 MiB of it hot, 256 MiB of anonymous data.
    assert scenario.params["data"] == "2.00 GiB"
    assert scenario.params["hot"] == "256.00 MiB"
    assert scenario.params["anon"] == "256.00 MiB"
    assert scenario.params["multifd-channels"] == 2


def test_rows_are_stock_best_dropcaches_reclaimer_and_thinvm_each_chosen_from_candidates() -> None:
    scenario = build()
    stock = [c.name for c in common.STOCK_CANDIDATES]
    thinvm = [c.name for c in common.THINVM_CANDIDATES]
    dropped = [f"{name}-dropcaches" for name in stock]
    reclaimed = [f"{name}-reclaimer" for name in stock]
    assert [b.name for b in scenario.best] == [
        "stock-best",
        "stock-best-dropcaches",
        "stock-best-reclaimer",
        "thinvm",
    ]
    assert [b.candidates for b in scenario.best] == [
        tuple(stock),
        tuple(dropped),
        tuple(reclaimed),
        tuple(thinvm),
    ]
    # Our guest side alone on stock QEMU is a row of its own, against the
    # stock + reclaimer anchor.
    guest_side = "stock-thinvm-guest"
    assert [v.name for v in scenario.variants] == [
        *stock, *dropped, *reclaimed, guest_side, *thinvm,
    ]  # fmt: skip
    [row] = [v for v in scenario.variants if v.name == guest_side]
    assert row.reference == "stock-best-reclaimer"
    assert scenario.baseline_name == "stock-best"
    # The step before migrating counts: the rows are chosen by total_ms.
    assert scenario.choice_metric == "total_ms"
    # Naming a chosen row keeps its candidates, as in every migration scenario.
    scenario.select(["stock-mfd2", "stock-mfd2-dropcaches", "thinvm"])
    assert scenario.rows == [
        "stock-best",
        "stock-best-dropcaches",
        "thinvm",
        "stock-mfd2",
        "stock-mfd2-dropcaches",
        *thinvm,
    ]


def test_targets_are_the_issues() -> None:
    targets = {(t.reference, t.metric): t.at_most for t in build().targets}
    assert all(t.variant == "thinvm" for t in build().targets)
    assert targets == {
        ("stock-best", "transferred_bytes"): pytest.approx(1 / 3),
        ("stock-best", "migration_ms"): pytest.approx(1 / 2.5),
        ("stock-best", "total_ms"): pytest.approx(1 / 2),
        ("stock-best", "hot_reread_ms"): pytest.approx(1.2),
        ("stock-best-dropcaches", "hot_reread_ms"): pytest.approx(1.0),
        ("stock-best-reclaimer", "total_ms"): pytest.approx(1.0),
        ("stock-best-reclaimer", "src_cpu_s"): pytest.approx(1 / 2),
    }


def test_sizes_scale_with_the_guest_or_are_given() -> None:
    small = build(768 * MiB, data="256M", hot="32M", anon="32M")
    assert (small.params["data"], small.params["hot"]) == ("256.00 MiB", "32.00 MiB")
    assert build(2 * GiB).params["data"] == "1.00 GiB"  # half by default
    assert build(2 * GiB, data="0.25").params["data"] == "512.00 MiB"
    assert workingset.fraction_or_size("1.5G", "data", 4 * GiB) == 1536 * MiB


@pytest.mark.parametrize(
    ("params", "error"),
    [
        ({"data": "1.5"}, "want a fraction of guest RAM"),
        ({"data": "3900M"}, "pass a bigger --size"),
        ({"data": "256M", "hot": "512M"}, "the hot subset is part of it"),
        ({"passes": "0"}, "passes: want at least 1"),
        ({"hot": "lots"}, "cannot parse size .lots."),
        ({"guest": "windows"}, "choose busybox or debian"),
    ],
)
def test_bad_parameters_say_what_to_pass(params: dict[str, str], error: str) -> None:
    with pytest.raises(ThinvmError, match=error):
        build(**params)


def test_io_counters_read_refaults_and_sectors() -> None:
    text = (
        "workingset_refault_anon 3\n"
        "workingset_refault_file 120\n"
        "    1520        0   524288     900        0        0        0        0        0"
        "     1000     900        0        0        0        0        0        0\n"
    )
    assert workingset.io_counters(text) == (123, 524288 * 512)
    # 5.x kernels name one counter only; a disk without reads reads 0.
    assert workingset.io_counters("workingset_refault 7\n") == (7, 0)


def test_the_data_disk_exists_only_inside_the_session() -> None:
    disk = workingset.DataDisk(2 * MiB)
    with pytest.raises(ThinvmError, match="outside its scenario's session"):
        disk.args()
    with disk.made() as path:
        assert path.stat().st_size == 2 * MiB
        assert str(path) in disk.args()[1]
    assert not path.exists() and disk.path is None


def test_the_debian_guest_reads_a_file_on_a_second_disk() -> None:
    scenario = build(guest="debian")
    assert scenario.params["guest"] == "debian"
    assert "read-only ext4" in scenario.description
    source = workingset.DATA_SOURCES["debian"]
    assert (source.path, source.device) == ("/srv/thinvm-ws/data", "vdb")
    assert workingset.mount_command(source) == (
        "mkdir -p /srv/thinvm-ws && mount -t ext4 -o ro /dev/vdb /srv/thinvm-ws"
    )
    assert workingset.DATA_SOURCES["busybox"] == workingset.DataSource("/dev/vda", "vda")


def test_reads_name_their_source() -> None:
    assert workload.read_disk_command(2 * MiB, passes=3, skip=MiB) == (
        "for i in $(seq 3); do dd if=/dev/vda of=/dev/null bs=1M count=2 skip=1 2>/dev/null; done"
    )
    command = workload.read_disk_command(256 * MiB, source="/srv/thinvm-ws/data")
    assert "dd if=/srv/thinvm-ws/data of=/dev/null bs=1M count=256 skip=0" in command


def test_the_filesystem_holds_the_data_set_with_room_for_its_metadata() -> None:
    assert workingset.filesystem_size(2 * GiB) == 2 * GiB + 32 * MiB + 64 * MiB
    assert workingset.filesystem_size(MiB) % MiB == 0


def test_the_debian_data_disk_is_an_ext4_image_holding_only_the_data_file() -> None:
    disk = workingset.DataDisk(4 * MiB, "debian")
    with disk.made() as path:
        assert path.stat().st_size == workingset.filesystem_size(4 * MiB)
        assert not (path.parent / "content" / workingset.DATA_FILE).exists()
        listing = subprocess.run(
            ["debugfs", "-R", "ls -l /", str(path)], capture_output=True, text=True, check=True
        ).stdout
        assert " 4194304 " in listing and listing.rstrip().endswith(workingset.DATA_FILE)
        label = subprocess.run(
            ["e2label", str(path)], capture_output=True, text=True, check=True
        ).stdout
        assert label.strip() == workingset.DATA_LABEL
    assert not path.exists() and disk.path is None
