"""`thinvm fleet ...` and `thinvm cluster ...`: thin layers over
thinvm.fleet (see docs/fleet.md)."""

import argparse
import json
import sys
from typing import Any, TypeAlias

from thinvm.errors import ThinvmError
from thinvm.fleet import cluster, emulator, guest, migrate
from thinvm.fleet.domain import domain_xml
from thinvm.fleet.trace import Trace
from thinvm.guest import image as guest_image
from thinvm.guest.agent import shell_line
from thinvm.guest.trim import report as trim_report
from thinvm.units import parse_size, seconds


def _print_json_or(args: argparse.Namespace, data: Any, text: str) -> None:
    print(json.dumps(data, indent=2) if args.json else text)


# -- fleet: what an operator needs on a libvirt host -------------------------


def cmd_install(args: argparse.Namespace) -> int:
    """Install both QEMU builds as libvirt emulators; check with libvirt."""
    out: dict[str, Any] = {"sparse_ram_capability": emulator.sparse_ram_capability()}
    for flavour in ("patched", "stock"):
        inst = emulator.install(flavour)
        entry: dict[str, Any] = {"path": str(inst.path), "updated": inst.changed}
        if args.connect:
            caps = emulator.domcapabilities(inst.path, args.connect)
            entry["domcapabilities"] = "ok" if "<domainCapabilities>" in caps else "unexpected"
        out[flavour] = entry
    lines = [
        f"{f:8} {out[f]['path']}"
        + (f"  (libvirt domcapabilities: {out[f]['domcapabilities']})" if args.connect else "")
        for f in ("patched", "stock")
    ]
    lines.append(f"sparse-ram capability: migration.{out['sparse_ram_capability']}")
    if not args.connect:
        lines.append("(pass --connect URI to have libvirt probe them: virsh domcapabilities)")
    _print_json_or(args, out, "\n".join(lines))
    return 0


def _guest_spec(args: argparse.Namespace) -> guest.GuestSpec:
    return guest.GuestSpec(
        name=args.name,
        memory=parse_size(args.memory),
        kernel=args.kernel,
        build=args.build,
        thinvm=not args.no_thinvm,
        portable=args.portable,
        hint=args.free_page_hint,
        virtio_mem=parse_size(args.virtio_mem),
        virtio_mem_requested=parse_size(args.virtio_mem_requested),
    )


def cmd_xml(args: argparse.Namespace) -> int:
    """Print the domain XML of a thinvm guest (the documented example)."""
    image = guest_image.ensure_disk_image(args.kernel)
    shared = cluster.shared_dir(cluster.cluster_dir())
    print(domain_xml(guest.spec_for(_guest_spec(args), image, shared)), end="")
    return 0


def cmd_start(args: argparse.Namespace) -> int:
    state = cluster.load_state()
    host = state.host(args.host)
    image = guest_image.ensure_disk_image(args.kernel)
    # A package-installed host: thinvm-qemu where installed, else Debian's.
    binary = emulator.packaged_emulator(host.uri) if host.packaged else None
    shared = cluster.shared_dir(cluster.cluster_dir())
    spec = guest.spec_for(_guest_spec(args), image, shared, binary)
    guest.define(host, spec, image)
    try:
        cluster.virsh(host, "start", args.name)
    except ThinvmError:
        cluster.virsh(host, "undefine", args.name)
        raise
    seconds = guest.wait_booted(host, args.name)
    client = guest.agent(host, args.name)
    try:
        info = guest_image.guest_info(client)
    finally:
        client.close()
    data = {"name": args.name, "host": host.name, "boot_seconds": round(seconds, 1), **info}
    _print_json_or(
        args,
        data,
        f"{args.name} running on {host.name}: booted in {seconds:.1f} s, kernel "
        f"{info.get('kernel')}, balloon driver {info.get('balloon_driver')}",
    )
    return 0


def cmd_exec(args: argparse.Namespace) -> int:
    state = cluster.load_state()
    host = guest.find_guest(state, args.name)
    result = guest.run_in_guest(host, args.name, shell_line(args.command), check=False)
    # As `thinvm exec`: the guest's stderr goes to ours, so pipes stay clean.
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    return result.status


