"""`thinvm resize` with real guests: virtio-mem on 6.1 and 6.12, migration of
a shrunk guest, the balloon where there is no virtio-mem (docs/resize.md)."""

import pytest

from tests.conftest import VMFactory, qemu_pids, thinvm_ok
from thinvm.errors import ThinvmError
from thinvm.guest import workload
from thinvm.units import GiB, MiB, format_size
from thinvm.vm import migrate, resize
from thinvm.vm.machine import VM, VMConfig

pytestmark = pytest.mark.guest

BASE = 512 * MiB
VMEM = 1 * GiB
# MemTotal moves with what is plugged, give or take the guest's own
# bookkeeping of the memory it hotplugs.
SLACK = 16 * MiB


def vmem_guest(name: str, **kwargs: object) -> VMConfig:
    return VMConfig(name=name, memory=BASE, virtio_mem=VMEM, **kwargs)  # type: ignore[arg-type]


def mem_total(vm: VM) -> int:
    return workload.meminfo(vm.agent)["MemTotal"]


@pytest.mark.parametrize("kernel", ["6.1", "6.12"])
def test_virtio_mem_guest_grows_and_shrinks_and_the_host_gets_memory_back(
    make_vm: VMFactory, kernel: str
) -> None:
    vm = make_vm(vmem_guest(f"vmem-{kernel}", kernel=kernel))
    assert resize.virtio_mem_status(vm).plugged == 0  # boots with its base memory only
    base_total = mem_total(vm)

    grown = resize.resize(vm, BASE + VMEM)
    assert (grown.lever, grown.size) == ("virtio-mem", BASE + VMEM)
    assert abs(mem_total(vm) - (base_total + VMEM)) <= SLACK
    # Back the plugged memory on the host, so that unplugging must show.
    workload.touch_free_memory(vm.agent)
    rss_grown = vm.host_memory().rss

    shrunk = resize.resize(vm, BASE)
    assert shrunk.size == BASE and resize.virtio_mem_status(vm).plugged == 0
    assert abs(mem_total(vm) - base_total) <= SLACK
    dropped = rss_grown - vm.host_memory().rss
    assert dropped >= 0.75 * VMEM, f"host RSS dropped by only {format_size(dropped)}"

    half = resize.resize(vm, BASE + VMEM // 2)
    assert half.size == BASE + VMEM // 2
    assert abs(mem_total(vm) - (base_total + VMEM // 2)) <= SLACK
    workload.touch(vm.agent, VMEM // 2)  # the guest can use what came back


def test_a_guest_without_the_driver_is_named_as_the_cause(make_vm: VMFactory) -> None:
    vm = make_vm(vmem_guest("vmem-nodriver", append="thinvm.nomods=virtio_mem"))
    resize.request_virtio_mem(vm, 256 * MiB)
    with pytest.raises(ThinvmError, match="has no virtio-mem driver running"):
        resize.wait_plugged(vm, 256 * MiB, stall=3.0)


@pytest.mark.parametrize("build", ["stock", "patched"])
def test_shrunk_virtio_mem_guest_migrates_with_its_data(make_vm: VMFactory, build: str) -> None:
    config = vmem_guest(f"vmem-mig-{build}", build=build, virtio_mem_plugged=VMEM)
    src = make_vm(config)
    resize.wait_plugged(src, VMEM)
    # The pattern fills base and plugged memory alike; unplugging moves
    # whatever of it sat in the blocks that go.
    workload.pattern_write(src.agent, 256 * MiB, seed=31)
    shrunk = BASE + VMEM // 4
    resize.resize(src, shrunk)
    total = mem_total(src)

    dst = make_vm(config, incoming=True)
    # The patched build as thinvm migrates, with sparse-ram.
    result = migrate.migrate(src, dst, caps={"sparse-ram": True} if build == "patched" else {})
    # Unplugged memory is never read or sent, by either build.
    assert result.transferred < shrunk, f"sent {format_size(result.transferred)}"
    assert resize.virtio_mem_status(dst).plugged == VMEM // 4
    assert mem_total(dst) == total
    check = workload.pattern_verify(dst.agent, seed=31)
    assert check.ok and check.pages == 256 * MiB // 4096
    # The destination keeps both levers: it grows again.
    assert resize.resize(dst, BASE + VMEM).size == BASE + VMEM


def test_cli_resize_drives_virtio_mem_and_refuses_bad_sizes() -> None:
    name = "cli-vmem"
    try:
        up = thinvm_ok(
            "up", "--name", name, "--memory", "512M", "--virtio-mem", "512M",
            "--virtio-mem-plugged", "128M",
        )  # fmt: skip
        assert "512.00 MiB + up to 512.00 MiB by virtio-mem" in up.stdout
        assert "128.00 MiB plugged after" in up.stdout  # up waited for the guest
        out = thinvm_ok("resize", name, "769M")  # rounded down to a whole 2 MiB block
        assert "virtio-mem blocks: resizing to 768.00 MiB" in out.stderr
        assert "768.00 MiB by virtio-mem" in out.stdout
        status = thinvm_ok("status", name).stdout
        assert "virtio-mem 256.00 MiB of 512.00 MiB plugged" in status
        # Like 'thinvm balloon': a balance controller leaves it there until 'auto'.
        assert f"held by an operator; 'thinvm resize {name} auto' releases it" in status
        assert "left to the balance controller" in thinvm_ok("resize", name, "auto").stdout
        assert "held" not in thinvm_ok("status", name).stdout
        for size, message in [
            ("256M", "below its base memory 512.00 MiB"),
            ("2G", "above its maximum 1.00 GiB"),
            ("lots", "cannot parse size"),
        ]:
            proc = thinvm_ok("resize", name, size, check=False)
            assert proc.returncode == 1 and message in proc.stderr, proc.stderr
    finally:
        thinvm_ok("down", name, check=False)
    assert qemu_pids(name) == set()


def test_cli_resize_uses_the_balloon_without_virtio_mem() -> None:
    name = "cli-balloon"
    try:
        thinvm_ok("up", "--name", name, "--memory", "768M")
        assert "512.00 MiB by balloon" in thinvm_ok("resize", name, "512M").stdout
        # Like 'thinvm balloon': the controller leaves it at that size.
        status = thinvm_ok("status", name).stdout
        assert f"held at 512.00 MiB; 'thinvm balloon {name} auto'" in status
        proc = thinvm_ok("resize", name, "1G", check=False)
        assert proc.returncode == 1 and "its balloon can leave it between" in proc.stderr
    finally:
        thinvm_ok("down", name, check=False)
    assert qemu_pids(name) == set()
