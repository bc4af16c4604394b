"""The cluster's certificates: one CA, and per host a server and a client
certificate, laid out where libvirt and QEMU look for them by default.

Inside each host (its mount namespace binds <host>/pki over /etc/pki):

    /etc/pki/CA/cacert.pem                  the cluster CA (libvirtd, virsh)
    /etc/pki/libvirt/servercert.pem         libvirtd's TLS listener
    /etc/pki/libvirt/private/serverkey.pem
    /etc/pki/libvirt/clientcert.pem         this libvirtd as a client of a
    /etc/pki/libvirt/private/clientkey.pem  peer (p2p migration)
    /etc/pki/qemu/ca-cert.pem               QEMU's migration stream
    /etc/pki/qemu/server-cert.pem           (qemu.conf's default
    /etc/pki/qemu/server-key.pem             default_tls_x509_cert_dir)
    /etc/pki/qemu/client-cert.pem
    /etc/pki/qemu/client-key.pem

A host's certificates name its address (IP subject alternative name) and
its host name, so a peer connecting to qemu+tls://ADDRESS/system and a
QEMU migrating to ADDRESS both verify them.  The CA key stays in the
cluster directory, readable by root only, and never enters a host tree.
QEMU reads /etc/pki/qemu itself, as the user libvirt runs it as
(libvirt-qemu): that directory and its keys belong to root and QEMU's
group (0750, 0640), as libvirt's TLS documentation asks.
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


def issue(
    ca: tuple[Path, Path], usage: str, address: str, hostname: str, cert: Path, key: Path
) -> None:
    """A certificate for `hostname` at `address`, signed by the CA."""
    ca_cert, ca_key = ca
    with tempfile.TemporaryDirectory(prefix="thinvm-pki-") as tmp:
        csr, ext = Path(tmp) / "req.pem", Path(tmp) / "ext.cnf"
        ext.write_text(extensions(usage, address, hostname))
        old = os.umask(0o077)
        try:
            _openssl(
                ["req", "-new", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                 "-out", str(csr), "-subj", f"/O={ORG}/CN={hostname}"],
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
    ca_cert = ca[0].read_bytes()
    private = pki / "libvirt" / "private"
    qemu = pki / "qemu"
    for d in (pki / "CA", private, qemu):
        d.mkdir(parents=True, exist_ok=True)
    private.chmod(0o700)
    qemu.chmod(0o700)
    (pki / "CA" / "cacert.pem").write_bytes(ca_cert)
    (qemu / "ca-cert.pem").write_bytes(ca_cert)
    for role, usage in (("server", SERVER_USAGE), ("client", CLIENT_USAGE)):
        cert, key = pki / "libvirt" / f"{role}cert.pem", private / f"{role}key.pem"
        issue(ca, usage, address, hostname, cert, key)
        (qemu / f"{role}-cert.pem").write_bytes(cert.read_bytes())
        copy = qemu / f"{role}-key.pem"
        copy.write_bytes(key.read_bytes())
        copy.chmod(0o600)
    if qemu_gid is not None:
        os.chown(qemu, -1, qemu_gid)
        qemu.chmod(0o750)
        for key in qemu.glob("*-key.pem"):
            os.chown(key, -1, qemu_gid)
            key.chmod(0o640)
