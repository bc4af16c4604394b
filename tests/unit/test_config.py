"""Command lines and input validation, without starting QEMU."""

import json
from pathlib import Path

import pytest

from thinvm.cli import main
from thinvm.errors import ThinvmError
from thinvm.guest import image
from thinvm.guest.image import GuestImage
from thinvm.qemu import accel, builds
from thinvm.qemu.builds import QemuBuild
from thinvm.units import GiB, MiB
from thinvm.vm.machine import (
    VM,
    BalloonOptions,
    VMConfig,
    check_memory_fits,
    check_virtio_mem,
)
from thinvm.vm.migrate import MigrationResult


def _vm(config: VMConfig, incoming: bool = False) -> VM:
    vm = VM(config, incoming=incoming, rundir=Path("/tmp/thinvm-unit"))
    vm.build = QemuBuild("stock", Path("/q"), "1:10.0", "abc", ())
    vm.image = GuestImage(Path("/k"), Path("/i"), {})
    vm.accel = "tcg"
    return vm


def _option(args: list[str], flag: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args) if a == flag]


def test_guests_run_without_the_hpet() -> None:
    """Linux leaves the HPET periodic after boot and QEMU kept firing it:
    4-6% of a host CPU per idle guest (docs/architecture.md)."""
    (machine,) = _option(_vm(VMConfig()).command_line(), "-machine")
    assert "hpet=off" in machine.split(",")


def test_free_page_hint_gets_an_iothread() -> None:
    config = VMConfig(balloon=BalloonOptions(free_page_hint=True, free_page_reporting=True))
    args = _vm(config).command_line()
    (device,) = [d for d in _option(args, "-device") if d.startswith("virtio-balloon-pci")]
    assert "free-page-hint=on" in device and "iothread=balloon-iothread" in device
    assert "free-page-reporting=on" in device
    assert "iothread,id=balloon-iothread" in _option(args, "-object")


def test_stacks_set_the_balloon_device() -> None:
    from thinvm.vm.stack import STOCK_BEST, THINVM

    def device(config: VMConfig) -> str:
        (dev,) = [d for d in _option(_vm(config).command_line(), "-device") if "balloon" in d]
        return dev

    thinvm_dev = device(VMConfig(balloon=THINVM.balloon(deflate_on_oom=True)))
    for prop in ("x-ranges=on", "free-page-reporting=on", "deflate-on-oom=on"):
        assert prop in thinvm_dev
    stock_dev = device(VMConfig(balloon=STOCK_BEST.balloon()))
    assert "free-page-reporting=on" in stock_dev
    # Neither hints: it measured slower once reporting runs (thinvm.vm.stack).
    assert "free-page-hint" not in thinvm_dev and "free-page-hint" not in stock_dev
    assert "ranges" not in stock_dev
    # Both migrate over multifd: the comparison is with stock's best transport.
    assert THINVM.caps == {"sparse-ram": True, "multifd": True}
    assert STOCK_BEST.caps == {"multifd": True}
    assert "page ranges" in THINVM.describe() and "sparse-ram" in THINVM.describe()


def test_no_balloon_means_no_device() -> None:
    args = _vm(VMConfig(balloon=BalloonOptions(enabled=False))).command_line()
    assert not [d for d in _option(args, "-device") if "balloon" in d]


def test_memory_backend_options() -> None:
    config = VMConfig(memory=4 * GiB, prealloc=True, prealloc_threads=2, reserve=False)
    (backend,) = [o for o in _option(_vm(config).command_line(), "-object") if "mem0" in o]
    assert backend.startswith("memory-backend-ram,id=mem0,size=4294967296")
    assert "prealloc=on,prealloc-threads=2" in backend and "reserve=off" in backend


def test_file_backend_is_shared() -> None:
    config = VMConfig(backend="file:/dev/shm/pool0")
    (backend,) = [o for o in _option(_vm(config).command_line(), "-object") if "mem0" in o]
    assert backend.startswith("memory-backend-file")
    assert "mem-path=/dev/shm/pool0,share=on" in backend


