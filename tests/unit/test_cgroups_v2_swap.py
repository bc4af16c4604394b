"""thinvm.host.cgroups on the layouts the swap migration test meets: a
cgroup-v2 root whose children do not have the memory controller yet, a
hybrid host with memory on its unified hierarchy, and limits lifted again.

The hierarchies are fake (directories and files under tmp_path): the
kernel's own are what tests/integration/test_sparse_migration.py uses.
"""

from pathlib import Path

import pytest

from thinvm.host import HostError, cgroups


def fake_v2(root: Path, subtree: str = "") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (root / "cgroup.subtree_control").write_text(subtree)
    return root


def test_v2_create_enables_the_memory_controller_for_children(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without +memory in the parent's subtree_control a child has no
    memory.max: creating the cgroup must enable it first."""
    fake_v2(tmp_path)
    monkeypatch.setattr(cgroups, "CGROUP_FS", tmp_path)
    assert cgroups.create_cgroup("g") == str(tmp_path / "g")
    # A real subtree_control takes "+memory" and then lists "memory".
    assert (tmp_path / "cgroup.subtree_control").read_text() == "+memory"


def test_v2_create_leaves_an_enabled_controller_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_v2(tmp_path, "cpu memory\n")
    monkeypatch.setattr(cgroups, "CGROUP_FS", tmp_path)
    cgroups.create_cgroup("g")
    assert (tmp_path / "cgroup.subtree_control").read_text() == "cpu memory\n"


def test_v2_create_says_why_the_controller_cannot_be_enabled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel refuses +memory where the parent holds processes (EBUSY)."""
    fake_v2(tmp_path)
    (tmp_path / "cgroup.subtree_control").unlink()
    (tmp_path / "cgroup.subtree_control").mkdir()  # writing it fails, as EBUSY would
    monkeypatch.setattr(cgroups, "CGROUP_FS", tmp_path)
    with pytest.raises(HostError, match=r"cannot enable the memory controller .*subtree_control"):
        cgroups.create_cgroup("g")


def test_hybrid_host_with_memory_on_its_unified_hierarchy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """systemd's hybrid layout: v1 hierarchies plus cgroup2 at unified/.
    The memory controller is on whichever hierarchy lists it."""
    (tmp_path / "memory").mkdir()  # a v1 mount point without the controller
    unified = fake_v2(tmp_path / "unified")
    monkeypatch.setattr(cgroups, "CGROUP_FS", tmp_path)
    cg = cgroups.find_cgroup("g")
    assert cg == cgroups.Cgroup(unified / "g", unified / "g", v2=True)
    # Only hugetlb there (this machine's hybrid layout): no memory controller.
    (unified / "cgroup.controllers").write_text("hugetlb\n")
    assert cgroups.find_cgroup("g") is None


def test_lifting_a_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_v2(tmp_path, "memory\n")
    monkeypatch.setattr(cgroups, "CGROUP_FS", tmp_path)
    cgroups.create_cgroup("g")
    (tmp_path / "g" / "memory.max").write_text("max\n")
    cgroups.set_cgroup_limit("g", 1 << 30)
    assert (tmp_path / "g" / "memory.max").read_text() == str(1 << 30)
    cgroups.set_cgroup_limit("g", None)
    assert (tmp_path / "g" / "memory.max").read_text() == "max"

    v1 = tmp_path / "v1"
    (v1 / "memory" / "g").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (v1 / "memory" / "g" / "memory.limit_in_bytes").write_text("1073741824\n")
    monkeypatch.setattr(cgroups, "CGROUP_FS", v1)
    cgroups.set_cgroup_limit("g", None)
    assert (v1 / "memory" / "g" / "memory.limit_in_bytes").read_text() == "-1"


@pytest.mark.parametrize("v2", [False, True])
def test_processes_left_in_a_cgroup_go_back_to_ours(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, v2: bool
) -> None:
    """Before removing a cgroup whose processes outlive it (a test's VMs
    stop later), they move to this process's own cgroup, which
    /proc/self/cgroup names for the memory controller's hierarchy."""
    if v2:
        root = fake_v2(tmp_path, "memory\n")
        proc_self = "0::/ci/job\n"
    else:
        root = tmp_path / "memory"
        root.mkdir()
        (root / "memory.limit_in_bytes").write_text("9223372036854771712\n")
        proc_self = "5:cpu:/\n4:memory:/ci/job\n0::/\n"
    (tmp_path / "self-cgroup").write_text(proc_self)
    monkeypatch.setattr(cgroups, "CGROUP_FS", tmp_path)
    monkeypatch.setattr(cgroups, "PROC_SELF_CGROUP", tmp_path / "self-cgroup")
    own = root / "ci" / "job"
    own.mkdir(parents=True)
    cgroups.create_cgroup("g")
    (root / "g" / "cgroup.procs").write_text("101\n102\n")
    moved: list[str] = []
    monkeypatch.setattr(cgroups, "_write_pid", lambda procs, pid: moved.append(f"{procs} {pid}"))
    cgroups.release_processes("g")
    assert moved == [f"{own / 'cgroup.procs'} 101", f"{own / 'cgroup.procs'} 102"]
