"""Pure logic of thinvm.fleet: domain XML, host configuration, parsing."""

import json
import shlex
import shutil
import stat
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from thinvm.errors import ThinvmError
from thinvm.fleet import cluster, emulator, migrate, pki
from thinvm.fleet.domain import (
    BALLOON_ALIAS,
    QEMU_NS,
    THINVM_NS,
    VIRTIO_MEM_ALIAS,
    DomainSpec,
    domain_xml,
    has_ranges,
)
from thinvm.guest import image as guest_image
from thinvm.units import MiB

Q = f"{{{QEMU_NS}}}"


def spec(**kw: object) -> DomainSpec:
    base: dict[str, object] = dict(
        name="vm1",
        emulator=Path("/usr/local/lib/thinvm/qemu-patched/qemu-system-x86_64"),
        kernel=Path("/img/vmlinuz"),
        initrd=Path("/img/initrd.img"),
        disk=Path("/shared/vm1.qcow2"),
        memory=1024 * MiB,
    )
    base.update(kw)
    return DomainSpec(**base)  # type: ignore[arg-type]


def parse(s: DomainSpec) -> ET.Element:
    return ET.fromstring(domain_xml(s))


def test_thinvm_domain_has_every_feature() -> None:
    root = parse(spec(sparse_ram="sparse-ram"))
    balloon = root.find("devices/memballoon")
    assert balloon is not None
    assert balloon.get("freePageReporting") == "on" and balloon.get("autodeflate") == "on"
    assert root.find("devices/memballoon/stats").get("period") == "2"  # type: ignore[union-attr]
    assert root.find("devices/memballoon/alias").get("name") == BALLOON_ALIAS  # type: ignore[union-attr]
    args = [a.get("value") for a in root.iter(f"{Q}arg")]
    # The capability is all the command line carries: no monitor of ours.
    assert args == ["-global", "migration.sparse-ram=on"]
    # Page ranges come with the machine type (QEMU 0019): no override.
    assert root.find("os/type").get("machine") == "pc-q35-10.0-thinvm"  # type: ignore[union-attr]
    assert root.find(f"{Q}override") is None
    assert has_ranges(domain_xml(spec(sparse_ram="sparse-ram")))
    assert root.find("devices/emulator").text.endswith("qemu-patched/qemu-system-x86_64")  # type: ignore[union-attr]
    assert root.find("devices/disk/driver").get("cache") == "none"  # type: ignore[union-attr]
    assert root.find("features/acpi") is not None


def test_domains_have_no_hpet() -> None:
    for s in (spec(sparse_ram="sparse-ram"), spec(ranges=False, sparse_ram=None)):
        timer = parse(s).find("clock/timer[@name='hpet']")
        assert timer is not None and timer.get("present") == "no"


def test_stock_best_domain_hints_on_an_iothread_without_thinvm_parts() -> None:
    root = parse(spec(ranges=False, sparse_ram=None, free_page_hint=True))
    assert "-global" not in [a.get("value") for a in root.iter(f"{Q}arg")]
    bare = parse(spec(ranges=False, sparse_ram=None, free_page_hint=False))
    assert bare.find(f"{Q}commandline") is None and bare.find(f"{Q}override") is None
    props = {p.get("name"): p.get("value") for p in root.iter(f"{Q}property")}
    assert props == {"free-page-hint": "true", "iothread": "iothread1"}
    assert root.findtext("iothreads") == "1"
    # Stock QEMU's machine type: runs on any QEMU 10.0.
    assert root.find("os/type").get("machine") == "q35"  # type: ignore[union-attr]
    assert not has_ranges(domain_xml(spec(ranges=False, sparse_ram=None)))


