"""CLI inputs that used to end in a traceback (issue 46, item 12).

Each must end in one line that says what was wrong: a usage error (exit
2, argparse's usage and then `thinvm ...: error: ...`) for input the
command line can judge by itself, a `thinvm: error: ...` (exit 1) for
what only the machine can tell.  A VM whose state file cannot be read
is still stopped by `down`.
"""

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from thinvm.cli import main, parse_args
from thinvm.errors import ThinvmError
from thinvm.pool.store import STATE_FILE
from thinvm.qemu import builds
from thinvm.units import MiB
from thinvm.vm import balloon, registry
from thinvm.vm.cli import config_from_args
from thinvm.vm.machine import QMP_MONITORS

NOBODY = 65534  # Debian's `nobody` and `nogroup`


@pytest.fixture
def run_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private THINVM_RUN, so that no real VM of the same name is touched."""
    root = tmp_path / "run"
    root.mkdir()
    monkeypatch.setenv("THINVM_RUN", str(root))
    return root


def usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """`thinvm ARGV` must be refused as a usage error; returns its error line."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, (argv, err)
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("thinvm") and ": error: " in last, err
    return last


def runtime_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """`thinvm ARGV` must fail with exit 1 and one line on stderr."""
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 1, (argv, err)
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("thinvm: error: "), err
    return lines[0]


# -- timeouts ---------------------------------------------------------------


