"""fleet-migrate's variants: the fast hosts as before, the packaged ones
(issue 21): which hosts, which QEMU, which domain each variant gets."""

from dataclasses import replace
from pathlib import Path

import pytest

from thinvm.bench import scenarios as bench_scenarios
from thinvm.bench.scenarios import fleet, fleet_ws, hostcpus
from thinvm.bench.scenarios.common import STOCK_CANDIDATES, THINVM_CANDIDATES, Candidate
from thinvm.bench.types import BenchOptions, Metrics, Scenario
from thinvm.errors import ThinvmError
from thinvm.fleet import cluster, emulator, guest, hostcgroups, migrate
from thinvm.guest import image as guest_image
from thinvm.guest.agent import AGENT_PORT
from thinvm.units import MiB
from thinvm.vm.stack import STOCK_BEST, THINVM, Stack

IMAGE = guest_image.DiskImage(Path("/img"), "6.1", "6.1.0-test", "root=/dev/vda rw")
SHARED = Path("/shared")
SIZE = 1024 * MiB


def test_packaged_routes_never_reuse_a_host() -> None:
    assert fleet.packaged_route("patched", "patched") == ("h1", "h2")
    assert fleet.packaged_route("patched", "stock") == ("h1", "h4")
    assert fleet.packaged_route("stock", "stock") == ("h3", "h4")
    kind = fleet.CLUSTERS["packaged"]
    # The hosts left on Debian's QEMU are the stock pair, and the cluster has them all.
    assert kind.stock == fleet.PACKAGED_HOSTS["stock"]
    assert kind.hosts == sum(len(pair) for pair in fleet.PACKAGED_HOSTS.values())


@pytest.mark.parametrize("candidate", STOCK_CANDIDATES, ids=lambda c: c.name)
def test_stock_candidates_run_on_debians_qemu(candidate: Candidate) -> None:
    run = fleet.candidate_run(candidate)
    assert run.route == ("h3", "h4") and not run.portable
    want = candidate.params.get("multifd-channels", fleet.CHANNELS)
    assert run.parallel == (want if candidate.stack.multifd else 0)
    spec = run.domain(IMAGE, SIZE, SHARED)
    assert spec.emulator == emulator.PACKAGED_STOCK
    assert not spec.ranges and spec.sparse_ram is None
    assert spec.free_page_reporting == candidate.stack.reporting
    assert spec.free_page_hint == candidate.stack.hint


@pytest.mark.parametrize("candidate", THINVM_CANDIDATES, ids=lambda c: c.name)
def test_thinvm_candidates_run_on_thinvm_qemu(candidate: Candidate) -> None:
    run = fleet.candidate_run(candidate)
    assert run.route == ("h1", "h2") and run.parallel == fleet.CHANNELS
    spec = run.domain(IMAGE, SIZE, SHARED)
    assert spec.emulator == emulator.PACKAGED_THINVM
    assert spec.ranges and spec.sparse_ram == emulator.sparse_ram_capability()
    assert spec.free_page_reporting and not spec.portable


def test_thinvm_to_stock_is_a_portable_guest_of_thinvm_qemu() -> None:
    run = fleet.THINVM_TO_STOCK
    assert run.route == ("h1", "h4") and run.portable and run.parallel == fleet.CHANNELS
    assert run.stack.driver == "thinvm"  # our driver stays; no ranges offered
    spec = run.domain(IMAGE, SIZE, SHARED)
    assert spec.emulator == emulator.PACKAGED_THINVM
    assert spec.portable and not spec.ranges and spec.sparse_ram is None
    assert spec.free_page_reporting
    spec.validate()


@pytest.mark.parametrize(
    "stack,old", [(STOCK_BEST, guest.GuestSpec(fleet.GUEST, SIZE, build="stock", thinvm=False)),
                  (THINVM, guest.GuestSpec(fleet.GUEST, SIZE, build="patched", thinvm=True))],
)  # fmt: skip
def test_fast_hosts_keep_the_domains_they_had(stack: Stack, old: guest.GuestSpec) -> None:
    """What _run_one defined before FleetRun, for stock-best and thinvm."""
    run = fleet.FleetRun(stack)
    assert run.route == ("h1", "h2") and run.parallel == fleet.CHANNELS
    assert run.domain(IMAGE, SIZE, SHARED) == guest.spec_for(old, IMAGE, SHARED)
    assert fleet.FleetRun(replace(stack, multifd=False)).parallel == 0


def _scenario() -> Scenario:
    return bench_scenarios.SCENARIOS["fleet-migrate"].build(BenchOptions())


