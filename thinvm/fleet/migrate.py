"""Live migration between cluster hosts through libvirt, and the thinvm
counters libvirt does not report.

Migration is peer-to-peer (`virsh migrate --live --p2p --tls`): the
source libvirtd connects to the destination's TLS listener itself, as it
would between real hosts, and QEMU streams, over TLS, to the
destination's migration address (qemu.conf migration_host).

libvirt knows nothing of sparse-ram: its `domjobinfo --completed` keeps
only the fields it parses, and the source QEMU is gone when the job
completes.  So while the job runs, `query-migrate` is read from the
source QEMU every 20 ms through libvirt, which owns QEMU's monitor, until
the first pass is over (`dirty-sync-count` 2): `sparse-skipped` is
counted on the first pass and final from then on, and the switchover
that follows should not share QEMU's monitor and libvirt's job with
us (thinvm.fleet.trace shows where a migration's time goes).  The domain carries no monitor
of ours (a `-qmp` socket in `<qemu:commandline>`): libvirt would not
manage it, and an operator's tooling (Nova, Proxmox) would not keep it.

How to ask libvirt, measured on a 512 MiB guest migrated between two
cluster hosts, 9 migrations (multifd with 2 channels and the main
channel), against a reference read on a second QMP monitor every 5 ms:

- one `virsh` for the whole job (VirshSession), in interactive mode:
  `qemu-monitor-command` lines written to its stdin, each followed by an
  `echo` of a marker, the answer read back up to the marker.  One
  connection, one RPC per poll: 3.6 ms idle, 18-61 answers per job, and
  the final `sparse-skipped` equal to the reference's every time.  This
  is what we use;
- `virsh qemu-monitor-command` per poll starts a client and a connection
  each time: 27 ms idle, 80-120 ms during a job on the loaded 2-core
  machine, 8-22 answers per job.  It saw the final value in those runs,
  but with the whole first pass (0.7 s here) in a handful of polls, a
  shorter job or a busier host leaves it one or none;
- `virsh qemu-monitor-event` streams QEMU's events on one connection, but
  the migration events (MIGRATION, MIGRATION_PASS) carry a status and a
  pass number, no counters: it could only say when to ask.

Package-installed hosts (a cluster upgraded one host at a time) name their
QEMU by two paths: Debian's /usr/bin/qemu-system-x86_64 and thinvm-qemu's
/usr/lib/thinvm-qemu/bin/qemu-system-x86_64, the latter only where
thinvm-qemu is installed.  A domain's <emulator> travels with it, so a
guest started on a stock host would stay on Debian's QEMU after moving to
an upgraded one, and a guest of an upgraded host could not start on a
stock one at all.  So when the guest's emulator is one of those two and
the destination runs guests on the other (thinvm-qemu where installed,
asked of its libvirt), the migration carries a destination XML (`virsh
migrate --xml` and `--persistent-xml`: `dumpxml --migratable`, live and
inactive, with only <emulator> changed).  libvirt's ABI check does not
cover the emulator; both are QEMU 10.0 with the same machine types.
"""

import contextlib
import json
import os
import re
import select
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from thinvm.errors import ThinvmError
from thinvm.fleet import emulator
from thinvm.fleet.cluster import Host, virsh
from thinvm.fleet.domain import BALLOON_QOM_PATH, THINVM_MACHINE, has_ranges, is_portable
from thinvm.fleet.trace import Trace

BALLOON_COUNTERS = ("range-requests", "range-discards", "guest-errors")
POLL_INTERVAL = 0.02
# The bitmap sync that ends the first pass is the migration's second.
FIRST_PASS_DONE_SYNCS = 2


def _qmp_message(command: str, arguments: dict[str, Any]) -> str:
    msg: dict[str, Any] = {"execute": command}
    if arguments:
        msg["arguments"] = arguments
    return json.dumps(msg)


