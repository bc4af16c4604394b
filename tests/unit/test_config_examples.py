"""Every argument list the shipped /etc/thinvm files suggest is accepted.

packaging/thinvm/balance.conf and pool.conf are EnvironmentFiles of the
thinvm-balance and thinvm-pool services: their VAR="..." line is what the
service runs with, and their comments suggest other argument lists.  An
example the parser rejects makes a unit that fails at once and, with
Restart=on-failure, restarts for ever; so each one goes through the real
parser here, and the balance controller's through a real `balance run
--dry-run --cycles 0`.
"""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from thinvm.balance import cli as balance_cli
from thinvm.cli import parse_args
from thinvm.paths import REPO
from thinvm.pool.cli import pool_spec

PACKAGING = REPO / "packaging" / "thinvm"
# "#   --slot 8G --count 2    two 8 GiB slots": the arguments end at the
# first run of two or more spaces, where the explanation starts.
EXAMPLE = re.compile(r"^#\s+(--\S.*?)(?:\s{2,}.*)?$")


def examples(conf: Path, variable: str) -> list[list[str]]:
    """The argument lists `conf` suggests: its `variable=` line and each
    commented example line."""
    found = []
    for line in conf.read_text().splitlines():
        if line.startswith(f"{variable}="):
            # systemd takes the quotes off, then splits an unquoted
            # $VARIABLE in ExecStart= at whitespace.
            value = " ".join(shlex.split(line.split("=", 1)[1]))
            found.append(value.split())
        elif match := EXAMPLE.match(line):
            found.append(shlex.split(match.group(1)))
    return found


BALANCE = examples(PACKAGING / "balance.conf", "THINVM_BALANCE_ARGS")
POOL = examples(PACKAGING / "pool.conf", "THINVM_POOL_ARGS")


def test_the_examples_are_found() -> None:
    assert len(BALANCE) >= 3 and ["--connect", "qemu:///system"] in BALANCE
    assert len(POOL) >= 3 and ["--slot", "4G", "--count", "1"] in POOL


def balance_run(tmp_path: Path, args: list[str]) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "thinvm.cli", "balance", "run", *args]
    command += ["--state", str(tmp_path / "state.json")]
    env = {**os.environ, "THINVM_CACHE": str(tmp_path / "cache")}
    return subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=60, check=False
    )


@pytest.mark.parametrize("args", BALANCE, ids=" ".join)
def test_each_balance_conf_example_runs(args: list[str], tmp_path: Path) -> None:
    done = balance_run(tmp_path, [*args, "--dry-run", "--cycles", "0"])
    assert done.returncode == 0, done.stderr
    assert "balance: policy thinvm" in done.stdout, done.stdout


@pytest.mark.parametrize("args", POOL, ids=" ".join)
def test_each_pool_conf_example_parses(args: list[str]) -> None:
    """`pool start` has no dry run: its parser and the spec it builds
    (sizes, counts, interval) are what can be checked without a pool."""
    parsed = parse_args(["pool", "start", *args])
    spec = pool_spec(parsed)
    assert spec.slots, args


@pytest.mark.parametrize(
    "args",
    [
        ["--interval", "0"],
        ["--budget", "48X"],
        ["--cgroup", "machine.slice", "--budget", "48G"],
        ["--floor-fraction", "1.5"],
        ["--cycles", "-1"],
        ["--policy", "no-such-policy"],  # argparse's own usage error
        ["--host-root", "/"],  # without --connect there are no libvirt paths
        ["--connect", "qemu:///system", "--host-root", "/no/such/root"],
    ],
    ids=" ".join,
)
def test_a_bad_configuration_exits_with_the_status_the_unit_does_not_restart_on(
    args: list[str], tmp_path: Path
) -> None:
    done = balance_run(tmp_path, args)
    assert done.returncode == balance_cli.CONFIG_ERROR, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr and "error" in done.stderr, done.stderr
    unit = (PACKAGING / "thinvm-balance.service").read_text()
    prevent = re.search(r"^RestartPreventExitStatus=(.*)$", unit, re.MULTILINE)
    assert prevent is not None, "the unit restarts for ever on a configuration error"
    assert str(balance_cli.CONFIG_ERROR) in prevent.group(1).split()


def test_a_host_root_maps_libvirts_socket_paths_below_it(tmp_path: Path) -> None:
    view = balance_cli.host_path_view(str(tmp_path))
    socket = "/run/libvirt/qemu/channel/1-web/org.thinvm.agent.0"
    assert view(socket) == tmp_path / socket.lstrip("/")