def test_both_hosts_rows_are_chosen_among_their_candidates() -> None:
    scenario = _scenario()
    assert scenario.baseline_name == "stock-best"  # the fast hosts' row, as before
    best = {b.name: b.candidates for b in scenario.best}
    assert best == {
        "stock-best": tuple(c.name for c in STOCK_CANDIDATES),
        "thinvm": tuple(c.name for c in THINVM_CANDIDATES),
        "pkg-stock-best": tuple(f"pkg-{c.name}" for c in STOCK_CANDIDATES),
        "pkg-thinvm": tuple(f"pkg-{c.name}" for c in THINVM_CANDIDATES),
    }
    refs = scenario.references
    assert refs["pkg-thinvm"] == refs["pkg-thinvm-to-stock"] == "pkg-stock-best"
    assert "pkg-stock-best" not in refs  # against the baseline
    assert {(t.variant, t.reference) for t in scenario.targets} == {
        ("thinvm", "stock-best"), ("pkg-thinvm", "pkg-stock-best")}  # fmt: skip


def test_selecting_the_fast_rows_leaves_out_the_packaged_ones() -> None:
    scenario = _scenario()
    scenario.select(["stock-best", "thinvm"])
    assert {b.name for b in scenario.best} == {"stock-best", "thinvm"}
    assert len(scenario.variants) == len(STOCK_CANDIDATES) + len(THINVM_CANDIDATES)
    assert not [v for v in scenario.variants if v.name.startswith("pkg-")]
    scenario = _scenario()
    scenario.select(["pkg-stock-best", "pkg-thinvm", "pkg-thinvm-to-stock"])
    assert len(scenario.variants) == len(STOCK_CANDIDATES) + len(THINVM_CANDIDATES) + 1
    assert all(v.name.startswith("pkg-") for v in scenario.variants)


def test_fast_candidates_keep_their_channels_on_the_fast_hosts() -> None:
    for candidate in STOCK_CANDIDATES + THINVM_CANDIDATES:
        run = fleet.fast_run(candidate)
        assert run.route == ("h1", "h2") and not run.kind.packaged
        want = candidate.params.get("multifd-channels", fleet.CHANNELS)
        assert run.parallel == (want if candidate.stack.multifd else 0), candidate.name


def test_what_tls_costs_is_taken_against_the_same_configuration() -> None:
    refs = _scenario().references
    assert refs["stock-best-plain"] == "stock-mfd2"
    assert refs["thinvm-plain"] == "thinvm-no-hint"
    by_name = {c.name: c for c in STOCK_CANDIDATES + THINVM_CANDIDATES}
    assert fleet.FleetRun(STOCK_BEST) == fleet.fast_run(by_name["stock-mfd2"])
    assert fleet.FleetRun(THINVM) == fleet.fast_run(by_name["thinvm-no-hint"])


@pytest.mark.parametrize("name", sorted(fleet.CLUSTERS))
def test_agent_sockets_of_bench_clusters_fit_a_unix_socket_path(name: str) -> None:
    """sun_path holds 107 bytes: a longer path cannot be connected to, and
    the guest looks silent (the packaged cluster's first root was too long)."""
    kind = fleet.CLUSTERS[name]
    (host,) = cluster.plan_hosts(1, kind.root, packaged=kind.packaged)
    channel = f"/run/libvirt/qemu/channel/9999-{fleet.GUEST}/{AGENT_PORT}"
    # libvirt 11.3 names the channel directory by domain id and name.
    assert len(bytes(host.outside(channel))) <= 107


# -- fleet-working-set (thinvm.bench.scenarios.fleet_ws) ----------------------


def test_fleet_working_set_sides_run_their_qemu_from_plain_xml() -> None:
    """Every guest is plain XML (no sparse-ram capability): the stock rows on
    Debian's QEMU (h3 -> h4), thinvm on thinvm-qemu (h1 -> h2), three
    guests of their own names."""
    for name, side in fleet_ws.SIDES.items():
        run = side.run("bench-ws-2")
        spec = run.domain(IMAGE, 4096 * MiB, SHARED)
        assert spec.name == "bench-ws-2" and spec.disk == SHARED / "bench-ws-2.qcow2"
        assert spec.sparse_ram is None, name
        assert run.route == (("h1", "h2") if name == "thinvm" else ("h3", "h4"))
    assert fleet_ws.SIDES["thinvm"].controller and fleet_ws.SIDES["thinvm"].reclaimer
    assert fleet_ws.SIDES["stock-reclaimer"].reclaimer
    assert not fleet_ws.SIDES["stock-best"].reclaimer