def cmd_trim(args: argparse.Namespace) -> int:
    state = cluster.load_state()
    host = guest.find_guest(state, args.name)
    max_bytes = parse_size(args.max_bytes) if args.max_bytes else 0
    result = guest.trim(host, args.name, max_bytes=max_bytes, timeout=args.timeout)
    return trim_report(result, args.name, args.json)


def cmd_reclaim(args: argparse.Namespace) -> int:
    state = cluster.load_state()
    host = guest.find_guest(state, args.name)
    counters = guest.set_reclaim(host, args.name, args.mode == "on")
    if args.json:
        print(json.dumps(counters))
    else:
        print(f"{args.name}: background reclaim {args.mode}")
    return 0


def cmd_migrate(args: argparse.Namespace) -> int:
    state = cluster.load_state()
    source = guest.find_guest(state, args.name)
    dest = state.host(args.to)
    # Bad requests fail before the trim changes the guest.
    migrate.check_route(source, dest, args.name)
    migrate.check_multifd(args.parallel, args.compress)
    trimmed = None
    if args.trim:
        trimmed = guest.trim(source, args.name)
        if trimmed.trimmed:
            print(trimmed.describe(args.name), file=sys.stderr if args.json else sys.stdout)
        else:
            print(f"thinvm: {args.name}: not trimmed, migrating anyway: {trimmed.note}",
                  file=sys.stderr)  # fmt: skip
    trace = Trace() if args.trace else None
    result = migrate.migrate(
        source, dest, args.name, parallel=args.parallel, compress=args.compress, trace=trace
    )
    data = result.summary()
    if trace is not None:
        data["trace"] = trace.steps()
        if not args.json:
            print("\n".join(trace.lines()))
    data["balloon"] = migrate.balloon_counters(dest, args.name)
    if trimmed is not None:
        data["trim"] = trimmed.to_json()
    skipped = data["sparse-skipped"]
    _print_json_or(
        args,
        data,
        f"{args.name}: {source.name} -> {dest.name} in {result.seconds:.2f} s, "
        f"{result.job.get('Data processed', '?')} sent, downtime "
        f"{result.job.get('Total downtime', '?')}, sparse-skipped "
        f"{'n/a' if skipped is None else f'{skipped} pages'}"
        + (f", now on {result.emulator}" if result.emulator else ""),
    )
    return 0


def cmd_counters(args: argparse.Namespace) -> int:
    state = cluster.load_state()
    host = guest.find_guest(state, args.name)
    data: dict[str, Any] = {"host": host.name}
    data["balloon"] = migrate.balloon_counters(host, args.name)
    mig = migrate.qmp(host, args.name, "query-migrate")
    data["migration"] = mig.get("ram", {}) if isinstance(mig, dict) else {}
    data["memstat"] = dict(
        line.split(None, 1)
        for line in cluster.virsh(host, "dommemstat", args.name).splitlines()
        if line.strip()
    )
    text = [f"{args.name} on {host.name}"]
    text += [f"  balloon {k}: {v}" for k, v in data["balloon"].items()]
    text += [f"  memstat {k}: {v}" for k, v in data["memstat"].items()]
    _print_json_or(args, data, "\n".join(text))
    return 0


# -- cluster -----------------------------------------------------------------


def cmd_cluster_up(args: argparse.Namespace) -> int:
    state = cluster.up(
        args.hosts, args.link, args.stock or (), tls=args.tls, packaged=args.packaged,
        systemd=args.systemd,
    )  # fmt: skip
    for h in state.hosts:
        print(f"{h.name}  {h.address}  {cluster.host_flavour(h):7}  virsh -c '{h.uri}'")
    return 0


def cmd_cluster_exec(args: argparse.Namespace) -> int:
    """A command as root of a packaged host (e.g. apt-get install thinvm-qemu)."""
    if not args.command:
        raise ThinvmError("nothing to run: thinvm cluster exec HOST -- COMMAND...")
    proc = cluster.host_run(cluster.load_state(), args.host, args.command)
    sys.stdout.write(proc.stdout)
    sys.stderr.write(proc.stderr)
    return proc.returncode


def cmd_cluster_down(args: argparse.Namespace) -> int:
    removed = cluster.down()
    print("removed: " + (", ".join(removed) if removed else "nothing (no cluster was up)"))
    return 0


