"""Kept boots (thinvm.testing.keptboot): which guests are kept, what makes
two guests or two libvirt domains the same, how entries are made and go;
and the test profile they come with (thinvm.testing.profile)."""

import os
import time
from dataclasses import replace
from pathlib import Path

import pytest

from thinvm.errors import ThinvmError
from thinvm.fleet.domain import DomainSpec, domain_xml
from thinvm.guest.image import GuestImage
from thinvm.qemu.builds import QemuBuild
from thinvm.testing import keptboot
from thinvm.testing.keptboot import KeptBootVM
from thinvm.testing.profile import ENV, GuestProfile, current
from thinvm.units import MiB
from thinvm.vm.machine import VM, BalloonOptions, VMConfig


@pytest.fixture
def files(tmp_path: Path) -> list[Path]:
    """The QEMU binary, kernel and initrd a guest boots."""
    paths = [tmp_path / "qemu", tmp_path / "vmlinux", tmp_path / "initrd"]
    for path in paths:
        path.write_bytes(b"x")
    return paths


def key(files: list[Path], args: list[str], name: str = "a", run: str = "/run/a") -> str:
    line = ["qemu", "-name", f"thinvm-{name}", "-serial", f"file:{run}/serial.log", *args]
    return keptboot.guest_key(line, name, Path(run), files)


def test_name_and_run_directory_do_not_make_another_guest(files: list[Path]) -> None:
    assert key(files, ["-m", "1024M"]) == key(files, ["-m", "1024M"], "b", "/tmp/x-b")


def test_any_other_argument_does(files: list[Path]) -> None:
    assert key(files, ["-m", "1024M"]) != key(files, ["-m", "2048M"])
    assert key(files, ["-append", "a"]) != key(files, ["-append", "a b"])


def test_a_rebuilt_kernel_makes_another_guest(files: list[Path]) -> None:
    before = key(files, [])
    files[1].write_bytes(b"y")
    os.utime(files[1], ns=(0, 10**9))
    assert key(files, []) != before


def test_only_guests_whose_state_is_ram_and_devices_are_kept() -> None:
    plain = VMConfig(backend="memfd")
    assert keptboot.kept_kind(plain, "tcg")
    assert keptboot.kept_kind(replace(plain, balloon=BalloonOptions(free_page_hint=True)), "tcg")
    assert not keptboot.kept_kind(plain, "kvm")
    for other in (
        replace(plain, image="disk"),
        replace(plain, backend="file:/dev/hugepages/x"),
        replace(plain, prealloc=True),
        replace(plain, pool="/var/lib/thinvm/pool"),
        replace(plain, extra_args=["-drive", "file=x"]),
    ):
        assert not keptboot.kept_kind(other, "tcg"), other


def test_entries_not_loaded_for_a_week_go(tmp_path: Path) -> None:
    old, new = tmp_path / "old", tmp_path / "new"
    for entry in (old, new):
        entry.mkdir()
        (entry / keptboot.STATE_FILE).write_bytes(b"")
    (tmp_path / "old.lock").touch()
    week_ago = time.time() - keptboot.STALE_SECONDS - 60
    os.utime(old, (week_ago, week_ago))
    assert keptboot.remove_stale(tmp_path) == [old]
    assert not old.exists() and not (tmp_path / "old.lock").exists()
    assert keptboot.is_complete(new)


def test_an_entry_is_made_once_and_only_when_complete(tmp_path: Path) -> None:
    made: list[Path] = []

    def make(directory: Path) -> None:
        made.append(directory)
        (directory / keptboot.STATE_FILE).write_bytes(b"state")

    entry = keptboot.ensure_entry(tmp_path, "k", make)
    assert entry == tmp_path / "k" and keptboot.is_complete(entry)
    assert keptboot.ensure_entry(tmp_path, "k", make) == entry
    assert len(made) == 1 and not made[0].exists()  # made in a directory renamed into place

    def fail(directory: Path) -> None:
        (directory / keptboot.STATE_FILE).write_bytes(b"half")
        raise TimeoutError("the template never answered")

    with pytest.raises(TimeoutError):
        keptboot.ensure_entry(tmp_path, "other", fail)
    assert not (tmp_path / "other").exists() and not (tmp_path / "other.partial").exists()


@pytest.fixture
def domain_files(tmp_path: Path) -> Path:
    """An emulator, kernel, initrd and base disk under `tmp_path`/domain_files."""
    d = tmp_path / "domain_files"
    d.mkdir()
    for name in ("qemu", "vmlinux", "initrd", "base.qcow2"):
        (d / name).write_bytes(b"x")
    return d


