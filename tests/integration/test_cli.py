"""The thinvm command end to end: up, status, balloon, exec, migrate, down."""

import json

import pytest

from tests.conftest import qemu_pids
from tests.conftest import thinvm_ok as thinvm
from thinvm.paths import run_dir

pytestmark = pytest.mark.guest


def test_version_reports_both_builds() -> None:
    out = thinvm("version").stdout
    lines = out.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("stock") and "thinvm-stock" in out
    assert lines[1].startswith("patched") and "thinvm-patched" in out
    assert "patch-hash" in lines[0] and "patch-hash" in lines[1]


def test_accel_reports_the_probe_verdict() -> None:
    assert thinvm("accel").stdout.strip() in ("tcg", "kvm")
    probe = json.loads(thinvm("accel", "--build", "stock", "--json").stdout)
    assert probe["choice"] in ("tcg", "kvm") and probe["tcg_seconds"] > 0
    # KVM is chosen only when it beat TCG in the probe.
    if probe["choice"] == "kvm":
        assert probe["kvm_seconds"] is not None and probe["kvm_seconds"] < probe["tcg_seconds"]


def test_bad_input_gets_clear_errors_and_no_process() -> None:
    before = qemu_pids("bad")
    for args, message in [
        (["up", "--name", "bad", "--build", "turbo"], "unknown QEMU build 'turbo'"),
        (["up", "--name", "bad", "--memory", "100T"], "cannot fit"),
        (["up", "--name", "bad", "--memory", "lots"], "cannot parse size"),
        (["up", "--name", "bad", "--kernel", "2.6"], "unknown guest kernel"),
        (["status", "ghost"], "no VM named 'ghost'"),
    ]:
        proc = thinvm(*args, check=False)
        assert proc.returncode == 1, args
        assert message in proc.stderr, (args, proc.stderr)
        assert "Traceback" not in proc.stderr
    assert qemu_pids("bad") == before == set()


def test_up_balloon_migrate_down() -> None:
    name = "clitest"
    try:
        thinvm("up", "--name", name, "--memory", "1G", "--free-page-hint")
        assert "running" in thinvm("status", name).stdout
        assert thinvm("exec", name, "echo", "hi").stdout == "hi\n"
        out = thinvm("balloon", name, "768M").stdout
        assert "actual 768.00 MiB" in out
        pids_before = qemu_pids(name)
        out = thinvm("migrate", name).stdout
        assert "migrated in" in out
        pids_after = qemu_pids(name)
        assert len(pids_after) == 1 and pids_after != pids_before  # a new QEMU took over
        assert thinvm("exec", name, "echo", "still here").stdout == "still here\n"
        dead = thinvm("migrate", name, "--uri", "tcp:127.0.0.1:1", check=False)
        assert dead.returncode == 1 and "failed" in dead.stderr
        assert "running" in thinvm("status", name).stdout
    finally:
        thinvm("down", name, check=False)
    assert name not in thinvm("status").stdout
    assert qemu_pids(name) == set()


def test_down_stops_a_vm_whose_monitor_is_gone() -> None:
    """A VM whose QMP sockets vanished is still stopped by 'down', not orphaned."""
    name = "clidown"
    try:
        thinvm("up", "--name", name, "--memory", "512M")
        (pid,) = qemu_pids(name)
        for sock in (run_dir() / name).glob("qmp*.sock"):
            sock.unlink()
        out = thinvm("down", name)
        assert f"killed QEMU pid {pid}" in out.stderr
    finally:
        thinvm("down", name, check=False)
    assert qemu_pids(name) == set()
