"""The cluster's certificates: real openssl, checked with openssl."""

import fnmatch
import os
import stat
import subprocess
from pathlib import Path

from thinvm.fleet import pki


def openssl(*args: str) -> str:
    return subprocess.run(["openssl", *args], capture_output=True, text=True, check=True).stdout


def test_a_host_tree_has_libvirts_layout_and_certificates_of_the_cluster_ca(
    tmp_path: Path,
) -> None:
    ca = pki.make_ca(tmp_path / "cluster")
    tree = tmp_path / "h2" / "pki"
    pki.host_tree(tree, ca, "10.217.0.2", "thinvm-h2")
    for name in (
        "CA/cacert.pem",
        "libvirt/servercert.pem", "libvirt/private/serverkey.pem",
        "libvirt/clientcert.pem", "libvirt/private/clientkey.pem",
        "qemu/ca-cert.pem", "qemu/server-cert.pem", "qemu/server-key.pem",
        "qemu/client-cert.pem", "qemu/client-key.pem",
    ):  # fmt: skip
        assert (tree / name).is_file(), name
    for key in ("libvirt/private/serverkey.pem", "qemu/client-key.pem"):
        assert stat.S_IMODE((tree / key).stat().st_mode) == 0o600, key
    assert not list(tree.rglob("cakey.pem"))  # the CA key never enters a host
    cacert = str(tree / "CA" / "cacert.pem")
    for role, purpose in (("server", "sslserver"), ("client", "sslclient")):
        cert = str(tree / "libvirt" / f"{role}cert.pem")
        out = openssl("verify", "-CAfile", cacert, "-purpose", purpose, cert)
        assert out.strip().endswith("OK"), out
        text = openssl("x509", "-in", cert, "-noout", "-text")
        assert "IP Address:10.217.0.2" in text and "DNS:thinvm-h2" in text


def test_a_certificate_from_another_ca_does_not_verify(tmp_path: Path) -> None:
    ours = pki.make_ca(tmp_path / "ours")
    theirs = pki.make_ca(tmp_path / "theirs")
    cert, key = tmp_path / "rogue.pem", tmp_path / "rogue-key.pem"
    pki.issue(theirs, pki.CLIENT_USAGE, "10.217.0.9", "rogue", cert, key)
    proc = subprocess.run(
        ["openssl", "verify", "-CAfile", str(ours[0]), str(cert)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert proc.returncode != 0


def test_qemus_group_reads_its_keys_and_nothing_else(tmp_path: Path) -> None:
    """QEMU, run as libvirt-qemu, opens /etc/pki/qemu itself; libvirtd's
    keys stay root's."""
    ca = pki.make_ca(tmp_path / "cluster")
    tree = tmp_path / "h1" / "pki"
    gid = os.getgid()  # the test's own group stands for libvirt-qemu's
    pki.host_tree(tree, ca, "10.217.0.1", "thinvm-h1", qemu_gid=gid)
    qemu = tree / "qemu"
    assert (stat.S_IMODE(qemu.stat().st_mode), qemu.stat().st_gid) == (0o750, gid)
    for key in ("server-key.pem", "client-key.pem"):
        st = (qemu / key).stat()
        assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o640, gid), key
    private = tree / "libvirt" / "private"
    assert stat.S_IMODE(private.stat().st_mode) == 0o700
    assert stat.S_IMODE((private / "serverkey.pem").stat().st_mode) == 0o600


def query_dn(cert: Path) -> str:
    """The Distinguished Name libvirtd matches against tls_allowed_dn_list,
    as libvirt's own tool prints it."""
    out = subprocess.run(
        ["virt-pki-query-dn", str(cert)], capture_output=True, text=True, check=True
    ).stdout
    return out.strip()


def public_key(key: Path) -> str:
    return openssl("pkey", "-in", str(key), "-pubout")


def allowed(dn: str) -> bool:
    """libvirtd's test (g_pattern_match_simple: `*` and `?` globs)."""
    return any(fnmatch.fnmatchcase(dn, pattern) for pattern in pki.LIBVIRT_CLIENT_DNS)


def test_only_libvirts_client_certificate_is_a_libvirt_client(tmp_path: Path) -> None:
    """What QEMU can read (/etc/pki/qemu) is a certificate and key of their
    own, whose DN libvirtd does not let in; libvirt's client certificate is
    the only one that libvirtd's tls_allowed_dn_list lets in."""
    ca = pki.make_ca(tmp_path / "cluster")
    tree = tmp_path / "h1" / "pki"
    pki.host_tree(tree, ca, "10.217.0.1", "thinvm-h1", qemu_gid=os.getgid())
    libvirt_keys = {
        public_key(tree / "libvirt" / "private" / f"{role}key.pem") for role in ("client", "server")
    }
    for key in ("client-key.pem", "server-key.pem"):
        assert public_key(tree / "qemu" / key) not in libvirt_keys, key
    client = tree / "libvirt" / "clientcert.pem"
    assert allowed(query_dn(client)), query_dn(client)
    for cert in ("libvirt/servercert.pem", "qemu/client-cert.pem", "qemu/server-cert.pem"):
        assert not allowed(query_dn(tree / cert)), (cert, query_dn(tree / cert))
    # QEMU's pair still does its job: each verifies against the CA for its
    # side of the migration stream and names the host's address.
    cacert = str(tree / "qemu" / "ca-cert.pem")
    for role, purpose in (("server", "sslserver"), ("client", "sslclient")):
        cert = str(tree / "qemu" / f"{role}-cert.pem")
        out = openssl("verify", "-CAfile", cacert, "-purpose", purpose, cert)
        assert out.strip().endswith("OK"), out
        assert "IP Address:10.217.0.1" in openssl("x509", "-in", cert, "-noout", "-text")


def test_libvirts_client_key_is_roots_alone(tmp_path: Path) -> None:
    ca = pki.make_ca(tmp_path / "cluster")
    tree = tmp_path / "h1" / "pki"
    pki.host_tree(tree, ca, "10.217.0.1", "thinvm-h1", qemu_gid=os.getgid())
    private = tree / "libvirt" / "private"
    assert stat.S_IMODE(private.stat().st_mode) == 0o700
    for key in ("clientkey.pem", "serverkey.pem"):
        st = (private / key).stat()
        assert (stat.S_IMODE(st.st_mode), st.st_uid) == (0o600, os.getuid()), key