def cmd_cluster_status(args: argparse.Namespace) -> int:
    state = cluster.load_state()
    hosts: list[dict[str, Any]] = []
    lines: list[str] = []
    for h in state.hosts:
        try:
            doms = cluster.virsh(h, "list", "--all", "--name").split()
            up = True
        except ThinvmError:
            doms, up = [], False
        flavour = cluster.host_flavour(h)
        hosts.append({"host": h.name, "address": h.address, "qemu": flavour, "up": up,
                      "packaged": h.packaged, "systemd": h.systemd, "domains": doms,
                      "uri": h.uri,
                      "peer_uri": h.peer_uri})  # fmt: skip
        lines.append(
            f"{h.name}  {h.address}  {flavour:7}  {'up' if up else 'DOWN'}  "
            f"domains: {', '.join(doms) or '-'}"
        )
    lines.append(f"link: {state.link or 'unlimited'}")
    tls = all(h.tls for h in state.hosts)
    lines.append("peers: " + ("TLS, certificates of the cluster CA" if tls else "plain TCP"))
    _print_json_or(args, {"hosts": hosts, "link": state.link}, "\n".join(lines))
    return 0


def cmd_cluster_kill(args: argparse.Namespace) -> int:
    print(f"killed libvirtd of {args.host} (pid {cluster.kill_daemon(args.host)})")
    return 0


def cmd_cluster_restart(args: argparse.Namespace) -> int:
    print(f"libvirtd of {args.host} running again (pid {cluster.restart_daemon(args.host)})")
    return 0


def cmd_cluster_uri(args: argparse.Namespace) -> int:
    print(cluster.load_state().host(args.host).uri)
    return 0


def _add_guest_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--memory", "-m", default="1G", help="guest RAM (default 1G)")
    p.add_argument("--kernel", default="6.1", choices=("6.1", "6.12"))
    p.add_argument("--build", default="patched", choices=("patched", "stock"),
                   help="emulator the domain names")  # fmt: skip
    p.add_argument(
        "--no-thinvm",
        action="store_true",
        help="stock's best instead: reporting, no ranges, no sparse-ram",
    )
    p.add_argument(
        "--free-page-hint",
        action="store_true",
        help="free page hinting too (off: it measured slower once reporting runs, "
        "and it needs a <qemu:override>)",
    )
    p.add_argument(
        "--portable",
        action="store_true",
        help="a guest that also runs on hosts still on stock QEMU: no page ranges, "
        "sparse-ram only for multifd migrations from a thinvm host (docs/fleet.md)",
    )
    p.add_argument(
        "--virtio-mem",
        default="0",
        metavar="SIZE",
        help="a virtio-mem device the guest can grow by, beyond --memory "
        "(virsh update-memory-device NAME --alias ua-vmem0 --requested-size SIZE)",
    )
    p.add_argument(
        "--virtio-mem-requested",
        default="0",
        metavar="SIZE",
        help="how much of --virtio-mem is plugged at start (default 0)",
    )


Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def add_parsers(sub: Subparsers) -> None:
    fleet = sub.add_parser("fleet", help="thinvm under libvirt: emulators, XML, guests")
    fsub = fleet.add_subparsers(dest="fleet_command", required=True)
    _add_setup_parsers(fsub)
    _add_guest_parsers(fsub)
    cl = sub.add_parser("cluster", help="simulated libvirt hosts (network namespaces)")
    _add_cluster_parsers(cl.add_subparsers(dest="cluster_command", required=True))