def test_virtio_mem_domain_has_the_device_a_numa_node_and_maxmemory() -> None:
    root = parse(
        spec(memory=512 * MiB, cpus=2, virtio_mem=1024 * MiB, virtio_mem_requested=256 * MiB)
    )
    max_memory = root.find("maxMemory")
    assert max_memory is not None and max_memory.text == "1536" and max_memory.get("unit") == "MiB"
    assert root.findtext("memory") == "1536" and root.findtext("currentMemory") == "512"
    cell = root.find("cpu/numa/cell")
    assert cell is not None and (cell.get("cpus"), cell.get("memory")) == ("0-1", "512")
    target = root.find("devices/memory[@model='virtio-mem']/target")
    assert target is not None
    assert (target.findtext("size"), target.findtext("requested")) == ("1024", "256")
    assert target.findtext("block") == "2048" and target.find("block").get("unit") == "KiB"  # type: ignore[union-attr]
    assert root.find("devices/memory/alias").get("name") == VIRTIO_MEM_ALIAS  # type: ignore[union-attr]
    assert root.findtext("os/cmdline", "").endswith(" memhp_default_state=online_movable")
    plain = parse(spec())
    assert plain.find("maxMemory") is None and plain.find("cpu/numa") is None
    assert "memhp_default_state" not in plain.findtext("os/cmdline", "")


def test_capability_name_follows_a_rename(tmp_path: Path) -> None:
    assert emulator.sparse_ram_capability() in ("sparse-ram", "x-sparse-ram")
    (tmp_path / "0002-migration-add-the-sparse-ram-capability.patch").write_text(
        '+    DEFINE_PROP_MIG_CAP("x-sparse-ram", MIGRATION_CAPABILITY_SPARSE_RAM),\n'
    )
    assert emulator.sparse_ram_capability(tmp_path) == "x-sparse-ram"
    root = parse(spec(sparse_ram="x-sparse-ram"))
    assert "migration.x-sparse-ram=on" in [a.get("value") for a in root.iter(f"{Q}arg")]


def test_capability_missing_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ThinvmError, match="no sparse-ram capability"):
        emulator.sparse_ram_capability(tmp_path)


@pytest.mark.parametrize(
    "kw",
    [
        {"name": "bad name"},
        {"name": ""},
        {"memory": 64 * MiB},
        {"memory": 1000 * MiB + 1},
        {"current_memory": 2048 * MiB},
        {"cpus": 0},
        {"virtio_mem": 3 * MiB},
        {"virtio_mem": 512 * MiB, "virtio_mem_requested": 1024 * MiB},
    ],
)
def test_invalid_domains_are_refused(kw: dict[str, object]) -> None:
    with pytest.raises(ThinvmError):
        domain_xml(spec(**kw))


def test_names_are_escaped_not_injected() -> None:
    root = parse(spec(cmdline="root=/dev/vda <&> quiet"))
    assert root.findtext("os/cmdline") == "root=/dev/vda <&> quiet"


def test_hosts_get_distinct_addresses_uuids_and_trees(tmp_path: Path) -> None:
    hosts = cluster.plan_hosts(3, tmp_path, stock=["h3"])
    assert [h.address for h in hosts] == ["10.217.0.1", "10.217.0.2", "10.217.0.3"]
    assert len({h.host_uuid for h in hosts}) == 3
    assert [h.flavour for h in hosts] == ["patched", "patched", "stock"]
    assert len({h.root for h in hosts}) == 3
    assert hosts[0].uri.endswith(f"socket={tmp_path}/hosts/h1/run/libvirt-sock")
    assert hosts[1].peer_uri == "qemu+tls://10.217.0.2/system"


@pytest.mark.parametrize("count,stock", [(0, []), (17, []), (2, ["h3"])])
def test_bad_cluster_plans_are_refused(tmp_path: Path, count: int, stock: list[str]) -> None:
    with pytest.raises(ThinvmError):
        cluster.plan_hosts(count, tmp_path, stock)


def test_host_config_listens_only_on_its_own_address(tmp_path: Path) -> None:
    h = cluster.plan_hosts(2, tmp_path)[1]
    conf = cluster.libvirtd_conf(h)
    assert 'listen_addr = "10.217.0.2"' in conf
    assert "listen_tls = 1" in conf and "listen_tcp = 0" in conf
    assert f'host_uuid = "{h.host_uuid}"' in conf
    qconf = cluster.qemu_conf(h, tmp_path / "shared")
    assert 'migration_address = "10.217.0.2"' in qconf
    assert f'shared_filesystems = [ "{tmp_path}/shared" ]' in qconf
    assert "migrate_tls_force = 1" in qconf
    # QEMU as Debian's default user, files chowned to it by libvirt.
    assert "user =" not in qconf and "group =" not in qconf
    assert "dynamic_ownership" not in qconf


