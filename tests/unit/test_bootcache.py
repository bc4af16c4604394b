"""Which guests bootcache keeps, and what makes two guests the same."""

import os
import time
from dataclasses import replace
from pathlib import Path

import pytest

from thinvm.vm import bootcache
from thinvm.vm.machine import BalloonOptions, VMConfig


@pytest.fixture
def files(tmp_path: Path) -> list[Path]:
    """The QEMU binary, kernel and initrd a guest boots."""
    paths = [tmp_path / "qemu", tmp_path / "vmlinux", tmp_path / "initrd"]
    for path in paths:
        path.write_bytes(b"x")
    return paths


def key(files: list[Path], args: list[str], name: str = "a", run: str = "/run/a") -> str:
    line = ["qemu", "-name", f"thinvm-{name}", "-serial", f"file:{run}/serial.log", *args]
    return bootcache.guest_key(line, name, Path(run), files)


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
    assert bootcache.kept_kind(plain, "tcg")
    assert bootcache.kept_kind(replace(plain, balloon=BalloonOptions(free_page_hint=True)), "tcg")
    assert not bootcache.kept_kind(plain, "kvm")
    for other in (
        replace(plain, image="disk"),
        replace(plain, backend="file:/dev/hugepages/x"),
        replace(plain, prealloc=True),
        replace(plain, pool="/var/lib/thinvm/pool"),
        replace(plain, extra_args=["-drive", "file=x"]),
    ):
        assert not bootcache.kept_kind(other, "tcg"), other


def test_entries_not_loaded_for_a_week_go(tmp_path: Path) -> None:
    old, new = tmp_path / "old", tmp_path / "new"
    for entry in (old, new):
        entry.mkdir()
        (entry / bootcache.STATE_FILE).write_bytes(b"")
    (tmp_path / "old.lock").touch()
    week_ago = time.time() - bootcache.STALE_SECONDS - 60
    os.utime(old, (week_ago, week_ago))
    assert bootcache.remove_stale(tmp_path) == [old]
    assert not old.exists() and not (tmp_path / "old.lock").exists()
    assert bootcache.is_complete(new)


def test_an_entry_is_made_once_and_only_when_complete(tmp_path: Path) -> None:
    made: list[Path] = []

    def make(directory: Path) -> None:
        made.append(directory)
        (directory / bootcache.STATE_FILE).write_bytes(b"state")

    entry = bootcache.ensure_entry(tmp_path, "k", make)
    assert entry == tmp_path / "k" and bootcache.is_complete(entry)
    assert bootcache.ensure_entry(tmp_path, "k", make) == entry
    assert len(made) == 1 and not made[0].exists()  # made in a directory renamed into place

    def fail(directory: Path) -> None:
        (directory / bootcache.STATE_FILE).write_bytes(b"half")
        raise TimeoutError("the template never answered")

    with pytest.raises(TimeoutError):
        bootcache.ensure_entry(tmp_path, "other", fail)
    assert not (tmp_path / "other").exists() and not (tmp_path / "other.partial").exists()
