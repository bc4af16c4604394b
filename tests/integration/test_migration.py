"""Live migration between two real QEMU processes over loopback TCP."""

import pytest

from tests.conftest import VMFactory, qemu_pids
from thinvm.errors import ThinvmError
from thinvm.guest import workload
from thinvm.units import GiB, MiB
from thinvm.vm import migrate
from thinvm.vm.machine import BalloonOptions, VMConfig

pytestmark = pytest.mark.guest

SEED = 4242


def test_migration_with_hinting_keeps_memory_and_detects_corruption(make_vm: VMFactory) -> None:
    config = VMConfig(name="mig", memory=1 * GiB, balloon=BalloonOptions(free_page_hint=True))
    src = make_vm(config)
    workload.touch_free_memory(src.agent, leave=256 * MiB)
    workload.pattern_write(src.agent, 128 * MiB, SEED)
    dst = make_vm(config, incoming=True)
    result = migrate.migrate(src, dst)
    assert result.status == "completed"
    assert result.transferred >= 128 * MiB  # the pattern itself had to travel
    src.shutdown()
    check = workload.pattern_verify(dst.agent, SEED)
    assert check.ok and check.pages == 128 * MiB // 4096
    # The check must be able to fail: one flipped byte is caught.
    workload.pattern_corrupt(dst.agent, page=777)
    check = workload.pattern_verify(dst.agent, SEED)
    assert (check.bad, check.first_bad) == (1, 777)


def test_migration_to_a_dead_port_fails_cleanly(make_vm: VMFactory) -> None:
    src = make_vm(VMConfig(name="dead", memory=512 * MiB))
    before = qemu_pids()
    with pytest.raises(ThinvmError, match="failed"):
        migrate.migrate_to_uri(src, f"tcp:127.0.0.1:{migrate.free_port()}", timeout=30)
    assert src.qmp("query-status")["status"] == "running"
    assert src.agent.check("echo alive").stdout == "alive\n"
    assert qemu_pids() == before
