"""The cluster's certificates: one CA, and per host three kinds of
certificate, each for one party, laid out where libvirt and QEMU look for
them by default.

Inside each host (its mount namespace binds <host>/pki over /etc/pki):

    /etc/pki/CA/cacert.pem                  the cluster CA (libvirtd, virsh)
    /etc/pki/libvirt/servercert.pem         libvirtd's TLS listener
    /etc/pki/libvirt/private/serverkey.pem
    /etc/pki/libvirt/clientcert.pem         libvirt as a client of a peer's
    /etc/pki/libvirt/private/clientkey.pem  libvirtd (p2p migration, virsh)
    /etc/pki/qemu/ca-cert.pem               QEMU's migration stream
    /etc/pki/qemu/server-cert.pem           (qemu.conf's default
    /etc/pki/qemu/server-key.pem             default_tls_x509_cert_dir):
    /etc/pki/qemu/client-cert.pem           the incoming side's pair, then
    /etc/pki/qemu/client-key.pem            the outgoing side's

Each kind has its own keys and its own role in its subject
(O=thinvm cluster,OU=<role>,CN=<host name>).  libvirtd lets in only
clients whose certificate has the libvirt client role (LIBVIRT_CLIENT_DNS,
its tls_allowed_dn_list): QEMU, which reads /etc/pki/qemu itself as the
user libvirt runs it as (libvirt-qemu), holds certificates of the cluster
CA that libvirtd refuses, so a compromised QEMU cannot drive another
host's libvirt.  libvirt's keys stay root's (0700 directory, 0600 keys);
/etc/pki/qemu and its keys belong to root and QEMU's group (0750, 0640),
as libvirt's TLS documentation asks.

A host's certificates name its address (IP subject alternative name) and
its host name, so a peer connecting to qemu+tls://ADDRESS/system and a
QEMU migrating to ADDRESS both verify them.  The CA key stays in the
cluster directory, readable by root only, and never enters a host tree.
"""

import os
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from thinvm.errors import ThinvmError

DAYS = "3650"
ORG = "thinvm cluster"

SERVER_USAGE = "serverAuth"
CLIENT_USAGE = "clientAuth"

# Who holds a certificate: its subject's OU.
LIBVIRTD = "libvirtd"
LIBVIRT_CLIENT = "libvirt client"
QEMU_MIGRATION = "qemu migration"

# libvirtd's tls_allowed_dn_list: libvirt's client certificates of any host
# (libvirt matches `*` as a glob against the DN as virt-pki-query-dn prints
# it, the subject's fields in the order they were issued).
LIBVIRT_CLIENT_DNS = (f"O={ORG},OU={LIBVIRT_CLIENT},CN=*",)


def ca_dir(root: Path) -> Path:
    return root / "ca"


def _openssl(args: Sequence[str], what: str) -> None:
    proc = subprocess.run(["openssl", *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise ThinvmError(f"openssl: {what} failed: {proc.stderr.strip()}")


def extensions(usage: str, address: str, hostname: str) -> str:
    """X.509v3 extensions of a host certificate (pure; libvirt's sanity
    check wants both key usages on an RSA certificate)."""
    return (
        "basicConstraints = critical, CA:FALSE\n"
        "keyUsage = critical, digitalSignature, keyEncipherment\n"
        f"extendedKeyUsage = {usage}\n"
        f"subjectAltName = IP:{address}, DNS:{hostname}\n"
    )


def make_ca(root: Path) -> tuple[Path, Path]:
    """The cluster CA: (certificate, key)."""
    d = ca_dir(root)
    d.mkdir(parents=True, exist_ok=True)
    d.chmod(0o700)
    cert, key = d / "cacert.pem", d / "cakey.pem"
    _openssl(
        ["req", "-x509", "-new", "-newkey", "rsa:2048", "-nodes", "-days", DAYS,
         "-keyout", str(key), "-out", str(cert),
         "-subj", f"/O={ORG}/CN={ORG} CA",
         "-addext", "basicConstraints = critical, CA:TRUE",
         "-addext", "keyUsage = critical, keyCertSign, cRLSign"],
        "making the cluster CA",
    )  # fmt: skip
    key.chmod(0o600)
    return cert, key


def subject(hostname: str, role: str | None) -> str:
    """A certificate's subject, in openssl's -subj form (pure)."""
    ou = f"/OU={role}" if role else ""
    return f"/O={ORG}{ou}/CN={hostname}"


def issue(
    ca: tuple[Path, Path],
    usage: str,
    address: str,
    hostname: str,
    cert: Path,
    key: Path,
    role: str | None = None,
) -> None:
    """A certificate for `role` on `hostname` at `address`, signed by the CA."""
    ca_cert, ca_key = ca
    with tempfile.TemporaryDirectory(prefix="thinvm-pki-") as tmp:
        csr, ext = Path(tmp) / "req.pem", Path(tmp) / "ext.cnf"
        ext.write_text(extensions(usage, address, hostname))
        old = os.umask(0o077)
        try:
            _openssl(
                ["req", "-new", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                 "-out", str(csr), "-subj", subject(hostname, role)],
                f"a key for {hostname}",
            )  # fmt: skip
        finally:
            os.umask(old)
        _openssl(
            ["x509", "-req", "-in", str(csr), "-CA", str(ca_cert), "-CAkey", str(ca_key),
             "-set_serial", str(int.from_bytes(os.urandom(8), "big")), "-days", DAYS,
             "-extfile", str(ext), "-out", str(cert)],
            f"signing the {usage} certificate of {hostname}",
        )  # fmt: skip


def host_tree(
    pki: Path, ca: tuple[Path, Path], address: str, hostname: str, qemu_gid: int | None = None
) -> None:
    """Write one host's /etc/pki (see the module docstring); `qemu_gid`:
    the group QEMU runs as, given read access to /etc/pki/qemu."""
    private = pki / "libvirt" / "private"
    qemu = pki / "qemu"
    for d in (pki / "CA", private, qemu):
        d.mkdir(parents=True, exist_ok=True)
    private.chmod(0o700)
    qemu.chmod(0o700)
    ca_cert = ca[0].read_bytes()
    (pki / "CA" / "cacert.pem").write_bytes(ca_cert)
    (qemu / "ca-cert.pem").write_bytes(ca_cert)
    for role, usage in (("server", SERVER_USAGE), ("client", CLIENT_USAGE)):
        # libvirt's: the listener's, and the one libvirt shows a peer.
        owner = LIBVIRTD if role == "server" else LIBVIRT_CLIENT
        cert, key = pki / "libvirt" / f"{role}cert.pem", private / f"{role}key.pem"
        issue(ca, usage, address, hostname, cert, key, owner)
        # QEMU's own pair for the same side of a migration stream: keys of
        # its own, a role libvirtd does not let in.
        issue(ca, usage, address, hostname, qemu / f"{role}-cert.pem", qemu / f"{role}-key.pem",
              QEMU_MIGRATION)  # fmt: skip
    if qemu_gid is not None:
        os.chown(qemu, -1, qemu_gid)
        qemu.chmod(0o750)
        for key in qemu.glob("*-key.pem"):
            os.chown(key, -1, qemu_gid)
            key.chmod(0o640)
