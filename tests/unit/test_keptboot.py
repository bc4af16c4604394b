"""What makes two libvirt domains the same boot (thinvm.fleet.keptboot)."""

import os
from pathlib import Path

import pytest

from thinvm.errors import ThinvmError
from thinvm.fleet import keptboot
from thinvm.fleet.domain import DomainSpec, domain_xml
from thinvm.units import MiB


@pytest.fixture
def files(tmp_path: Path) -> Path:
    """An emulator, kernel, initrd and base disk under `tmp_path`/files."""
    d = tmp_path / "files"
    d.mkdir()
    for name in ("qemu", "vmlinux", "initrd", "base.qcow2"):
        (d / name).write_bytes(b"x")
    return d


def xml(files: Path, shared: str = "/var/lib/thinvm/c1/shared", memory: int = 512) -> str:
    spec = DomainSpec(
        name="g",
        emulator=files / "qemu",
        kernel=files / "vmlinux",
        initrd=files / "initrd",
        disk=Path(shared) / "g.qcow2",
        console_log=Path(shared) / "g.console.log",
        cmdline="root=/dev/vda",
        memory=memory * MiB,
    )
    return domain_xml(spec)


def with_uuid(text: str, uuid: str) -> str:
    return text.replace("<name>g</name>", f"<name>g</name><uuid>{uuid}</uuid>", 1)


def test_uuid_and_shared_directory_do_not_make_another_domain(files: Path) -> None:
    base = files / "base.qcow2"
    first = keptboot.domain_key(with_uuid(xml(files), "1" * 32), base)
    again = keptboot.domain_key(with_uuid(xml(files, "/var/lib/thinvm/c2/shared"), "2" * 32), base)
    assert first == again


def test_any_other_element_does(files: Path) -> None:
    base = files / "base.qcow2"
    bigger = keptboot.domain_key(xml(files, memory=1024), base)
    assert keptboot.domain_key(xml(files), base) != bigger


def test_a_rebuilt_emulator_or_base_disk_makes_another_domain(files: Path) -> None:
    base = files / "base.qcow2"
    before = keptboot.domain_key(xml(files), base)
    for name in ("qemu", "base.qcow2"):
        os.utime(files / name, ns=(0, 10**9))
        after = keptboot.domain_key(xml(files), base)
        assert after != before, name
        before = after


def test_a_host_with_its_own_root_has_its_own_emulator(files: Path, tmp_path: Path) -> None:
    """A package-installed host's emulator path is inside its root."""
    root = tmp_path / "hostroot"
    inside = root / str(files / "qemu").lstrip("/")
    inside.parent.mkdir(parents=True)
    inside.write_bytes(b"another build")
    base = files / "base.qcow2"
    assert keptboot.domain_key(xml(files), base, root) != keptboot.domain_key(xml(files), base)


def test_a_domain_without_a_file_disk_is_not_kept(files: Path) -> None:
    text = xml(files).replace("<source file=", "<source dev=")
    with pytest.raises(ThinvmError, match="file disk"):
        keptboot.domain_key(text, files / "base.qcow2")
