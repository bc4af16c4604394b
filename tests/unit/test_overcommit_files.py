"""The overcommit benchmark's swap file and scratch disk: made where no other user can reach.

They used to sit in /var/tmp (everyone's) under names known in advance
(`thinvm-overcommit-PID.swap`, `.img`): another user could make the file
first, keep it open, and read what root later wrote to it.
"""

import os
import pwd
import stat
import subprocess
from pathlib import Path

import pytest

from thinvm.bench.scenarios.overcommit import (
    SPEC,
    RunFiles,
    create_private_file,
    make_overcommit,
    run_files,
)
from thinvm.bench.types import BenchOptions
from thinvm.units import GiB, MiB

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="plays root against nobody")

NOBODY = pwd.getpwnam("nobody").pw_uid


def test_the_scratch_disk_never_goes_into_a_file_another_user_made() -> None:
    """nobody makes the file at the name the run used to pick; the run must
    neither write to it nor use it."""
    planted = Path("/var/tmp") / f"thinvm-overcommit-{os.getpid()}.img"
    setpriv = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--"]
    subprocess.run(
        [*setpriv, "sh", "-c", f"umask 0; : > {planted}"], check=True, capture_output=True
    )
    try:
        params = {**SPEC.params, "read": "4M", "rounds": "1", "swap": "0"}
        scenario = make_overcommit(BenchOptions(), params, 1 * GiB)
        assert scenario.context is not None
        with scenario.context():
            st = os.lstat(planted)
            assert (st.st_uid, st.st_size) == (NOBODY, 0), "root wrote its disk into nobody's file"
        assert planted.exists(), "the run removed a file it did not make"
    finally:
        planted.unlink(missing_ok=True)


def test_run_files_live_in_a_fresh_directory_only_root_may_enter(tmp_path: Path) -> None:
    files = RunFiles()
    with run_files(files, 0, 4 * MiB, parent=tmp_path):
        assert files.directory is not None and files.directory.parent == tmp_path
        directory = os.lstat(files.directory)
        assert stat.S_ISDIR(directory.st_mode) and stat.S_IMODE(directory.st_mode) == 0o700
        assert directory.st_uid == os.geteuid()
        disk = os.lstat(files.disk)
        assert stat.S_IMODE(disk.st_mode) == 0o600 and disk.st_size == 4 * MiB
        made = files.directory
    assert files.directory is None and not made.exists()
    with pytest.raises(Exception, match="not set up yet"):
        _ = files.disk


def test_a_private_file_is_new_whole_and_0600(tmp_path: Path) -> None:
    path = tmp_path / "swap"
    create_private_file(path, 8 * MiB)
    st = os.lstat(path)
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_size == 8 * MiB and st.st_blocks * 512 >= 8 * MiB  # no holes: swapon needs none
    with pytest.raises(FileExistsError):
        create_private_file(path, 8 * MiB)
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(FileExistsError):
        create_private_file(link, 8 * MiB)
    assert not (tmp_path / "elsewhere").exists()
