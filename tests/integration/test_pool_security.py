"""The warm pool against a local user who gets to its slot directory first.

The tmpfs slots live in /dev/shm, which every user may write.  These
tests play the attack for real: the user `nobody` (by setpriv) makes the
pool's directory before root starts the pool, then swaps a slot file for
a symlink to a file of root's.  Whatever the pool does, that file must
come out byte for byte as it went in, and the pool must say why it
refused.
"""

import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import thinvm_cli
from thinvm import pool

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="plays root against nobody")

NOBODY = "nobody"
NOBODY_UID = pwd.getpwnam(NOBODY).pw_uid
# Known content, longer than a block, so that a punch or a truncate shows.
SECRET = b"root's own data, not a guest's\n" * 4096


def as_nobody(*cmd: str) -> None:
    """Run `cmd` as the real user nobody (no groups of root's)."""
    setpriv = ["setpriv", f"--reuid={NOBODY}", "--regid=nogroup", "--clear-groups", "--"]
    proc = subprocess.run([*setpriv, *cmd], capture_output=True, text=True)
    assert proc.returncode == 0, f"as nobody: {' '.join(cmd)}: {proc.stderr}"


@pytest.fixture
def victim() -> Iterator[Path]:
    """A file of root's, in a directory only root may enter, holding SECRET."""
    directory = Path(tempfile.mkdtemp(prefix="thinvm-victim-"))
    path = directory / "precious"
    path.write_bytes(SECRET)
    path.chmod(0o600)
    yield path
    shutil.rmtree(directory)


@pytest.fixture
def pool_root(tmp_path: Path) -> Iterator[Path]:
    """A private pool's state directory; its slot directory is removed after."""
    root = tmp_path / f"pool-sec-{os.getpid()}"
    yield root
    if pool.Pool(root).exists():
        thinvm_cli("pool", "stop", "--root", str(root), "--force")
    shutil.rmtree(slot_directory(root), ignore_errors=True)


def slot_directory(root: Path) -> Path:
    """Where a tmpfs pool with state directory `root` keeps its slots."""
    return Path(pool.TMPFS_DIR) / f"thinvm-{root.name}"


def start_args(root: Path, command: str = "start") -> list[str]:
    args = ["pool", command, "--root", str(root), "--slot", "4M", "--kind", "tmpfs"]
    return [*args, "--watermark", "0", "--no-cgroup"]


def test_pool_start_refuses_a_slot_directory_another_user_made(pool_root: Path) -> None:
    files = slot_directory(pool_root)
    as_nobody("mkdir", "-m", "777", str(files))
    start = thinvm_cli(*start_args(pool_root), "--detach")
    assert start.returncode == 1, start.stdout + start.stderr
    owner = f"slot directory {files} belongs to uid {NOBODY_UID} ({NOBODY}), not to uid 0"
    assert owner in start.stderr
    assert f"rm -r {files}" in start.stderr  # what to do about it
    assert os.listdir(files) == [], "the pool put files in a directory it refused"
    assert not pool.Pool(pool_root).exists()


def test_a_symlink_planted_in_the_slot_directory_never_reaches_root_files(
    pool_root: Path, victim: Path
) -> None:
    """The whole attack: nobody makes the directory, root starts the pool,
    nobody swaps slot 0 for a symlink to root's file, root stops the pool
    (which punches every slot).  The file must be untouched."""
    files = slot_directory(pool_root)
    as_nobody("mkdir", "-m", "777", str(files))
    start = thinvm_cli(*start_args(pool_root), "--detach")
    if start.returncode == 0:
        pool.wait_free(pool_root, timeout=60)
        as_nobody("ln", "-sfn", str(victim), str(files / "slot-0.mem"))
        thinvm_cli("pool", "stop", "--root", str(pool_root))
    assert victim.read_bytes() == SECRET, "root's file was punched through the pool's slot"


def test_stop_leaves_alone_the_slots_of_a_directory_it_no_longer_owns(
    pool_root: Path, victim: Path
) -> None:
    """A pool whose slot directory changed hands since it started (or that
    an earlier thinvm set up in someone else's directory): stop gives back
    what it set up and touches nothing in that directory."""
    fill = thinvm_cli(*start_args(pool_root, "fill"))
    assert fill.returncode == 0, fill.stderr
    files = slot_directory(pool_root)
    os.chown(files, NOBODY_UID, -1)
    files.chmod(0o777)
    as_nobody("ln", "-sfn", str(victim), str(files / "slot-0.mem"))
    stop = thinvm_cli("pool", "stop", "--root", str(pool_root))
    assert victim.read_bytes() == SECRET, "root's file was punched through the pool's slot"
    assert stop.returncode == 0, stop.stderr
    assert "pool stopped: 0 slots removed" in stop.stdout
    assert f"slot files in {files} left alone: it belongs to uid {NOBODY_UID}" in stop.stderr
    assert not pool.Pool(pool_root).exists()