def test_fleet_working_set_workload_is_checked() -> None:
    params = dict(fleet_ws.SPEC.params)
    work = fleet_ws.make_workload(params, 4096 * MiB)
    assert (work.data, work.hot, work.passes) == (2048 * MiB, 256 * MiB, 5)
    with pytest.raises(ThinvmError, match="cannot hold"):
        fleet_ws.make_workload({**params, "data": "3900M"}, 4096 * MiB)
    with pytest.raises(ThinvmError, match="hot within data"):
        fleet_ws.make_workload({**params, "hot": "3G"}, 4096 * MiB)
    with pytest.raises(ThinvmError, match="hot_every"):
        fleet_ws.make_workload({**params, "hot_every": "-1"}, 4096 * MiB)
    assert fleet_ws.make_workload({**params, "hot_every": "0"}, 4096 * MiB).hot_every == 0


def test_cpu_lists_parse_as_the_kernel_prints_them() -> None:
    assert hostcpus.cpu_list("0-2,4\n") == [0, 1, 2, 4]
    assert hostcpus.cpu_list("1") == [1]


def test_a_host_without_cgroups_is_given_a_cpuset_holding_its_processes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fast cluster host runs libvirtd without cgroups; pinning it must
    create its cpuset and move its namespace's processes there (the
    FileNotFoundError every fast fleet-migrate row hit before)."""
    root = tmp_path / "cgroup"
    (root / "cpuset").mkdir(parents=True)
    (root / "cpuset/cpuset.cpus").write_text("0-1\n")
    (root / "cpuset/cpuset.mems").write_text("0\n")
    monkeypatch.setattr(hostcgroups, "CGROUP_ROOT", root)
    monkeypatch.setattr(cluster, "netns_pids", lambda ns: [101, 102] if ns == "tv-h1" else [])

    def create(netns: str, names: list[str]) -> None:  # as cgroupfs's mkdir does
        for path in hostcgroups.host_cgroups(netns, names).values():
            path.mkdir(parents=True)
            for knob in hostcgroups.CPUSET_INHERITED:
                (path / knob).write_text((root / "cpuset" / knob).read_text())

    monkeypatch.setattr(hostcgroups, "create", create)
    h = cluster.Host("h1", 1, "10.0.0.1", "uuid", "patched", str(tmp_path / "h1"), "tv-h1")
    own = root / "cpuset" / hostcgroups.PARENT / "tv-h1"
    hostcpus.unpin([h])  # never pinned (--unpinned): given no cgroup
    assert not own.exists()
    written: list[str] = []
    real_write = Path.write_text

    def record(path: Path, text: str, *args: object, **kwargs: object) -> int:
        if path.name == "cgroup.procs":
            written.append(text.strip())
            return len(text)
        return real_write(path, text)

    monkeypatch.setattr(Path, "write_text", record)
    hostcpus.set_host_cpus(h, "1")
    assert written == ["101", "102"]
    assert (own / "cpuset.cpus").read_text() == "1"
    assert (own / "cpuset.mems").read_text().strip() == "0"
    hostcpus.unpin([h])  # the cgroup exists now: widened, nobody is moved again
    assert written == ["101", "102"]
    assert (own / "cpuset.cpus").read_text() == "0-1"


def test_a_leg_sums_migrations_and_keeps_the_worst_downtime() -> None:
    """Sums over the guests, the source CPU's parts by thread kind too;
    the worst guest's downtime is kept, not summed."""
    leg = fleet_ws.Leg("parallel_")
    for seconds, downtime, vcpu_s in ((1.5, "40 ms", 0.125), (2.0, "90 ms", 0.25)):
        job = {"Data processed": "100.000 MiB", "Total downtime": downtime}
        result = migrate.MigrationResult(seconds, "h1", "h2", job, {"sparse-skipped": 10}, 1)
        cpu: Metrics = {"src_cpu_s": 0.5, "src_vcpu_cpu_s": vcpu_s}
        cpu["src_migration_cpu_s"] = 0.5 - vcpu_s
        leg.add(result, cpu, 0.25)
    assert leg.metrics == {
        "parallel_migration_ms": 3500.0, "parallel_transferred_bytes": 200 * MiB,
        "parallel_downtime_ms": 90.0, "parallel_src_cpu_s": 1.0,
        "parallel_src_migration_cpu_s": 0.625, "parallel_src_vcpu_cpu_s": 0.375,
        "parallel_src_multifd_cpu_s": 0.0, "parallel_src_other_cpu_s": 0.0,
        "parallel_sparse_skipped_pages": 20, "parallel_hot_reread_ms": 500.0,
    }  # fmt: skip