def test_a_no_tls_cluster_listens_on_plain_tcp(tmp_path: Path) -> None:
    h = cluster.plan_hosts(2, tmp_path, tls=False)[1]
    assert h.peer_uri == "qemu+tcp://10.217.0.2/system"
    conf = cluster.libvirtd_conf(h)
    assert "listen_tls = 0" in conf and "listen_tcp = 1" in conf
    assert "migrate_tls_force" not in cluster.qemu_conf(h, tmp_path / "shared")


def allowed_dn_list(conf: str) -> list[str]:
    """tls_allowed_dn_list of a libvirtd.conf (one line, a list of strings)."""
    (line,) = [x for x in conf.splitlines() if x.startswith("tls_allowed_dn_list")]
    return [s.strip().strip('"') for s in line.split("=", 1)[1].strip(" []").split('", "')]


def test_libvirtd_lets_in_only_libvirt_clients_of_the_cluster(tmp_path: Path) -> None:
    """Every TLS listener admits the DNs of libvirt's client certificates
    only, not the certificate QEMU reads (thinvm.fleet.pki)."""
    fast = cluster.plan_hosts(2, tmp_path)[1]
    plain = cluster.plan_hosts(2, tmp_path, tls=False)[1]
    packaged = cluster.plan_hosts(1, tmp_path, packaged=True)[0]
    booted = cluster.plan_hosts(1, tmp_path, packaged=True, systemd=True)[0]
    for conf in (
        cluster.libvirtd_conf(fast),
        cluster.packaged_libvirtd_conf(packaged),
        cluster.packaged_libvirtd_conf(booted),
    ):
        assert 'auth_tls = "none"' in conf
        assert allowed_dn_list(conf) == list(pki.LIBVIRT_CLIENT_DNS), conf
    assert "tls_allowed_dn_list" not in cluster.libvirtd_conf(plain)


def commands(script: str) -> list[list[str]]:
    """A script's lines as the shell splits them into words."""
    return [shlex.split(line) for line in script.splitlines()]


def test_host_scripts_quote_their_paths(tmp_path: Path) -> None:
    """A cluster directory with a space, a quote and a `$` in its name
    reaches every command as one word, unexpanded."""
    root = tmp_path / "a b'$HOME"
    patched, stock = Path("/x/qemu patched"), Path("/x/qemu $stock")
    normal, old = cluster.plan_hosts(2, root, stock=["h2"])
    fast = commands(cluster.host_script(normal, patched, stock))
    for key, inside in cluster.LIBVIRT_DIRS.items():
        assert ["mount", "--bind", f"{normal.root}/{key}", inside] in fast
    conf = f"{normal.root}/etc/libvirtd.conf"
    assert fast[-1] == [
        "exec",
        "libvirtd",
        "--listen",
        "-f",
        conf,
        "-p",
        "/run/libvirt/libvirtd.pid",
    ]
    assert ["mount", "--bind", str(stock), str(patched)] in commands(
        cluster.host_script(old, patched, stock)
    )
    shared, images = root / "shared", "/var/lib/thinvm/images"
    for systemd in (False, True):
        (h,) = cluster.plan_hosts(1, root, packaged=True, systemd=systemd)
        r = str(h.rootfs)
        packaged = commands(cluster.packaged_host_script(h, shared, images, root / "repo", ()))
        assert ["mount", "--bind", str(shared), f"{r}{shared}"] in packaged
        assert ["mount", "--bind", str(root / "repo"), f"{r}{cluster.APT_REPO_DIR}"] in packaged
        assert ["cd", r] in packaged


def test_host_script_binds_every_libvirt_tree(tmp_path: Path) -> None:
    patched, stock = Path("/x/qemu-patched"), Path("/x/qemu-stock")
    normal, old = cluster.plan_hosts(2, tmp_path, stock=["h2"])
    script = cluster.host_script(normal, patched, stock)
    for key, inside in cluster.LIBVIRT_DIRS.items():
        assert f"mount --bind {normal.root}/{key} {inside}" in script
    assert "qemu-stock" not in script
    assert script.rstrip().splitlines()[-1].startswith("exec libvirtd --listen")
    assert f"mount --bind {stock} {patched}" in cluster.host_script(old, patched, stock)


