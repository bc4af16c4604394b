"""The README's "Using it" block, run as written, and the CLI's own
connection pattern: every command attaches afresh to a running VM.

The README is read at test time, so it cannot drift from what works.
"""

import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import assert_clean_stderr
from thinvm.paths import REPO

pytestmark = pytest.mark.guest

THINVM = str(Path(sys.executable).with_name("thinvm"))
# What each README command must print on stdout (a regular expression).
EXPECTED = {
    "version": r"^stock .*\npatched ",
    "up": r": up \(pid \d+, \w+, 2\.00 GiB",
    "status": r": running, guest 2\.00 GiB, host RSS .* balloon actual",
    "balloon": r": actual 1\.00 GiB after",
    "exec": r'"touched_mib":\s*512',
    "migrate": r": migrated in \d+ ms",
    "down": r": down$",
}


def readme_commands() -> list[list[str]]:
    """The shell lines of the README's "Using it" block, comments dropped."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Using it", 1)[1]
    block = re.search(r"```sh\n(.*?)```", section, re.S)
    assert block, "README has no ```sh block under 'Using it'"
    lines = [line.split("#", 1)[0].strip() for line in block.group(1).splitlines()]
    return [shlex.split(line) for line in lines if line]


def run(
    argv: list[str], env: dict[str, str], timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    assert argv[0] == "thinvm", f"README line does not start with thinvm: {argv}"
    return subprocess.run(
        [THINVM, *argv[1:]],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        stdin=subprocess.DEVNULL,
    )


def check_clean(proc: subprocess.CompletedProcess[str], argv: list[str]) -> None:
    assert proc.returncode == 0, f"{shlex.join(argv)} exited {proc.returncode}: {proc.stderr}"
    assert_clean_stderr(proc.stderr, shlex.join(argv))


@pytest.fixture
def private_run_dir() -> Iterator[dict[str, str]]:
    """VM state in a directory of this test's own; VMs left over are stopped.

    Short on purpose: pytest's tmp_path is too deep for the VMs' UNIX
    sockets (108 bytes at most).
    """
    run = tempfile.mkdtemp(prefix="tv-", dir="/tmp")
    env = {**os.environ, "THINVM_RUN": run}
    yield env
    subprocess.run([THINVM, "down", "--all"], env=env, capture_output=True, timeout=120)
    shutil.rmtree(run, ignore_errors=True)


def test_readme_using_it_block_runs_as_written(private_run_dir: dict[str, str]) -> None:
    commands = readme_commands()
    assert [argv[1] for argv in commands] == list(EXPECTED), "README block changed: update EXPECTED"
    for argv in commands:
        proc = run(argv, private_run_dir)
        check_clean(proc, argv)
        assert re.search(EXPECTED[argv[1]], proc.stdout, re.M), (argv, proc.stdout)


@pytest.mark.parametrize("driver", ["stock", "thinvm"])
def test_each_command_attaches_afresh_across_balloon_changes(
    private_run_dir: dict[str, str], driver: str
) -> None:
    """up, balloon down, exec, balloon up, exec, migrate, exec, down."""
    name = f"fresh-{driver}"
    steps = [
        (
            ["up", "--name", name, "--memory", "1G", "--driver", driver, "--free-page-reporting"],
            r": up \(pid",
        ),
        (["balloon", name, "512M"], r"actual 512\.00 MiB"),
        (["exec", name, "--", "echo", "one"], r"^one$"),
        (["balloon", name, "1G"], r"actual 1\.00 GiB"),
        (["exec", name, "--", "echo", "two"], r"^two$"),
        (["migrate", name], r"migrated in"),
        (["exec", name, "--", "echo", "three"], r"^three$"),
        (["migrate", name, "--postcopy", "0"], r"migrated in .* of it in postcopy$"),
        (["exec", name, "--", "echo", "four"], r"^four$"),
        (["migrate", name], r"migrated in"),
        (["exec", name, "--", "echo", "five"], r"^five$"),
        (["down", name], r": down$"),
    ]
    for args, expected in steps:
        argv = ["thinvm", *args]
        # An agent that stopped answering must fail here, not after 300 s.
        proc = run(argv, private_run_dir, timeout=120)
        check_clean(proc, argv)
        assert re.search(expected, proc.stdout, re.M), (argv, proc.stdout)