def _qmp_return(host: Host, command: str, answer: str) -> Any:
    try:
        reply = json.loads(answer)
    except ValueError as exc:
        raise ThinvmError(f"{host.name}: {command}: not a QMP reply: {answer!r}") from exc
    if "error" in reply:
        raise ThinvmError(f"{host.name}: {command}: {reply['error'].get('desc', reply['error'])}")
    return reply.get("return")


def qmp(host: Host, name: str, command: str, **arguments: Any) -> Any:
    """One QMP command through libvirt (which owns the monitor)."""
    answer = virsh(host, "qemu-monitor-command", name, _qmp_message(command, arguments))
    return _qmp_return(host, command, answer)


class SessionEnded(ThinvmError):
    """The virsh of a VirshSession exited (or was killed)."""


class VirshSession:
    """One `virsh` process in interactive mode, kept for many commands: one
    connection to libvirtd instead of a client per command.

    Each command is written to virsh's stdin followed by `echo` of a
    marker; its answer is what virsh prints up to the marker.  virsh's
    line editor echoes every command line after its prompt, so the marker
    is written split by an empty quote (THINVM''-MARK-n), which virsh's
    parser joins: only echo's output has it whole.  Errors (virsh's
    stderr, merged into the same pipe) become ThinvmError."""

    PROMPT = "virsh # "

    def __init__(self, uri: str, label: str) -> None:
        self.label = label  # for messages: the host's name
        self._proc = subprocess.Popen(
            ["virsh", "-q", "-c", uri],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        self._buf = b""
        self._count = 0

    def run(self, *args: str, timeout: float = 30.0) -> str:
        """virsh's output of one command (virsh -q ARGS)."""
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._count += 1
        line = " ".join(_virsh_quote(a) for a in args)
        mark_cmd = f"echo THINVM''-MARK-{self._count}"
        mark = f"THINVM-MARK-{self._count}".encode()
        try:
            self._proc.stdin.write(f"{line}\n{mark_cmd}\n".encode())
            self._proc.stdin.flush()
        except OSError as exc:
            raise SessionEnded(f"{self.label}: virsh session ended ({exc})") from exc
        fd = self._proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while mark not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                self.kill()  # out of step with its answers: of no further use
                raise SessionEnded(f"{self.label}: virsh {args[0]} timed out after {timeout:.0f} s")
            chunk = os.read(fd, 65536)
            if not chunk:
                raise SessionEnded(f"{self.label}: virsh session ended: {self._buf.decode()!r}")
            self._buf += chunk
        head, _, self._buf = self._buf.partition(mark)
        text = head.decode(errors="replace")
        for echoed in (line, mark_cmd):  # the line editor's echo of what we wrote
            text = text.replace(f"{self.PROMPT}{echoed}\n", "")
        out: list[str] = []
        errors: list[str] = []
        for row in text.replace(self.PROMPT, "").split("\n"):
            if row.strip():
                (errors if row.startswith("error:") else out).append(row)
        if errors:
            msg = " ".join(e.removeprefix("error:").strip() for e in errors)
            raise ThinvmError(f"{self.label}: virsh {args[0]}: {msg}")
        return "\n".join(out)

    def kill(self) -> None:
        """End virsh now, e.g. from another thread while it waits on
        libvirt: a command in progress fails with "session ended"."""
        if self._proc.poll() is None:
            self._proc.kill()

    def close(self) -> None:
        """End virsh (EOF on its stdin ends its command loop) and reap it."""
        for stream in (self._proc.stdin, self._proc.stdout):
            with contextlib.suppress(OSError):
                if stream is not None:
                    stream.close()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def __enter__(self) -> "VirshSession":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _virsh_quote(arg: str) -> str:
    """An argument as virsh's command parser reads it back (shell-like)."""
    if arg and all(c.isalnum() or c in "-_.,:/=@%+" for c in arg):
        return arg
    return "'" + arg.replace("'", "'\\''") + "'"


def balloon_counters(host: Host, name: str) -> dict[str, int]:
    """thinvm's balloon counters of this QEMU process (not migrated: they
    count what the QEMU on `host` saw since it started)."""
    out: dict[str, int] = {}
    for prop in BALLOON_COUNTERS:
        try:
            out[prop] = int(qmp(host, name, "qom-get", path=BALLOON_QOM_PATH, property=prop))
        except ThinvmError:
            continue  # stock QEMU: no such property
    return out


@dataclass
class MigrationResult:
    seconds: float
    source: str
    destination: str
    job: dict[str, str]  # virsh domjobinfo --completed, as libvirt prints it
    ram: dict[str, int]  # query-migrate "ram" from the source, last poll
    polls: int
    capabilities: dict[str, bool] = field(default_factory=dict)
    # The destination's <emulator> when the migration changed it (None: kept).
    emulator: str | None = None

    def summary(self) -> dict[str, Any]:
        return {
            "seconds": round(self.seconds, 3),
            "from": self.source,
            "to": self.destination,
            "emulator": self.emulator,
            "sparse-skipped": self.ram.get("sparse-skipped"),
            "sparse-zero": self.ram.get("sparse-zero"),
            "transferred": self.ram.get("transferred"),
            "libvirt": self.job,
            "capabilities": self.capabilities,
        }


class _SourcePoller(threading.Thread):
    """Reads query-migrate from the source QEMU, through libvirt, until the
    first pass is over or it is told to stop."""

    def __init__(self, host: Host, name: str, trace: Trace | None = None) -> None:
        super().__init__(daemon=True)
        self.host, self.name, self.trace = host, name, trace
        self.stop = threading.Event()
        self.ram: dict[str, int] = {}
        self.caps: dict[str, bool] = {}
        self.polls = 0
        self.session = VirshSession(host.uri, host.name)

    def run(self) -> None:
        try:
            with self.session:
                self._poll(self.session)
        except ThinvmError:
            pass  # the session ended: nothing more to read

    def finish(self, grace: float = 5.0) -> None:
        """Stop polling; a poll libvirt holds up (its job lock waits up to
        30 s) is cut short after `grace` seconds."""
        self.stop.set()
        self.join(grace)
        if self.is_alive():
            self.session.kill()
            self.join()

    def _ask(self, session: VirshSession, command: str) -> Any:
        answer = session.run("qemu-monitor-command", self.name, _qmp_message(command, {}))
        return _qmp_return(self.host, command, answer)

    def _poll(self, session: VirshSession) -> None:
        """Ask until stopped.  An error (the domain not yet in its job, or
        gone after the switch-over) is no reason to stop before we are
        told to: libvirt answers again once its job allows it."""
        with contextlib.suppress(ThinvmError):
            caps = self._ask(session, "query-migrate-capabilities")
            self.caps = {c["capability"]: True for c in caps if c["state"]}
        while not self.stop.is_set():
            try:
                info = self._ask(session, "query-migrate")
            except SessionEnded:
                return
            except ThinvmError:
                info = None
            if isinstance(info, dict) and "ram" in info:
                self.ram = {k: v for k, v in info["ram"].items() if isinstance(v, int)}
                self.polls += 1
                if self.ram.get("dirty-sync-count", 0) >= FIRST_PASS_DONE_SYNCS:
                    if self.trace is not None:
                        self.trace.mark("counters read: first pass over, polling stops")
                    return
            self.stop.wait(POLL_INTERVAL)


def clear_sparse_ram(source: Host, name: str) -> None:
    """Turn the sparse-ram capability off in the source QEMU of a portable
    guest, where it is on (set by hand, or by an older thinvm).

    A portable guest needs no capability: over multifd thinvm's QEMU leaves
    unpopulated pages out by itself (QEMU 0017, x-sparse-ram-multifd), for
    any destination, a stock QEMU included (0016).  Over the main channel
    the capability would ask the destination to take part, and a stock
    one refuses the stream."""
    cap = emulator.sparse_ram_capability()
    caps = {c["capability"]: c["state"] for c in qmp(source, name, "query-migrate-capabilities")}
    if caps.get(cap):
        qmp(source, name, "migrate-set-capabilities",
            capabilities=[{"capability": cap, "state": False}])  # fmt: skip


_EMULATOR_RE = re.compile(r"<emulator>([^<]*)</emulator>")


def emulator_of(xml: str) -> str | None:
    match = _EMULATOR_RE.search(xml)
    return match.group(1).strip() if match else None


def with_emulator(xml: str, path: str) -> str:
    """The domain XML with its <emulator> replaced (nothing else touched)."""
    new, count = _EMULATOR_RE.subn(f"<emulator>{path}</emulator>", xml, count=1)
    if count != 1:
        raise ThinvmError("domain XML without <emulator>")
    return new


def destination_emulator(xml: str, destination: Host) -> str | None:
    """The <emulator> the guest of domain XML `xml` needs on `destination`,
    when it differs from the one it runs on; None when the migration keeps
    it (a packaged emulator on both ends, or one thinvm does not manage)."""
    current = emulator_of(xml)
    if current not in {str(p) for p in emulator.PACKAGED}:
        return None
    want = str(emulator.packaged_emulator(destination.uri))
    return None if want == current else want


def check_machine_type(xml: str, new_emulator: str | None, destination: Host, name: str) -> None:
    """Refuse, before anything runs, to move a guest on thinvm's machine
    type (page ranges, negotiated by its driver) to a stock QEMU, which
    lacks the machine type: libvirt would refuse it anyway, later and
    less clearly."""
    if new_emulator == str(emulator.PACKAGED_STOCK) and has_ranges(xml):
        raise ThinvmError(
            f"{name} runs on machine type {THINVM_MACHINE} (page ranges), which the stock "
            f"QEMU of {destination.name} does not have: migrate it to a host with "
            "thinvm-qemu, or start it as a portable guest (machine type q35)"
        )


def _destination_xml(source: Host, name: str, live: str, path: str, work: Path) -> list[str]:
    """`virsh migrate` arguments for a destination XML with `path` as its
    emulator: the live definition (`live`, the source's `dumpxml
    --migratable`) and the persistent one, which libvirt keeps apart."""
    persistent = virsh(source, "dumpxml", "--inactive", "--migratable", name)
    (work / "live.xml").write_text(with_emulator(live, path))
    (work / "persistent.xml").write_text(with_emulator(persistent, path))
    return ["--xml", str(work / "live.xml"), "--persistent-xml", str(work / "persistent.xml")]


def parse_jobinfo(text: str) -> dict[str, str]:
    """`virsh domjobinfo` output as a dict ("Time elapsed" -> "1234 ms")."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip():
            out[key.strip()] = " ".join(value.split())  # "160          ms"
    return out


def migrate(
    source: Host,
    destination: Host,
    name: str,
    parallel: int = 0,
    extra: tuple[str, ...] = (),
    timeout: float = 600.0,
    compress: str | None = None,
    trace: Trace | None = None,
) -> MigrationResult:
    """Live-migrate `name` from `source` to `destination`, peer-to-peer;
    the definition moves with it.  On failure libvirt leaves the guest
    running on the source; the error says so.  `compress`: "zstd" has
    the multifd channels compress the pages they send (needs `parallel`).
    `trace`: thinvm's steps and libvirt's events on both hosts go there."""
    if trace is None:
        return _migrate(source, destination, name, parallel, extra, timeout, compress, None)
    with trace.watching([source, destination], name):
        return _migrate(source, destination, name, parallel, extra, timeout, compress, trace)


def _migrate(
    source: Host,
    destination: Host,
    name: str,
    parallel: int,
    extra: tuple[str, ...],
    timeout: float,
    compress: str | None,
    trace: Trace | None,
) -> MigrationResult:
    def mark(what: str) -> None:
        if trace is not None:
            trace.mark(what)

    mark("checks: route, live XML, emulator, machine type, capabilities")
    check_route(source, destination, name)
    args = ["migrate", "--live", "--p2p", "--persistent", "--undefinesource"]
    if destination.tls:
        args.append("--tls")
    args += multifd_args(parallel, compress)
    # One read of the live XML answers both questions and is the
    # destination XML when the emulator changes: the migratable form keeps
    # <metadata> (portable) and <emulator>, and is what libvirt sends.
    live = virsh(source, "dumpxml", "--migratable", name)
    new_emulator = destination_emulator(live, destination)
    # Refusals first, before anything changes on the source.
    check_machine_type(live, new_emulator, destination, name)
    if is_portable(live):
        clear_sparse_ram(source, name)
    with tempfile.TemporaryDirectory(prefix="thinvm-migrate-") as tmp:
        if new_emulator:
            args += _destination_xml(source, name, live, new_emulator, Path(tmp))
        args += [*extra, name, destination.peer_uri]
        poller = _SourcePoller(source, name, trace)
        poller.start()
        mark("virsh migrate called")
        start = time.monotonic()
        try:
            virsh(source, *args, timeout=timeout)
        except ThinvmError as exc:
            raise ThinvmError(_explain_failure(str(exc), source, destination, name)) from exc
        finally:
            poller.finish()
        seconds = time.monotonic() - start
        mark("virsh migrate returned")
    # The source forgot the domain (--undefinesource); the destination
    # keeps the statistics of the incoming job.
    job = parse_jobinfo(virsh(destination, "domjobinfo", name, "--completed"))
    mark("job statistics read")
    return MigrationResult(
        seconds, source.name, destination.name, job, poller.ram, poller.polls, poller.caps,
        new_emulator,
    )  # fmt: skip


COMPRESS_METHODS = ("zstd",)


def check_route(source: Host, destination: Host, name: str) -> None:
    if source.name == destination.name:
        raise ThinvmError(f"{name} is already on {source.name}")


def check_multifd(parallel: int, compress: str | None) -> None:
    """Refuse multifd options virsh would refuse, before anything runs.
    Compression is a multifd feature in QEMU 10.0 (the legacy `compress`
    capability is gone), so it needs channels.  zstd is the method we
    measured (migrate-compress: it pays on slow links and costs source
    CPU on fast ones, so it is off unless asked for); zlib lost there."""
    if parallel < 0:
        raise ThinvmError(f"--parallel {parallel}: want 0 (off) or a number of connections")
    if compress is not None and compress not in COMPRESS_METHODS:
        raise ThinvmError(f"--compress {compress}: want one of {', '.join(COMPRESS_METHODS)}")
    if compress and not parallel:
        raise ThinvmError(
            f"--compress {compress} needs --parallel N: QEMU compresses only multifd channels"
        )


def multifd_args(parallel: int, compress: str | None) -> list[str]:
    """virsh migrate's multifd flags (check_multifd's rules)."""
    check_multifd(parallel, compress)
    if not parallel:
        return []
    # multifd; its zero-page detection is QEMU's default.
    args = ["--parallel", "--parallel-connections", str(parallel)]
    if compress:
        args += ["--compressed", "--comp-methods", compress]
    return args


def _explain_failure(message: str, source: Host, destination: Host, name: str) -> str:
    where = f"{name} is still running on {source.name}"
    if THINVM_MACHINE in message:
        return (
            f"migration to {destination.name} refused: its QEMU does not have the "
            f"{THINVM_MACHINE} machine type (a stock emulator?); {where}. "
            f"libvirt said: {message}"
        )
    if "sparse-ram" in message:
        return (
            f"migration to {destination.name} refused: its QEMU does not have the "
            f"sparse-ram capability (a stock emulator?); {where}. libvirt said: {message}"
        )
    return f"migration {source.name} -> {destination.name} failed: {message}; {where}"


def job_bytes(job: dict[str, str]) -> int | None:
    """Bytes libvirt says it moved ("Data processed: 123.456 MiB")."""
    value = job.get("Data processed") or job.get("Memory processed")
    if not value:
        return None
    num, _, unit = value.partition(" ")
    scale = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
    try:
        return int(float(num) * scale[unit.strip()])
    except (KeyError, ValueError):
        return None


def run_quiet(cmd: list[str]) -> None:
    subprocess.run(cmd, check=False, capture_output=True)