def test_paths_inside_a_host_map_to_its_tree(tmp_path: Path) -> None:
    h = cluster.plan_hosts(1, tmp_path)[0]
    inside = "/var/lib/libvirt/qemu/channel/target/domain-1-vm/org.thinvm.agent"
    assert (
        h.outside(inside) == Path(h.root) / "lib/qemu/channel/target/domain-1-vm/org.thinvm.agent"
    )
    assert h.outside("/elsewhere/x") == Path("/elsewhere/x")


def test_jobinfo_parsing() -> None:
    text = "Job type:         Completed\nData processed:   213.367 MiB\nTotal downtime:   279 ms\n"
    job = migrate.parse_jobinfo(text)
    assert job["Job type"] == "Completed" and job["Total downtime"] == "279 ms"
    assert migrate.parse_jobinfo("Time elapsed:  1313         ms")["Time elapsed"] == "1313 ms"
    assert migrate.job_bytes(job) == int(213.367 * MiB)
    assert migrate.job_bytes({"Data processed": "12 parsecs"}) is None
    assert migrate.job_bytes({}) is None


def test_load_state_without_a_cluster_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ThinvmError, match="thinvm cluster up"):
        cluster.load_state(tmp_path)


def test_clusters_in_different_directories_use_different_namespaces(tmp_path: Path) -> None:
    default = cluster.plan_hosts(1, Path("/var/lib/thinvm/cluster"))[0]
    other = cluster.plan_hosts(1, tmp_path)[0]
    assert default.netns == "thinvm-h1"
    assert cluster.fabric_ns(Path("/var/lib/thinvm/cluster")) == "thinvm-fabric"
    assert other.netns != default.netns and other.netns.endswith("-h1")
    assert cluster.fabric_ns(tmp_path).startswith(cluster.ns_prefix(tmp_path))


def test_a_portable_domain_has_no_qemu_command_line(tmp_path: Path) -> None:
    root = parse(spec(ranges=False, sparse_ram=None, portable=True))
    assert root.find(f"{Q}commandline") is None


def built_image(d: Path) -> Path:
    d.mkdir(parents=True)
    for name in ("disk.qcow2", "vmlinuz", "initrd.img"):
        (d / name).write_bytes(name.encode() * 100)
        (d / name).chmod(0o600)
    meta = {"kernel": "6.1", "kernel_version": "6.1.0-x", "cmdline": "root=/dev/vda"}
    (d / "image.json").write_text(json.dumps(meta))
    return d


def test_images_are_installed_world_readable_and_copied_only_when_changed(
    tmp_path: Path,
) -> None:
    built = built_image(tmp_path / "cache" / "6.1-abc")
    images = tmp_path / "images"
    image = guest_image.install_image(built, images)
    assert image.directory == images / "6.1-abc"
    assert (image.kernel, image.kernel_version, image.cmdline) == (
        "6.1",
        "6.1.0-x",
        "root=/dev/vda",
    )
    for path in (image.disk, image.vmlinuz, image.initrd):
        assert path.read_bytes() == (built / path.name).read_bytes()
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path
    assert stat.S_IMODE(image.directory.stat().st_mode) == 0o755
    before = {p.name: p.stat().st_ino for p in image.directory.iterdir()}
    guest_image.install_image(built, images)  # unchanged: nothing copied
    assert {p.name: p.stat().st_ino for p in image.directory.iterdir()} == before
    (built / "initrd.img").write_bytes(b"a new initramfs")
    guest_image.install_image(built, images)
    assert image.initrd.read_bytes() == b"a new initramfs"
    assert image.initrd.stat().st_ino != before["initrd.img"]
    assert image.disk.stat().st_ino == before["disk.qcow2"]
    assert not list(image.directory.glob(".*"))  # no temporary file left


def test_an_incomplete_image_is_a_clear_error(tmp_path: Path) -> None:
    built = built_image(tmp_path / "6.12-abc")
    (built / "vmlinuz").unlink()
    with pytest.raises(ThinvmError, match="vmlinuz missing"):
        guest_image.install_image(built, tmp_path / "images")
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ThinvmError, match="cannot install the guest image in"):
        guest_image.install_image(built_image(tmp_path / "6.1-abc"), tmp_path / "a-file" / "images")


