"""Issue 46 item 9: what a compromised QEMU can reach with the certificates
it reads.  Shared by the cluster modules (test_fleet.py's fast hosts,
test_packaged_cluster.py's Debian hosts), each on the cluster its module
already runs."""

import subprocess
import sys
from pathlib import Path

from tests.conftest import peer_virsh
from thinvm.fleet import cluster
from thinvm.fleet.cluster import ClusterState, Host

# What QEMU reads, as libvirt runs it (user libvirt-qemu): its migration
# certificates (thinvm.fleet.pki).
QEMU_PKI = "/etc/pki/qemu"
QEMU_PKI_FILES = ("ca-cert.pem", "client-cert.pem", "client-key.pem", "server-cert.pem",
                  "server-key.pem")  # fmt: skip

# A TLS client that speaks just enough of libvirt's protocol to be told
# whether the server let its certificate in: libvirtd writes one byte, 1,
# once the client's certificate passed its checks, and closes the
# connection otherwise.  Prints that byte (b'' when refused).
LIBVIRT_TLS_PROBE = """
import socket, ssl, sys
ca, cert, key, address = sys.argv[1:]
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
ctx.load_verify_locations(ca)
ctx.load_cert_chain(cert, key)
try:
    with socket.create_connection((address, 16514), timeout=20) as raw:
        with ctx.wrap_socket(raw, server_hostname=address) as tls:
            print(repr(tls.recv(1)))
except (OSError, ssl.SSLError) as exc:
    print(repr(b""), exc)
"""


def in_host(state: ClusterState, h: Host, argv: list[str]) -> subprocess.CompletedProcess[str]:
    """ARGV in the host's network and mount namespaces (and in its own root,
    on a packaged host): what a process on that host sees."""
    fresh = cluster.load_state(Path(h.root).parent.parent)  # `cluster restart` changes the pid
    pid = fresh.pids[h.name]
    root = ["-r", "-w"] if h.packaged else []
    return subprocess.run(
        ["nsenter", "-t", str(pid), "-n", "-m", *root, "--", *argv],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def tls_probe(frm: Host, to: Host, d: Path) -> str:
    """What libvirtd on `to` answers a TLS client in `frm`'s network that
    shows the certificate in the pkipath directory `d`: "b'\\x01'" if it
    let the client in."""
    proc = subprocess.run(
        ["ip", "netns", "exec", frm.netns, sys.executable, "-c", LIBVIRT_TLS_PROBE,
         str(d / "cacert.pem"), str(d / "clientcert.pem"), str(d / "clientkey.pem"), to.address],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return proc.stdout.strip()


def assert_qemus_files_open_no_peer(state: ClusterState, tmp_path: Path) -> None:
    """Everything QEMU can read on h1 (what libvirt-qemu can read in
    /etc/pki/qemu) lets no one into another host's libvirtd: shown as a
    libvirt client, either key pair of QEMU's is refused by the peer's
    tls_allowed_dn_list, while libvirt's own client certificate on h1 gets
    in.  libvirt-qemu cannot read libvirt's keys."""
    h1 = state.host("h1")
    as_qemu = ["runuser", "-u", cluster.QEMU_USER, "--", "cat"]
    readable: dict[str, str] = {}
    for name in QEMU_PKI_FILES:
        proc = in_host(state, h1, [*as_qemu, f"{QEMU_PKI}/{name}"])
        assert proc.returncode == 0, (name, proc.stderr)  # the control: QEMU's own files
        readable[name] = proc.stdout
    for key in ("clientkey.pem", "serverkey.pem"):
        proc = in_host(state, h1, [*as_qemu, f"/etc/pki/libvirt/private/{key}"])
        assert proc.returncode != 0 and "Permission denied" in proc.stderr, (key, proc)
    member = tmp_path / "member"
    member.mkdir()
    for src, name in (("/etc/pki/CA/cacert.pem", "cacert.pem"),
                      ("/etc/pki/libvirt/clientcert.pem", "clientcert.pem"),
                      ("/etc/pki/libvirt/private/clientkey.pem", "clientkey.pem")):  # fmt: skip
        (member / name).write_text(in_host(state, h1, ["cat", src]).stdout)
    pairs: dict[str, Path] = {}
    for role in ("client", "server"):
        pairs[role] = tmp_path / f"qemu-{role}"
        pairs[role].mkdir()
        for src, name in (("ca-cert.pem", "cacert.pem"), (f"{role}-cert.pem", "clientcert.pem"),
                          (f"{role}-key.pem", "clientkey.pem")):  # fmt: skip
            (pairs[role] / name).write_text(readable[src])
    for to in state.hosts:
        if to.name == h1.name:
            continue
        assert peer_virsh(h1, to, member) == "", to.name  # the control: libvirt's client
        assert tls_probe(h1, to, member) == "b'\\x01'", to.name
        log = to.outside("/var/log/libvirt/libvirtd.log")
        logged = log.stat().st_size if log.exists() else 0
        # libvirtd checks the DN after the handshake and closes the
        # connection instead of confirming it: the client sees no reason.
        refused = peer_virsh(h1, to, pairs["client"])
        assert "Unable to read TLS confirmation" in refused, (to.name, refused)
        # virsh will not show a server certificate as a client's; a client
        # of its own making would: libvirtd refuses that DN too.
        for role, d in pairs.items():
            assert tls_probe(h1, to, d).startswith("b''"), (to.name, role)
        with log.open() as f:
            f.seek(logged)
            assert "tls_allowed_dn_list" in f.read(), to.name  # refused for its DN