def _add_setup_parsers(fsub: Subparsers) -> None:
    """fleet install, xml: what a host and a domain need."""
    p = fsub.add_parser("install", help="install the QEMU builds as libvirt emulators")
    p.add_argument("--connect", help="libvirt URI to probe them with (domcapabilities)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_install)

    p = fsub.add_parser("xml", help="print the domain XML of a thinvm Debian guest")
    p.add_argument("--name", default="thinvm-guest")
    _add_guest_options(p)
    p.set_defaults(func=cmd_xml)


def _add_guest_parsers(fsub: Subparsers) -> None:
    """fleet start, exec, migrate, trim, reclaim, counters: one guest each."""
    p = fsub.add_parser("start", help="define and start a Debian guest on a cluster host")
    p.add_argument("name")
    p.add_argument("--host", default="h1")
    p.add_argument("--json", action="store_true")
    _add_guest_options(p)
    p.set_defaults(func=cmd_start)

    p = fsub.add_parser(
        "exec",
        help="run a command in a cluster guest (agent)",
        description="Everything after '--' is the guest's argv, passed word for word; "
        "for shell syntax run sh -c 'LINE'.",
    )
    p.add_argument("name")
    p.add_argument("command", nargs="*", help="the guest's argv, after '--'")
    p.set_defaults(func=cmd_exec)

    p = fsub.add_parser("migrate", help="live-migrate a guest to another cluster host")
    p.add_argument("name")
    p.add_argument("--to", required=True, help="destination host, e.g. h2")
    p.add_argument("--parallel", type=int, default=0, help="multifd connections (0: off)")
    p.add_argument(
        "--compress",
        choices=migrate.COMPRESS_METHODS,
        help="compress the multifd channels (needs --parallel); pays on slow links only",
    )
    p.add_argument("--trim", action="store_true", help="first have the guest give back cold memory")
    p.add_argument(
        "--trace",
        action="store_true",
        help="print where the time went: thinvm's steps and libvirt's events on both hosts",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_migrate)

    p = fsub.add_parser("trim", help="have a cluster guest give back cold memory now")
    p.add_argument("name")
    p.add_argument("--max-bytes", help="give back at most this much, e.g. 512M (default: all)")
    p.add_argument("--timeout", type=seconds, default=30.0, help="seconds the guest may reclaim")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_trim)

    p = fsub.add_parser(
        "reclaim", help="switch a cluster guest's background reclaim of cold cache on or off"
    )
    p.add_argument("name")
    p.add_argument("mode", choices=("on", "off"))
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_reclaim)

    p = fsub.add_parser("counters", help="thinvm counters and balloon stats of a guest")
    p.add_argument("name")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_counters)


def _add_cluster_parsers(csub: Subparsers) -> None:
    """cluster up, exec, down, status, kill, restart, uri."""
    p = csub.add_parser("up", help="create N hosts, each with its own libvirtd")
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--link", help="rate limit of each host's link, e.g. 10gbit")
    p.add_argument(
        "--stock",
        action="append",
        metavar="HOST",
        help="this host runs stock QEMU behind the thinvm emulator path",
    )
    p.add_argument("--no-tls", dest="tls", action="store_false",
                   help="plain TCP between hosts, no authentication (to measure what TLS "
                        "costs; never on a real network)")  # fmt: skip
    p.add_argument(
        "--packaged",
        action="store_true",
        help="hosts are Debian installs (own root filesystem, Debian's libvirt and QEMU, "
        "thinvm-qemu installed with apt except on --stock hosts); docs/fleet.md",
    )
    p.add_argument(
        "--systemd",
        action="store_true",
        help="packaged hosts boot systemd as their init, which starts libvirtd "
        "(socket-activated) and the services apt installs, as on a Debian server",
    )
    p.set_defaults(func=cmd_cluster_up)
    p = csub.add_parser(
        "exec",
        help="run a command as root on a packaged host (its root, its namespaces)",
        description="e.g. thinvm cluster exec h2 -- apt-get install -y thinvm-qemu",
    )
    p.add_argument("host")
    p.add_argument("command", nargs="*", help="the command, after '--'")
    p.set_defaults(func=cmd_cluster_exec)
    p = csub.add_parser("down", help="remove every host, daemon and guest; idempotent")
    p.set_defaults(func=cmd_cluster_down)
    p = csub.add_parser("status", help="hosts, their daemons and domains")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_cluster_status)
    p = csub.add_parser("kill", help="SIGKILL a host's libvirtd (fault injection)")
    p.add_argument("host")
    p.set_defaults(func=cmd_cluster_kill)
    p = csub.add_parser("restart", help="start a host's dead libvirtd again")
    p.add_argument("host")
    p.set_defaults(func=cmd_cluster_restart)
    p = csub.add_parser("uri", help="the virsh connection URI of a host")
    p.add_argument("host")
    p.set_defaults(func=cmd_cluster_uri)