@pytest.mark.skipif(shutil.which("virsh") is None, reason="needs virsh (libvirt-clients)")
def test_a_virsh_session_answers_command_by_command() -> None:
    """libvirt's test driver, in-process: no daemon needed."""
    with migrate.VirshSession("test:///default", "test") as session:
        assert session.run("domstate", "test") == "running"
        # Output without a final newline, quotes, JSON: returned as printed.
        assert session.run("echo", """it's {"a": 1}""") == """it's {"a": 1}"""
        with pytest.raises(ThinvmError, match="test: virsh dominfo: failed to get domain 'nosuch'"):
            session.run("dominfo", "nosuch")
        assert "test" in session.run("list", "--all")  # still in step after an error


# -- migrate(): the domain XML read once -------------------------------------

STOCK_QEMU = str(emulator.PACKAGED_STOCK)
THINVM_QEMU = str(emulator.PACKAGED_THINVM)


def _live_xml(portable: bool) -> str:
    metadata = f'<metadata><g:guest xmlns:g="{THINVM_NS}" portable="yes"/></metadata>'
    return (
        f"<domain>{metadata if portable else ''}"
        f"<devices><emulator>{STOCK_QEMU}</emulator></devices></domain>"
    )


class _FakePoller:
    """Stands in for the query-migrate poller (a virsh of its own)."""

    def __init__(self, host: object, name: str, trace: object = None) -> None:
        self.ram: dict[str, int] = {}
        self.caps: dict[str, bool] = {}
        self.polls = 0

    def start(self) -> None:
        pass

    def finish(self) -> None:
        pass


def _fake_migrate(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, portable: bool, dest_qemu: Path
) -> tuple[migrate.MigrationResult, list[tuple[str, ...]], dict[str, str], list[str]]:
    """migrate() with libvirt faked: the virsh calls it made, the files
    it passed with --xml/--persistent-xml, the guests it cleared sparse-ram of."""
    src, dst = cluster.plan_hosts(2, tmp_path, packaged=True)
    calls: list[tuple[str, ...]] = []
    sent: dict[str, str] = {}
    cleared: list[str] = []

    def fake_virsh(host: cluster.Host, *args: str, timeout: float = 120.0) -> str:
        calls.append(args)
        if args[0] == "dumpxml":
            inactive = "<!--inactive-->" if "--inactive" in args else ""
            return _live_xml(portable).replace("<domain>", f"<domain>{inactive}")
        if args[0] == "migrate":
            for flag in ("--xml", "--persistent-xml"):
                if flag in args:
                    sent[flag] = Path(args[args.index(flag) + 1]).read_text()
        return "Data processed: 1.000 MiB" if args[0] == "domjobinfo" else ""

    monkeypatch.setattr(migrate, "virsh", fake_virsh)
    monkeypatch.setattr(migrate, "_SourcePoller", _FakePoller)
    monkeypatch.setattr(migrate, "clear_sparse_ram", lambda host, name: cleared.append(name))
    monkeypatch.setattr(emulator, "packaged_emulator", lambda uri: dest_qemu)
    result = migrate.migrate(src, dst, "vm1", parallel=2)
    return result, calls, sent, cleared