@pytest.mark.parametrize("value", ["nan", "NaN", "inf", "-inf", "0", "-1", "soon", ""])
@pytest.mark.parametrize(
    "argv",
    [
        ["exec", "vm1", "--timeout={}", "--", "true"],
        ["balloon", "vm1", "1G", "--timeout={}"],
        ["resize", "vm1", "1G", "--timeout={}"],
    ],
    ids=["exec", "balloon", "resize"],
)
def test_a_timeout_must_be_a_positive_number_of_seconds(
    argv: list[str], value: str, run_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--timeout nan` reached the agent's socket (settimeout(nan): ValueError)."""
    line = usage_error([a.replace("{}", value) for a in argv], capsys)
    assert "--timeout" in line and "positive number of seconds" in line


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "later"])
def test_a_postcopy_delay_must_be_a_finite_number_of_seconds(
    value: str, run_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = usage_error(["migrate", "vm1", f"--postcopy={value}"], capsys)
    assert "--postcopy" in line and "0 or more seconds" in line


def test_a_good_timeout_still_reaches_the_command(
    run_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = runtime_error(["exec", "vm1", "--timeout", "2.5", "--", "true"], capsys)
    assert "no VM named 'vm1'" in line


# -- what `thinvm up` starts ----------------------------------------------


def test_up_starts_the_balloon_with_deflate_on_oom_unless_told_not_to() -> None:
    """docs/architecture.md, "Balloon safety": on by default for `thinvm up`."""
    assert config_from_args(parse_args(["up"])).balloon.deflate_on_oom is True
    off = config_from_args(parse_args(["up", "--no-deflate-on-oom"]))
    assert off.balloon.deflate_on_oom is False
    assert config_from_args(parse_args(["up", "--deflate-on-oom"])).balloon.deflate_on_oom


def test_the_balloon_floor_is_what_the_guest_uses_plus_headroom() -> None:
    need = balloon.GuestNeed(actual=1024 * MiB, available=600 * MiB)
    assert need.in_use == 424 * MiB
    assert need.floor == 424 * MiB + balloon.GUEST_HEADROOM == 488 * MiB
    # A guest reporting more available than it has (a racing deflate): no use.
    assert balloon.GuestNeed(actual=512 * MiB, available=600 * MiB).in_use == 0


# -- VM names ---------------------------------------------------------------

BAD_NAMES = [
    "x" * 300,  # longer than a file name may be: ENAMETOOLONG from the name's lock
    "é" * 130,  # 260 bytes in UTF-8
    "vm,1",  # a comma ends QEMU's `-name` value
    "vm 1",
    "a/b",
    ".hidden",
    "-dash-first",
    "",
    "x" * (registry.NAME_MAX + 1),
]


@pytest.mark.parametrize("name", BAD_NAMES, ids=lambda n: repr(n[:12]))
@pytest.mark.parametrize(
    "argv",
    [
        ["up", "--name={}"],
        ["status", "--", "{}"],
        ["balloon", "--", "{}", "1G"],
        ["exec", "{}", "--", "true"],
        ["down", "--", "{}"],
    ],
    ids=["up", "status", "balloon", "exec", "down"],
)
def test_a_bad_vm_name_is_a_usage_error(
    argv: list[str], name: str, run_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = usage_error([a.replace("{}", name) for a in argv], capsys)
    if not (argv[0] == "exec" and name.startswith("-")):  # taken for an option
        assert "bad VM name" in line and "letters, digits" in line
    assert list(run_root.iterdir()) == []


def test_the_library_refuses_the_same_names(run_root: Path) -> None:
    for name in BAD_NAMES:
        with pytest.raises(ThinvmError, match="bad VM name"):
            registry.rundir(name)
    longest = "v" * registry.NAME_MAX
    assert registry.rundir(longest) == run_root / longest
    for good in ("vm1", "boot-template", "fresh_stock", "A9"):
        assert registry.rundir(good).name == good


def test_a_vm_name_of_the_longest_kind_gets_the_usual_answer(
    run_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    name = "v" * registry.NAME_MAX
    assert f"no VM named '{name}'" in runtime_error(["status", name], capsys)


# -- down with a state file it cannot read ----------------------------------


def start_bare_qemu(rundir: Path, name: str, pidfile: bool) -> subprocess.Popen[bytes]:
    """A real QEMU as `thinvm up` names it (no machine, no guest), with its
    pid file and QMP sockets in the VM's run directory."""
    rundir.mkdir(parents=True)
    args = [str(builds.find_build("stock").binary), "-name", f"thinvm-{name}"]
    args += ["-machine", "none", "-nodefaults", "-display", "none"]
    for i in range(QMP_MONITORS):
        sock = rundir / ("qmp.sock" if i == 0 else f"qmp-{i}.sock")
        args += ["-qmp", f"unix:{sock},server=on,wait=off"]
    if pidfile:
        args += ["-pidfile", str(rundir / "qemu.pid")]
    qemu = subprocess.Popen(args, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while not (rundir / "qmp.sock").exists() or (pidfile and not (rundir / "qemu.pid").exists()):
        assert qemu.poll() is None, qemu.stderr.read() if qemu.stderr else ""
        assert time.monotonic() < deadline, "QEMU did not create its sockets"
        time.sleep(0.05)
    return qemu


@pytest.fixture
def qemu_procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


@pytest.mark.parametrize(
    ("state", "pidfile"),
    [
        ("{not json", True),
        ("", True),
        ('{"pid": "twelve", "config": {}}', True),
        ('{"config": {"name": "x", "no_such_field": 1}}', False),
        (None, True),  # a state.json that is a directory: EISDIR
    ],
    ids=["garbage", "empty", "bad-pid", "unknown-field-no-pidfile", "a-directory"],
)
def test_down_stops_the_qemu_of_a_vm_whose_state_file_is_unreadable(
    state: str | None,
    pidfile: bool,
    run_root: Path,
    qemu_procs: list[subprocess.Popen[bytes]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Without a pid file, the QEMU is found as the peer of its QMP socket."""
    name = "broken"
    rundir = run_root / name
    qemu = start_bare_qemu(rundir, name, pidfile)
    qemu_procs.append(qemu)
    if state is None:
        (rundir / "state.json").mkdir()
    else:
        (rundir / "state.json").write_text(state)
    # `status` says what is wrong in one line, and what to do.
    line = runtime_error(["status", name], capsys)
    assert "state file" in line and f"'thinvm down {name}'" in line

    assert main(["down", name]) == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    assert f"{name}: down" in out
    assert "state file" in err and f"killed QEMU pid {qemu.pid}" in err, err
    assert qemu.wait(10) is not None
    assert not rundir.exists() and registry.names() == []


def test_down_leaves_a_process_alone_that_is_not_this_vms_qemu(
    run_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A pid file whose pid was reused by another process: nothing is killed."""
    name = "stale"
    rundir = run_root / name
    rundir.mkdir()
    (rundir / "state.json").write_text("{")
    other = subprocess.Popen(["sleep", "60"])
    try:
        (rundir / "qemu.pid").write_text(f"{other.pid}\n")
        assert main(["down", name]) == 0
        err = capsys.readouterr().err
        assert "state file" in err and "no QEMU of this VM" in err, err
        assert other.poll() is None
        assert not rundir.exists()
    finally:
        other.kill()
        other.wait()


# -- a warm pool the user may not use ---------------------------------------


def run_as_nobody(argv: list[str], output: Path) -> int:
    """`thinvm ARGV` in a forked child that runs as nobody; its stdout and
    stderr go to `output`.  A fork, not a new interpreter: the venv is
    under /root, which nobody may not enter."""
    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 70
        try:
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            sys.stdout = sys.stderr = open(fd, "w", buffering=1)  # noqa: SIM115
            os.setgroups([])
            os.setresgid(NOBODY, NOBODY, NOBODY)
            os.setresuid(NOBODY, NOBODY, NOBODY)
            code = main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            sys.stderr.flush()
            os._exit(code)
    os.close(fd)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A directory nobody can reach (pytest's tmp_path is under a 0700 one)."""
    path = Path(tempfile.mkdtemp(prefix="thinvm-test-cli-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_up_from_a_pool_the_user_may_not_write_says_so(
    shared_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A non-root `thinvm up --pool ROOT` on root's pool (the system pool's
    place, /var/lib/thinvm/pool): one line saying who may use it."""
    assert os.geteuid() == 0, "this test changes to the nobody user"
    pool = shared_tmp / "pool"
    pool.mkdir()
    (pool / STATE_FILE).write_text("{}\n")  # a pool exists here, root's
    run_root = shared_tmp / "run"
    run_root.mkdir(mode=0o1777)
    run_root.chmod(0o1777)
    monkeypatch.setenv("THINVM_RUN", str(run_root))
    output = shared_tmp / "output"
    code = run_as_nobody(
        ["up", "--name", "pooled", "--memory", "512M", "--pool", str(pool)], output
    )
    text = output.read_text()
    assert "Traceback" not in text, text
    assert code == 1, text
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    assert lines[0].startswith("thinvm: error: ")
    assert f"warm pool at {pool}" in lines[0] and "permission" in lines[0].lower()
    assert "--pool" in lines[0]
    assert not (run_root / "pooled").exists()
