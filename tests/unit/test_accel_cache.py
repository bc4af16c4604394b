"""The accelerator probe's cache: one verdict per QEMU binary, kept until
that binary changes."""

import os
from pathlib import Path

import pytest

from thinvm.qemu import accel
from thinvm.qemu.builds import QemuBuild


@pytest.fixture
def probes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Each probe is recorded (by binary) instead of run."""
    seen: list[str] = []

    def fake_probe(build: QemuBuild) -> dict[str, object]:
        seen.append(build.flavour)
        return {"tcg_seconds": 0.2, "kvm_seconds": None, "choice": "tcg"}

    monkeypatch.setattr(accel, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(accel, "probe", fake_probe)
    return seen


def build(tmp_path: Path, flavour: str) -> QemuBuild:
    binary = tmp_path / flavour / "qemu-system-x86_64"
    binary.parent.mkdir(exist_ok=True)
    binary.touch()
    return QemuBuild(flavour, binary, "1:10.0", "", ())


def test_alternating_builds_are_probed_once_each(tmp_path: Path, probes: list[str]) -> None:
    stock, patched = build(tmp_path, "stock"), build(tmp_path, "patched")
    for b in (stock, patched, stock, patched, stock):
        assert accel.probe_cached(b)["choice"] == "tcg"
    assert probes == ["stock", "patched"]


def test_a_rebuilt_binary_is_probed_again(tmp_path: Path, probes: list[str]) -> None:
    stock = build(tmp_path, "stock")
    accel.probe_cached(stock)
    stat = stock.binary.stat()
    os.utime(stock.binary, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    accel.probe_cached(stock)
    accel.probe_cached(stock)
    assert probes == ["stock", "stock"]


def test_an_unreadable_cache_is_probed_afresh(tmp_path: Path, probes: list[str]) -> None:
    (tmp_path / "accel.json").write_text('{"key": "old single-verdict form"')
    accel.probe_cached(build(tmp_path, "stock"))
    assert probes == ["stock"]
    assert not list(tmp_path.glob("accel.json.*")), "no temporary file left"
