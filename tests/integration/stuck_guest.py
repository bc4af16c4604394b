"""What a libvirt guest that stopped answering its agent is doing, for a
failing test's message, taken before the test removes the domain.

An idle guest halts in its idle loop, so a vCPU found at one RIP twice
says little.  What tells a hung guest from a lost message is the virtio
queues (did the guest post buffers the device has not taken, or did the
device use buffers the guest never saw?), the local APIC (is an
interrupt pending, is the timer armed?) and the guest's own view: its
blocked and sleeping tasks, printed on its console by SysRq (the suite's
guests boot with sysrq_always_enabled).
"""

import re
import time
from pathlib import Path

from thinvm.errors import ThinvmError
from thinvm.fleet import guest
from thinvm.fleet.cluster import Host, virsh

# A task dump of a Debian guest under TCG takes 10-20 s on the serial line.
SYSRQ_WAIT = 30.0
QUEUES_PER_DEVICE = 8  # virtio-serial: port 0, control, ports 1-2
AGENT_TASK = "thinvm-agent"
QUEUE_FIELDS = ("inuse", "last_avail_idx", "shadow_avail_idx", "used_idx", "signalled_used")


def hmp(h: Host, name: str, command: str) -> str:
    try:
        return virsh(h, "qemu-monitor-command", "--hmp", name, command, timeout=20)
    except ThinvmError as exc:
        return f"({command}: {exc})"


def guest_u16(h: Host, name: str, address: int) -> str:
    """The 16-bit word at guest physical `address`, as the guest sees it."""
    out = hmp(h, name, f"xp /1hx {address:#x}")
    return out.split(":")[-1].strip() if ":" in out else "?"


def queue_line(h: Host, name: str, path: str, queue: int) -> str | None:
    """One queue's indexes as the device keeps them, then as guest memory
    holds them (avail.idx, used.idx); None past the device's last queue."""
    status = hmp(h, name, f"info virtio-queue-status {path} {queue}")
    if "Error" in status or "queue_index" not in status:
        return None
    fields = dict(re.findall(r"^[ \t]*(\w+):[ \t]+(\S+)", status, re.MULTILINE))
    if int(fields.get("num", "0")) == 0:
        return None
    device = " ".join(f"{k}={fields.get(k, '?')}" for k in QUEUE_FIELDS)
    avail, used = int(fields["avail"], 16), int(fields["used"], 16)
    memory = f"avail.idx={guest_u16(h, name, avail + 2)} used.idx={guest_u16(h, name, used + 2)}"
    return f"{path.split('/')[-2]} q{queue}: {device} | guest memory: {memory}"


def virtio_queues(h: Host, name: str) -> list[str]:
    paths = [
        line.split()[0]
        for line in hmp(h, name, "info virtio").splitlines()
        if line.startswith("/")
    ]  # fmt: skip
    lines = []
    for path in paths:
        for queue in range(QUEUES_PER_DEVICE):
            line = queue_line(h, name, path, queue)
            if line is None:
                break
            lines.append(line)
    return lines


def console_after(console: Path, offset: int, wait: float) -> str:
    """What the guest printed on its console past `offset`, once it has
    been quiet for 2 s (or after `wait`)."""
    deadline = time.monotonic() + wait
    size = offset
    while time.monotonic() < deadline:
        time.sleep(2)
        now = console.stat().st_size if console.exists() else offset
        if now == size and now > offset:
            break
        size = now
    if not console.exists():
        return f"(no console log at {console})"
    with console.open("rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


def agent_tasks(dump: str) -> str:
    """The agent's threads in a SysRq task dump, each with its stack."""
    blocks, keep = [], False
    for line in dump.splitlines():
        if re.search(r"task:\S+\s+state:", line):
            keep = AGENT_TASK in line
        if keep:
            blocks.append(line)
    return "\n".join(blocks) or f"(no {AGENT_TASK} task in the dump)"


def sysrq(h: Host, name: str, console: Path, key: str) -> str:
    """Press Alt-SysRq-KEY and return the console's answer."""
    offset = console.stat().st_size if console.exists() else 0
    try:
        virsh(h, "send-key", name, "KEY_LEFTALT", "KEY_SYSRQ", f"KEY_{key.upper()}")
    except ThinvmError as exc:
        return f"(send-key: {exc})"
    return console_after(console, offset, SYSRQ_WAIT)


def stuck_guest_report(h: Host, name: str, console: Path) -> str:
    """Everything above, as text for an assertion message; never raises,
    so that it cannot hide the failure it describes."""
    try:
        return _report(h, name, console)
    except (ThinvmError, OSError, ValueError) as exc:
        return f"(no diagnosis: {exc})"


def agent_channel(h: Host, name: str) -> str:
    """Where libvirt says the agent's socket is, whether it is there, and
    QEMU's chardevs (a socket chardev says whether a client is connected)."""
    try:
        path = guest.agent_socket(h, name)
        there = f"{path} exists" if path.exists() else f"{path} MISSING"
    except ThinvmError as exc:
        there = f"(no agent socket: {exc})"
    return f"{there}\n{hmp(h, name, 'info chardev').strip()}"


def _report(h: Host, name: str, console: Path) -> str:
    parts = [agent_channel(h, name), hmp(h, name, "info lapic").strip(), *virtio_queues(h, name)]
    blocked = sysrq(h, name, console, "w")
    parts.append("SysRq-w (blocked tasks):\n" + blocked.strip()[-4000:])
    parts.append("SysRq-t, the agent's threads:\n" + agent_tasks(sysrq(h, name, console, "t")))
    return "\n".join(parts)