def test_unknown_backend_is_an_error() -> None:
    with pytest.raises(ThinvmError, match="unknown memory backend"):
        _vm(VMConfig(backend="nvme")).command_line()


def test_virtio_mem_device_backend_and_maxmem() -> None:
    config = VMConfig(memory=512 * MiB, virtio_mem=1 * GiB, virtio_mem_plugged=256 * MiB)
    args = _vm(config).command_line()
    assert _option(args, "-m") == ["512M,maxmem=1536M"]
    assert "memory-backend-ram,id=vmem0,size=1073741824" in _option(args, "-object")
    (device,) = [d for d in _option(args, "-device") if d.startswith("virtio-mem-pci")]
    assert device == (
        "virtio-mem-pci,id=vmem0dev,memdev=vmem0,block-size=2M,requested-size=268435456"
    )
    # Hotplugged memory is onlined by the guest kernel, movable.
    assert "memhp_default_state=online_movable" in _option(args, "-append")[0]


def test_virtio_mem_follows_the_ram_backend_and_preallocates_on_plug() -> None:
    config = VMConfig(virtio_mem=1 * GiB, backend="memfd", prealloc=True, reserve=False)
    args = _vm(config).command_line()
    assert "memory-backend-memfd,id=vmem0,size=1073741824,reserve=off" in _option(args, "-object")
    (device,) = [d for d in _option(args, "-device") if d.startswith("virtio-mem-pci")]
    assert device.endswith(",prealloc=on")


def test_no_virtio_mem_leaves_the_command_line_as_it_was() -> None:
    args = _vm(VMConfig(memory=1 * GiB)).command_line()
    assert _option(args, "-m") == ["1024M"]
    assert not [d for d in _option(args, "-device") if "virtio-mem" in d]
    assert "memhp_default_state" not in _option(args, "-append")[0]


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (VMConfig(virtio_mem=3 * MiB), "not a positive multiple of the 2.00 MiB block size"),
        (VMConfig(virtio_mem=1 * GiB, virtio_mem_plugged=2 * GiB), "between 0 and --virtio-mem"),
        (VMConfig(virtio_mem=1 * GiB, virtio_mem_plugged=MiB), "must be a multiple of 2.00 MiB"),
        (VMConfig(virtio_mem_plugged=2 * MiB), "needs --virtio-mem SIZE"),
        (VMConfig(virtio_mem=1 * GiB, backend="file:/x"), "needs guest RAM from --backend ram"),
        (VMConfig(virtio_mem=1 * GiB, pool="/p"), "no file-backed or warm pool virtio-mem"),
    ],
)
def test_bad_virtio_mem_configurations(config: VMConfig, message: str) -> None:
    with pytest.raises(ThinvmError, match=message):
        check_virtio_mem(config)


def test_incoming_defers() -> None:
    args = _vm(VMConfig(), incoming=True).command_line()
    assert _option(args, "-incoming") == ["defer"]


def test_memory_that_cannot_fit() -> None:
    with pytest.raises(ThinvmError, match="cannot fit"):
        check_memory_fits(VMConfig(memory=1024 * 1024 * GiB))
    with pytest.raises(ThinvmError, match="cannot preallocate"):
        check_memory_fits(VMConfig(memory=1024 * GiB, prealloc=True, reserve=False))
    with pytest.raises(ThinvmError, match="too small"):
        check_memory_fits(VMConfig(memory=16 * MiB))
    # Overcommit is allowed when memory is not reserved.
    check_memory_fits(VMConfig(memory=1024 * GiB, reserve=False))


def test_unknown_build_and_accel() -> None:
    with pytest.raises(ThinvmError, match="unknown QEMU build 'fast'"):
        builds.find_build("fast")
    with pytest.raises(ThinvmError, match="unknown accelerator"):
        accel.resolve("hvf", QemuBuild("stock", Path("/q"), "", "", ()))


