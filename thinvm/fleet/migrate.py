"""Live migration between cluster hosts through libvirt, and the thinvm
counters libvirt does not report.

Migration is peer-to-peer (`virsh migrate --live --p2p --tls`): the
source libvirtd connects to the destination's TLS listener itself, as it
would between real hosts, and QEMU streams, over TLS, to the
destination's migration address (qemu.conf migration_host).  libvirt knows nothing of sparse-ram:
its `domjobinfo --completed` keeps only the fields it parses, and the
source QEMU is gone when the job completes.  So while the job runs,
`query-migrate` is read every 20 ms from the source QEMU through thinvm's
own QMP monitor (domain.monitor_path, a second monitor next to
libvirt's); the last answer before completion holds `sparse-skipped`
(counted on the first pass, final long before the end).  Domains without
that monitor are polled through `virsh qemu-monitor-command`, which
spawns a client per call and can miss a short job.
"""

import contextlib
import json
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from thinvm.errors import ThinvmError
from thinvm.fleet import emulator
from thinvm.fleet.cluster import Host, virsh
from thinvm.fleet.domain import BALLOON_QOM_PATH, is_portable, monitor_path
from thinvm.qemu.monitor import Monitor

BALLOON_COUNTERS = ("range-requests", "range-discards", "guest-errors")
POLL_INTERVAL = 0.02


def qmp(host: Host, name: str, command: str, **arguments: Any) -> Any:
    """One QMP command through libvirt (which owns the monitor)."""
    msg: dict[str, Any] = {"execute": command}
    if arguments:
        msg["arguments"] = arguments
    reply = json.loads(virsh(host, "qemu-monitor-command", name, json.dumps(msg)))
    if "error" in reply:
        raise ThinvmError(f"{host.name}: {command}: {reply['error'].get('desc', reply['error'])}")
    return reply.get("return")


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

    def summary(self) -> dict[str, Any]:
        return {
            "seconds": round(self.seconds, 3),
            "from": self.source,
            "to": self.destination,
            "sparse-skipped": self.ram.get("sparse-skipped"),
            "sparse-zero": self.ram.get("sparse-zero"),
            "transferred": self.ram.get("transferred"),
            "libvirt": self.job,
            "capabilities": self.capabilities,
        }


class _SourcePoller(threading.Thread):
    """Reads query-migrate from the source QEMU until told to stop."""

    def __init__(self, host: Host, name: str) -> None:
        super().__init__(daemon=True)
        self.host, self.name = host, name
        self.stop = threading.Event()
        self.ram: dict[str, int] = {}
        self.caps: dict[str, bool] = {}
        self.polls = 0

    def run(self) -> None:
        path = self.host.outside(monitor_path(self.name))
        if not path.exists():
            self._poll(lambda cmd: qmp(self.host, self.name, cmd), give_up_on_error=False)
            return
        mon = Monitor(f"thinvm-poll-{self.name}")
        try:
            mon.connect(str(path))
            self._poll(lambda cmd: mon.cmd(cmd, timeout=10), give_up_on_error=True)
        except ThinvmError:
            pass  # no source QEMU to ask: the job is over or never started
        finally:
            mon.close()

    def _poll(self, ask: Callable[[str], Any], give_up_on_error: bool) -> None:
        """Ask until stopped; on our own monitor an error means the source
        QEMU is gone (libvirt ended it after the switch-over)."""
        with contextlib.suppress(ThinvmError):
            caps = ask("query-migrate-capabilities")
            self.caps = {c["capability"]: True for c in caps if c["state"]}
        while not self.stop.is_set():
            try:
                info = ask("query-migrate")
            except ThinvmError:
                if give_up_on_error:
                    return
                info = None
            if isinstance(info, dict) and "ram" in info:
                self.ram = {k: v for k, v in info["ram"].items() if isinstance(v, int)}
                self.polls += 1
            self.stop.wait(POLL_INTERVAL)


def set_sparse_ram(source: Host, name: str, on: bool) -> bool:
    """Set sparse-ram in the source QEMU of a portable guest, if it has the
    capability.

    On for multifd only: there any destination, a stock QEMU included,
    takes the pages the source leaves out to be zero, as it does for zero
    pages (QEMU patch 0023), so a guest can leave a thinvm host for one
    not yet upgraded and keep the skipping.  Off otherwise, also when an
    earlier multifd migration that failed left it on: over the main
    channel the destination must take part, and a stock one would refuse
    the stream.  libvirt sets only the capabilities it knows, so this one
    stays as set here.  Returns whether it is on."""
    cap = emulator.sparse_ram_capability()
    caps = {c["capability"]: c["state"] for c in qmp(source, name, "query-migrate-capabilities")}
    if cap not in caps:
        return False  # a stock source: nothing to skip with
    if caps[cap] != on:
        qmp(source, name, "migrate-set-capabilities",
            capabilities=[{"capability": cap, "state": on}])  # fmt: skip
    return on


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
) -> MigrationResult:
    """Live-migrate `name` from `source` to `destination`, peer-to-peer;
    the definition moves with it.  On failure libvirt leaves the guest
    running on the source; the error says so."""
    if source.name == destination.name:
        raise ThinvmError(f"{name} is already on {source.name}")
    args = ["migrate", "--live", "--p2p", "--persistent", "--undefinesource"]
    if destination.tls:
        args.append("--tls")
    if parallel:
        # multifd; its zero-page detection is QEMU's default.
        args += ["--parallel", "--parallel-connections", str(parallel)]
    if is_portable(virsh(source, "dumpxml", name)):
        set_sparse_ram(source, name, on=bool(parallel))
    args += [*extra, name, destination.peer_uri]
    poller = _SourcePoller(source, name)
    poller.start()
    start = time.monotonic()
    try:
        virsh(source, *args, timeout=timeout)
    except ThinvmError as exc:
        raise ThinvmError(_explain_failure(str(exc), source, destination, name)) from exc
    finally:
        poller.stop.set()
        poller.join()
    seconds = time.monotonic() - start
    # The source forgot the domain (--undefinesource); the destination
    # keeps the statistics of the incoming job.
    job = parse_jobinfo(virsh(destination, "domjobinfo", name, "--completed"))
    return MigrationResult(
        seconds, source.name, destination.name, job, poller.ram, poller.polls, poller.caps
    )


def _explain_failure(message: str, source: Host, destination: Host, name: str) -> str:
    where = f"{name} is still running on {source.name}"
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