def xml(domain_files: Path, shared: str = "/var/lib/thinvm/c1/shared", memory: int = 512) -> str:
    spec = DomainSpec(
        name="g",
        emulator=domain_files / "qemu",
        kernel=domain_files / "vmlinux",
        initrd=domain_files / "initrd",
        disk=Path(shared) / "g.qcow2",
        console_log=Path(shared) / "g.console.log",
        cmdline="root=/dev/vda",
        memory=memory * MiB,
    )
    return domain_xml(spec)


def with_uuid(text: str, uuid: str) -> str:
    return text.replace("<name>g</name>", f"<name>g</name><uuid>{uuid}</uuid>", 1)


def test_uuid_and_shared_directory_do_not_make_another_domain(domain_files: Path) -> None:
    base = domain_files / "base.qcow2"
    first = keptboot.domain_key(with_uuid(xml(domain_files), "1" * 32), base)
    again = keptboot.domain_key(
        with_uuid(xml(domain_files, "/var/lib/thinvm/c2/shared"), "2" * 32), base
    )
    assert first == again


def test_any_other_element_does(domain_files: Path) -> None:
    base = domain_files / "base.qcow2"
    bigger = keptboot.domain_key(xml(domain_files, memory=1024), base)
    assert keptboot.domain_key(xml(domain_files), base) != bigger


def test_a_rebuilt_emulator_or_base_disk_makes_another_domain(domain_files: Path) -> None:
    base = domain_files / "base.qcow2"
    before = keptboot.domain_key(xml(domain_files), base)
    for name in ("qemu", "base.qcow2"):
        os.utime(domain_files / name, ns=(0, 10**9))
        after = keptboot.domain_key(xml(domain_files), base)
        assert after != before, name
        before = after


def test_a_host_with_its_own_root_has_its_own_emulator(domain_files: Path, tmp_path: Path) -> None:
    """A package-installed host's emulator path is inside its root."""
    root = tmp_path / "hostroot"
    inside = root / str(domain_files / "qemu").lstrip("/")
    inside.parent.mkdir(parents=True)
    inside.write_bytes(b"another build")
    base = domain_files / "base.qcow2"
    assert keptboot.domain_key(xml(domain_files), base, root) != keptboot.domain_key(
        xml(domain_files), base
    )


def test_a_domain_without_a_file_disk_is_not_kept(domain_files: Path) -> None:
    text = xml(domain_files).replace("<source file=", "<source dev=")
    with pytest.raises(ThinvmError, match="file disk"):
        keptboot.domain_key(text, domain_files / "base.qcow2")


# -- the test profile ----------------------------------------------------
SUITE = GuestProfile(pvh=True, append="init_on_alloc=0", kept_boots=Path("/k"))


def _resolved(vm: VM) -> VM:
    vm.build = QemuBuild("stock", Path("/q"), "1:10.0", "abc", ())
    vm.image = GuestImage(Path("/k/vmlinuz"), Path("/i"), {})
    vm.accel = "tcg"
    return vm


def _append(vm: VM) -> str:
    args = vm.command_line()
    return args[args.index("-append") + 1]


def test_the_profile_travels_whole_in_one_variable() -> None:
    assert GuestProfile.from_env(SUITE.to_env()) == SUITE
    assert GuestProfile.from_env('{"pvh": true}') == GuestProfile(pvh=True)
    for bad in ("1", '{"pvh": "yes"}', '{"kept": "/k"}', "{"):
        with pytest.raises(ThinvmError, match=ENV):
            GuestProfile.from_env(bad)


def test_the_profiles_arguments_come_before_the_configs_own() -> None:
    vm = _resolved(KeptBootVM(VMConfig(append="init_on_alloc=1"), profile=SUITE, rundir=Path("/r")))
    # The kernel takes the last of a repeated argument: the config's.
    assert _append(vm) == "console=ttyS0 no_timer_check panic=-1 init_on_alloc=0 init_on_alloc=1"


def test_a_users_vm_boots_as_users_do_under_a_test_profile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """thinvm's VM knows no test profile: only the suite's class reads it."""
    monkeypatch.setenv(ENV, SUITE.to_env())
    vm = _resolved(VM(VMConfig(), rundir=Path("/r")))
    assert _append(vm) == "console=ttyS0 no_timer_check panic=-1"
    args = vm.command_line()
    assert args[args.index("-kernel") + 1] == "/k/vmlinuz"
    suites = _resolved(KeptBootVM(VMConfig(), rundir=Path("/r")))
    assert suites.profile == current() == SUITE
    assert "init_on_alloc=0" in _append(suites)


def test_thinvm_up_starts_the_suites_vms_only_under_a_test_profile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from thinvm.vm import registry

    monkeypatch.delenv(ENV, raising=False)
    assert registry.vm_class() is VM
    monkeypatch.setenv(ENV, GuestProfile().to_env())
    assert registry.vm_class() is KeptBootVM