def test_migrate_reads_the_live_xml_once_and_sends_it_with_the_new_emulator(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    result, calls, sent, cleared = _fake_migrate(
        monkeypatch, tmp_path, True, emulator.PACKAGED_THINVM
    )
    dumps = [c for c in calls if c[0] == "dumpxml"]
    # The live XML once (portable? which emulator? the XML sent), and the
    # persistent definition, a document of its own, only for the switch.
    assert dumps == [("dumpxml", "--migratable", "vm1"),
                     ("dumpxml", "--inactive", "--migratable", "vm1")]  # fmt: skip
    assert cleared == ["vm1"]
    assert result.emulator == THINVM_QEMU
    assert sent["--xml"] == _live_xml(True).replace(STOCK_QEMU, THINVM_QEMU)
    assert "<!--inactive-->" in sent["--persistent-xml"]
    assert THINVM_QEMU in sent["--persistent-xml"]


def test_migrate_keeping_the_emulator_reads_the_xml_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    result, calls, sent, cleared = _fake_migrate(
        monkeypatch, tmp_path, False, emulator.PACKAGED_STOCK
    )
    assert [c for c in calls if c[0] == "dumpxml"] == [("dumpxml", "--migratable", "vm1")]
    assert result.emulator is None and not sent and not cleared
    (migration,) = [c for c in calls if c[0] == "migrate"]
    assert "--xml" not in migration and migration[-1] == "qemu+tls://10.217.0.2/system"


def test_destination_emulator_leaves_unknown_emulators_alone(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (dst,) = cluster.plan_hosts(1, tmp_path, packaged=True)
    monkeypatch.setattr(emulator, "packaged_emulator", lambda uri: emulator.PACKAGED_THINVM)
    own = "<domain><devices><emulator>/usr/local/lib/thinvm/x</emulator></devices></domain>"
    assert migrate.destination_emulator(own, dst) is None
    assert migrate.destination_emulator(_live_xml(False), dst) == THINVM_QEMU
    assert migrate.destination_emulator(_live_xml(False).replace(STOCK_QEMU, THINVM_QEMU),
                                        dst) is None  # fmt: skip


def test_a_guest_with_page_ranges_is_not_sent_to_a_stock_qemu(tmp_path: Path) -> None:
    (dst,) = cluster.plan_hosts(1, tmp_path, packaged=True)
    ranged = (
        "<domain><os><type machine='pc-q35-10.0-thinvm'>hvm</type></os>"
        f"<devices><emulator>{THINVM_QEMU}</emulator></devices></domain>"
    )
    with pytest.raises(ThinvmError, match=r"machine type pc-q35-10\.0-thinvm .* portable guest"):
        migrate.check_machine_type(ranged, STOCK_QEMU, dst, "vm1")
    # To thinvm-qemu, or keeping the emulator: nothing to refuse.
    migrate.check_machine_type(ranged, None, dst, "vm1")
    plain = ranged.replace("pc-q35-10.0-thinvm", "pc-q35-10.0")
    migrate.check_machine_type(plain, STOCK_QEMU, dst, "vm1")


def test_multifd_args_compress_only_over_channels() -> None:
    assert migrate.multifd_args(0, None) == []
    assert migrate.multifd_args(2, None) == ["--parallel", "--parallel-connections", "2"]
    assert migrate.multifd_args(2, "zstd") == [
        "--parallel", "--parallel-connections", "2", "--compressed", "--comp-methods", "zstd",
    ]  # fmt: skip
    with pytest.raises(ThinvmError, match="needs --parallel"):
        migrate.multifd_args(0, "zstd")
    with pytest.raises(ThinvmError, match="want one of zstd"):
        migrate.multifd_args(2, "zlib")
    with pytest.raises(ThinvmError, match="want 0"):
        migrate.multifd_args(-1, None)


def test_two_installs_of_one_image_at_once_both_succeed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two pytest workers installed a new image at the same moment and
    shared one temporary file: one renamed it away from under the other
    (CI, 2026-11-27).  Here the second install runs inside the first's copy."""
    built = built_image(tmp_path / "cache" / "6.1-abc")
    images = tmp_path / "images"
    copy = shutil.copyfile
    nested: list[Path] = []
    started: list[bool] = []

    def copy_while_another_installs(src: Path, dst: Path) -> Any:
        done = copy(src, dst)
        if not started:
            started.append(True)
            nested.append(guest_image.install_image(built, images).directory)
        return done

    monkeypatch.setattr(guest_image.shutil, "copyfile", copy_while_another_installs)
    image = guest_image.install_image(built, images)
    assert nested == [image.directory]
    assert image.disk.read_bytes() == (built / "disk.qcow2").read_bytes()
    assert not list(image.directory.glob(".*"))  # no temporary file left


def test_tcg_translation_cache_is_bounded_only_when_asked() -> None:
    assert parse(spec()).find("features/tcg") is None
    cache = parse(spec(tb_cache=32 * MiB)).find("features/tcg/tb-cache")
    assert cache is not None and (cache.text, cache.get("unit")) == ("32", "MiB")
    for bad in (512 * 1024, 32 * MiB + 1):
        with pytest.raises(ThinvmError, match="translation cache"):
            domain_xml(spec(tb_cache=bad))