def test_config_round_trips_through_json() -> None:
    config = VMConfig(name="x", memory=3 * GiB, balloon=BalloonOptions(deflate_on_oom=True))
    assert VMConfig.from_json(config.to_json()) == config
    config = VMConfig(name="y", virtio_mem=1 * GiB, virtio_mem_plugged=2 * MiB)
    assert VMConfig.from_json(config.to_json()) == config


def test_probe_firmware_layout() -> None:
    image = accel._probe_firmware()
    assert len(image) == 64 * 1024
    assert image[-16] == 0xEA  # far jump at the reset vector
    assert image[:2] == bytes([0x66, 0xB9])


def test_migration_result_from_query() -> None:
    info = {
        "status": "completed",
        "total-time": 1234,
        "downtime": 12,
        "setup-time": 3,
        "ram": {"transferred": 5 * MiB, "normal": 1000, "duplicate": 9000, "dirty-sync-count": 2},
    }
    result = MigrationResult.from_query(info, 1.3)
    assert (result.total_time_ms, result.normal_pages, result.zero_pages) == (1234, 1000, 9000)
    assert result.transferred == 5 * MiB


def test_cli_reports_errors_without_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["up", "--name", "unit-x", "--build", "nope"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("thinvm: error: unknown QEMU build 'nope'")
    assert "Traceback" not in err
    assert main(["balloon", "no-such-vm", "1G"]) == 1
    assert "no VM named 'no-such-vm'" in capsys.readouterr().err


def test_a_socket_path_too_long_for_unix_is_refused_before_qemu_starts(tmp_path: Path) -> None:
    vm = VM(VMConfig(name="long"), rundir=tmp_path / ("d" * 120))
    with pytest.raises(ThinvmError, match="a UNIX socket takes at most 107: set THINVM_RUN"):
        vm.start()
    assert vm.process is None and not vm.rundir.exists()


def test_a_packaged_build_is_found_without_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """thinvm-qemu's /usr/lib/thinvm-qemu/build.json stands in for the cache."""
    monkeypatch.setenv("THINVM_CACHE", str(tmp_path / "cache"))
    binary = tmp_path / "qemu-system-x86_64"
    binary.write_text("")
    stamp = tmp_path / "build.json"
    stamp.write_text(
        json.dumps(
            {
                "flavour": "patched",
                "debian_version": "1:10.0.13+ds-0+deb13u1",
                "patch_hash": "e917952c7f93",
                "patches": ["0001-x.patch"],
                "binary": str(binary),
            }
        )
    )
    build = builds.find_build("patched", packaged={"patched": stamp})
    assert build.binary == binary
    assert build.patch_hash == "e917952c7f93"
    with pytest.raises(ThinvmError, match="install the thinvm-qemu package"):
        builds.find_build("patched", packaged={"patched": tmp_path / "none.json"})
    with pytest.raises(ThinvmError, match=r"'qemu/build\.sh stock'$"):
        builds.find_build("stock", packaged={"patched": stamp})


def test_an_installation_without_the_image_builders_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The thinvm package has no guest/: `thinvm up` explains, not a traceback."""
    monkeypatch.setattr(image, "REPO", tmp_path)
    image.ensure_image.cache_clear()
    try:
        with pytest.raises(ThinvmError, match="source repository"):
            image.ensure_image("6.1", "stock")
    finally:
        image.ensure_image.cache_clear()


def _disk_vm(config: VMConfig, incoming: bool = False) -> VM:
    vm = _vm(config, incoming)
    vm.image = GuestImage(Path("/k"), Path("/i"), {"cmdline": "root=/dev/vda rw console=ttyS0"})
    vm.disk = Path("/run/vm/disk.qcow2")
    return vm


def test_a_disk_guest_boots_from_its_overlay_as_the_first_virtio_disk() -> None:
    drive = ["-drive", "file=/d.img,if=virtio,format=raw"]
    config = VMConfig(image="disk", guest_driver="thinvm", extra_args=drive)
    args = _disk_vm(config).command_line()
    assert _option(args, "-append") == ["root=/dev/vda rw console=ttyS0 panic=-1"]
    assert _option(args, "-kernel") == ["/k"] and _option(args, "-initrd") == ["/i"]
    root, data = _option(args, "-drive")
    assert root == "file=/run/vm/disk.qcow2,if=virtio,format=qcow2,discard=unmap"
    assert data.startswith("file=/d.img")
    # The initramfs guest's command line is as it was: no disk, no root=.
    args = _vm(VMConfig()).command_line()
    assert _option(args, "-append") == ["console=ttyS0 no_timer_check panic=-1"]
    assert _option(args, "-drive") == []


def test_a_disk_guest_makes_its_overlay_in_its_run_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[tuple[Path, Path]] = []
    monkeypatch.setattr(
        "thinvm.vm.machine.create_overlay", lambda base, disk: made.append((base, disk))
    )
    vm = VM(VMConfig(image="disk"), rundir=tmp_path)
    assert vm._root_disk(Path("/base.qcow2")) == tmp_path / "disk.qcow2"
    assert made == [(Path("/base.qcow2"), tmp_path / "disk.qcow2")]


def test_a_migration_destination_opens_its_sources_disk(tmp_path: Path) -> None:
    src = _disk_vm(VMConfig(image="disk", name="ws"))
    config = src.incoming_config()
    assert config.disk == "/run/vm/disk.qcow2" and config.name == "ws"
    assert src.config.disk is None  # the source's own config is left alone
    assert _vm(VMConfig()).incoming_config() == VMConfig()  # nothing to share
    # A destination without its source's disk would boot another disk.
    with pytest.raises(ThinvmError, match="opens its source's disk"):
        VM(VMConfig(image="disk"), incoming=True, rundir=tmp_path)._root_disk(Path("/b"))
    overlay = tmp_path / "src.qcow2"
    with pytest.raises(ThinvmError, match="does not exist"):
        VM(VMConfig(image="disk", disk=str(overlay)), incoming=True)._root_disk(Path("/b"))
    overlay.touch()
    dst = VM(VMConfig(image="disk", disk=str(overlay)), incoming=True, rundir=tmp_path)
    assert dst._root_disk(Path("/b")) == overlay


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (VMConfig(image="iso"), "unknown guest image 'iso': choose initramfs or disk"),
        (VMConfig(image="disk", guest_driver="none"), "ours \\(thinvm\\) or the in-tree one"),
    ],
)
def test_bad_guest_images(config: VMConfig, message: str) -> None:
    with pytest.raises(ThinvmError, match=message):
        VM(config, rundir=Path("/tmp/thinvm-unit"))._guest_image()


def test_a_stock_disk_guest_loads_the_in_tree_driver_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    swapped: list[str] = []
    monkeypatch.setattr(
        "thinvm.vm.machine.guest_info", lambda agent: {"balloon_driver": "virtio_balloon"}
    )

    def booted(config: VMConfig, incoming: bool = False) -> VM:
        vm = _disk_vm(config, incoming)
        monkeypatch.setattr(vm.agent, "wait_ready", lambda timeout: 1.0)
        monkeypatch.setattr(vm.agent, "check", swapped.append)
        return vm

    vm = booted(VMConfig(image="disk", guest_driver="stock"))
    vm.wait_agent()
    vm.wait_agent()
    assert swapped == ['insmod "$(modinfo -F filename virtio_balloon)"']
    # It booted without ours: removing ours from a running 6.12 guest fails.
    assert "module_blacklist=thinvm_balloon" in _option(vm.command_line(), "-append")[0]
    ours = _disk_vm(VMConfig(image="disk", guest_driver="thinvm"))
    assert "module_blacklist" not in _option(ours.command_line(), "-append")[0]
    # Ours stays; a destination gets the guest with the driver it runs.
    booted(VMConfig(image="disk", guest_driver="thinvm")).wait_agent()
    booted(VMConfig(image="disk", guest_driver="stock"), incoming=True).wait_agent()
    assert len(swapped) == 1
