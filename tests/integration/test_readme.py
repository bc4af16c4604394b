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
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import assert_clean_stderr
from thinvm.balance.daemon import load_status
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


# The controller beside the README's VM: every decision logged (-v), and a
# floor above the README's `balloon vm1 1G`, so that handing the VM back
# makes it act at once, whatever the host's pressure.
CONTROLLER = ["balance", "run", "--interval", "1", "--floor", "1536M", "-v"]
# What the controller must never log while it shares the VM with the CLI.
CONTROLLER_ERRORS = ("cannot connect", "not sampled", "cannot attach", "FAILED", "Traceback")


def start_controller(env: dict[str, str], state: Path, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(
            [THINVM, *CONTROLLER, "--state", str(state)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )


def wait_for_log(log: Path, pattern: str, after: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if re.search(pattern, log.read_text()[after:], re.M):
            return
        time.sleep(0.2)
    raise AssertionError(f"controller logged no {pattern!r}:\n{log.read_text()[after:][-3000:]}")


def test_readme_using_it_block_runs_as_written_beside_the_controller(
    private_run_dir: dict[str, str], tmp_path: Path
) -> None:
    """The README block, unchanged, while `thinvm balance run` manages its VM."""
    commands = readme_commands()
    assert [argv[1] for argv in commands] == list(EXPECTED), "README block changed: update EXPECTED"
    state, log = tmp_path / "balance.json", tmp_path / "balance.log"
    controller = start_controller(private_run_dir, state, log)
    try:
        for argv in commands:
            if argv[1] == "down":
                check_controller_acts_after_migrate(argv[2], private_run_dir, log)
            proc = run(argv, private_run_dir)
            check_clean(proc, argv)
            assert re.search(EXPECTED[argv[1]], proc.stdout, re.M), (argv, proc.stdout)
        # The controller runs on without the VM it managed.
        cycle = load_status(state)["cycle"]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and load_status(state)["cycle"] < cycle + 2:
            time.sleep(0.2)
        status = load_status(state)
        assert status["cycle"] >= cycle + 2 and status["vms"] == {}, status
        assert controller.poll() is None, f"controller exited:\n{log.read_text()[-3000:]}"
    finally:
        controller.terminate()
        controller.wait(30)
    text = log.read_text()
    for word in CONTROLLER_ERRORS:
        assert word not in text, f"controller logged {word!r}:\n{text[-4000:]}"


def check_controller_acts_after_migrate(name: str, env: dict[str, str], log: Path) -> None:
    """After the README's balloon and migrate: the controller left the VM at the
    operator's 1 GiB and now manages the QEMU that took over; handed back,
    it acts on it (restores its 1.5 GiB floor)."""
    mark = len(log.read_text())
    wait_for_log(log, rf"cycle \d+ {name}: held at 1\.00 GiB by an operator", mark)
    argv = ["thinvm", "balloon", name, "auto"]
    proc = run(argv, env)
    check_clean(proc, argv)
    wait_for_log(log, rf"cycle \d+ {name}: set 1\.00 GiB -> 1\.50 GiB: below its floor", mark)


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
        # After `--` the guest gets the argv word for word ...
        (
            ["exec", name, "--", "printf", "[%s]", "a  b", "it's", '"q"', "$HOME", ">x", "a;b"],
            r"""^\[a  b\]\[it's\]\["q"\]\[\$HOME\]\[>x\]\[a;b\]$""",
        ),
        # ... and shell syntax is the guest shell's when asked for.
        (
            ["exec", name, "--", "sh", "-c", "dd if=/dev/zero bs=1k count=3 2>/dev/null | wc -c"],
            r"^ *3072$",
        ),
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
        if args[0] == "migrate" and len(args) == 2:
            proc = run_beside_others(argv, name, private_run_dir)
        else:
            # An agent that stopped answering must fail here, not after 300 s.
            proc = run(argv, private_run_dir, timeout=120)
        check_clean(proc, argv)
        assert re.search(expected, proc.stdout, re.M), (argv, proc.stdout)


def run_beside_others(
    argv: list[str], name: str, env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    """`argv` while other commands use the same VM: a long guest command and
    a quick one take turns on the agent, status gets a monitor of its own."""
    others = {
        ("exec", name, "--", "sh", "-c", "sleep 2; echo slow"): r"^slow$",
        ("exec", name, "--", "echo", "quick"): r"^quick$",
        # The source, or the QEMU that took over: never an error.
        ("status", name): r": (running|postmigrate), guest",
    }
    procs = [
        subprocess.Popen(
            [THINVM, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for args in others
    ]
    main = run(argv, env, timeout=120)
    for (args, expected), proc in zip(others.items(), procs, strict=True):
        out, err = proc.communicate(timeout=120)
        done = subprocess.CompletedProcess(args, proc.returncode, out, err)
        check_clean(done, ["thinvm", *args])
        assert re.search(expected, out, re.M), (args, out)
    return main
