"""The CPU time of threads as they exit, from the kernel's taskstats.

A thread's CPU time can be read from /proc only while it lives: once it
has exited its time is folded into its process's total, without its name.
A thread that starts and exits between two reads of /proc (a fast
migration's multifd channels do) is never seen at all.  The kernel's
taskstats interface (Documentation/accounting/taskstats.rst) sends every
task's final accounting to the listeners registered for the CPU it exits
on, over generic netlink; this module registers for every CPU and keeps the
records of the processes asked for.  tools/accounting/getdelays.c in the
kernel tree is the reference client.

Registering needs CAP_NET_ADMIN (root), a kernel built with
CONFIG_TASKSTATS, and taskstats version 12 or later (the first that names
a record's thread group, `ac_tgid`); where any is missing, ExitListener
raises TaskstatsUnavailable.
"""

import contextlib
import errno
import os
import select
import socket
import struct
import threading
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

from thinvm.host import HostError

NETLINK_GENERIC = 16  # linux/netlink.h; Python's socket module lacks it

# linux/netlink.h
NLMSG_ERROR = 2
NLM_F_REQUEST = 0x1
NLM_F_ACK = 0x4
_NLMSGHDR = struct.Struct("=IHHII")  # length, type, flags, sequence, port id
_NLATTR = struct.Struct("=HH")  # length, type
_NLA_TYPE_MASK = 0x3FFF  # without NLA_F_NESTED and NLA_F_NET_BYTEORDER

# linux/genetlink.h
GENL_ID_CTRL = 0x10
CTRL_CMD_GETFAMILY = 3
CTRL_ATTR_FAMILY_ID = 1
CTRL_ATTR_FAMILY_NAME = 2
_GENLMSGHDR = struct.Struct("=BBH")  # command, version, reserved

# linux/taskstats.h
TASKSTATS_GENL_NAME = "TASKSTATS"
TASKSTATS_GENL_VERSION = 1
TASKSTATS_CMD_GET = 1
TASKSTATS_CMD_NEW = 2
TASKSTATS_CMD_ATTR_PID = 1
TASKSTATS_CMD_ATTR_REGISTER_CPUMASK = 3
TASKSTATS_CMD_ATTR_DEREGISTER_CPUMASK = 4
TASKSTATS_TYPE_PID = 1
TASKSTATS_TYPE_STATS = 3
TASKSTATS_TYPE_AGGR_PID = 4

# Offsets in struct taskstats (include/uapi/linux/taskstats.h, x86-64 and
# every other ABI that aligns __u64 to 8: the header pins the alignment with
# __attribute__((aligned(8))) where it matters).  Fields are only appended,
# so the offsets hold for every version from the one that added them.
_VERSION = struct.Struct("=H")  # version, offset 0
_U64 = struct.Struct("=Q")
_RUNTIME_OFFSET = 72  # __u64 cpu_run_virtual_total [ns]
_COMM_OFFSET, _COMM_LEN = 80, 32  # char ac_comm[TS_COMM_LEN]
_PID = struct.Struct("=I")  # __u32 ac_pid, offset 128
_PID_OFFSET = 128
_TIMES = struct.Struct("=QQ")  # __u64 ac_utime, ac_stime [usec], offset 152
_TIMES_OFFSET = 152
_TGID_OFFSET = 368  # __u32 ac_tgid, version 12 on
TGID_VERSION = 12

# Root may raise its receive buffer past net.core.rmem_max: every task that
# exits on the host is sent to us, and a build on the next core can end
# hundreds a second.
_RECEIVE_BUFFER = 8 << 20
_SO_RCVBUFFORCE = 33  # asm-generic/socket.h; Python's socket module lacks it


class TaskstatsUnavailable(HostError):
    """The kernel will not send this process exit records."""


@dataclass(frozen=True)
class TaskExit:
    """A thread's accounting as it exited: its name (comm) and CPU time in all."""

    tid: int
    tgid: int
    name: str
    cpu_s: float  # user + system


# -- netlink messages ----------------------------------------------------------


def _align(length: int) -> int:
    return (length + 3) & ~3


def attribute(kind: int, payload: bytes) -> bytes:
    """One netlink attribute, padded to 4 bytes."""
    length = _NLATTR.size + len(payload)
    return (_NLATTR.pack(length, kind) + payload).ljust(_align(length), b"\0")


def parse_attributes(data: bytes) -> Iterator[tuple[int, bytes]]:
    """(type, payload) of each attribute in `data`, flags masked off the type."""
    offset = 0
    while offset + _NLATTR.size <= len(data):
        length, kind = _NLATTR.unpack_from(data, offset)
        if length < _NLATTR.size:
            return
        yield kind & _NLA_TYPE_MASK, data[offset + _NLATTR.size : offset + length]
        offset += _align(length)


def genl_request(family: int, command: int, attributes: bytes, seq: int, flags: int = 0) -> bytes:
    """A generic netlink request to `family`."""
    body = _GENLMSGHDR.pack(command, TASKSTATS_GENL_VERSION, 0) + attributes
    header = _NLMSGHDR.pack(_NLMSGHDR.size + len(body), family, NLM_F_REQUEST | flags, seq, 0)
    return header + body


def parse_messages(data: bytes) -> Iterator[tuple[int, int, bytes]]:
    """(type, sequence, payload) of each netlink message in one datagram."""
    offset = 0
    while offset + _NLMSGHDR.size <= len(data):
        length, kind, _flags, seq, _port = _NLMSGHDR.unpack_from(data, offset)
        if length < _NLMSGHDR.size:
            return
        yield kind, seq, data[offset + _NLMSGHDR.size : offset + length]
        offset += _align(length)


def netlink_error(payload: bytes) -> int:
    """The errno of an NLMSG_ERROR message (0: an acknowledgement)."""
    return -int.from_bytes(payload[:4], "little", signed=True)


# -- taskstats records ---------------------------------------------------------


def parse_taskstats(stats: bytes) -> TaskExit:
    """The thread, its thread group, name and CPU time from a struct taskstats.

    The CPU time is the scheduler's (cpu_run_virtual_total: nanoseconds
    on a CPU), the figure /proc scales a thread's user and system ticks to;
    ac_utime + ac_stime are those ticks unscaled, a 4 ms tick for a thread
    that ran 2 ms or none at all, and stand in only on a kernel without
    CONFIG_TASK_DELAY_ACCT, which leaves the former zero.
    """
    (version,) = _VERSION.unpack_from(stats)
    if version < TGID_VERSION or len(stats) < _TGID_OFFSET + 4:
        raise TaskstatsUnavailable(
            f"the kernel's taskstats version {version} does not say which process a thread"
            f" belongs to (version {TGID_VERSION} does): thread CPU is estimated"
        )
    comm = stats[_COMM_OFFSET : _COMM_OFFSET + _COMM_LEN].split(b"\0", 1)[0]
    (tid,) = _PID.unpack_from(stats, _PID_OFFSET)
    (tgid,) = _PID.unpack_from(stats, _TGID_OFFSET)
    (runtime_ns,) = _U64.unpack_from(stats, _RUNTIME_OFFSET)
    utime_us, stime_us = _TIMES.unpack_from(stats, _TIMES_OFFSET)
    cpu_s = runtime_ns / 1e9 if runtime_ns else (utime_us + stime_us) / 1e6
    return TaskExit(tid, tgid, comm.decode(errors="replace"), round(cpu_s, 6))


def exits_in(payload: bytes) -> list[TaskExit]:
    """The per-thread records in a TASKSTATS_CMD_NEW message (generic header first).

    Each sits in a TASKSTATS_TYPE_AGGR_PID nest beside its pid; the
    TASKSTATS_TYPE_AGGR_TGID nest a whole process's exit adds sums its
    threads and is left out.
    """
    command = payload[0] if payload else 0
    if command != TASKSTATS_CMD_NEW:
        return []
    exits = []
    for kind, nest in parse_attributes(payload[_GENLMSGHDR.size :]):
        if kind != TASKSTATS_TYPE_AGGR_PID:
            continue
        for inner, stats in parse_attributes(nest):
            if inner == TASKSTATS_TYPE_STATS:
                exits.append(parse_taskstats(stats))
    return exits


def possible_cpus(path: Path = Path("/sys/devices/system/cpu/possible")) -> str:
    """The CPU list ("0-1") to register for: every CPU a thread may exit on."""
    return path.read_text().strip()


# -- the listener --------------------------------------------------------------


def _family_id(sock: socket.socket) -> int:
    """The generic netlink family id the kernel gave taskstats."""
    name = attribute(CTRL_ATTR_FAMILY_NAME, TASKSTATS_GENL_NAME.encode() + b"\0")
    sock.send(genl_request(GENL_ID_CTRL, CTRL_CMD_GETFAMILY, name, seq=1))
    for kind, _seq, payload in parse_messages(sock.recv(65536)):
        if kind == NLMSG_ERROR:
            raise TaskstatsUnavailable(
                f"no taskstats in this kernel ({os.strerror(netlink_error(payload))}):"
                " thread CPU is estimated"
            )
        for attr, value in parse_attributes(payload[_GENLMSGHDR.size :]):
            if attr == CTRL_ATTR_FAMILY_ID:
                return int.from_bytes(value[:2], "little")
    raise TaskstatsUnavailable("the kernel's answer named no taskstats family id")


class ExitListener:
    """Collects the exit records of the threads of `tgids` while open.

    open() registers for every CPU and starts a thread that receives;
    records() has what each thread of those processes used in all, by
    thread id.  Once close() has run, the records of all the threads that
    exited before it are there: the kernel sends one before it removes the
    thread from /proc.  `lost` says the receive buffer overflowed, so some
    may be missing.
    """

    def __init__(self, tgids: Collection[int], cpus: str | None = None) -> None:
        self.tgids = frozenset(tgids)
        self.cpus = cpus
        self._exits: dict[int, TaskExit] = {}
        self._exits_lock = threading.Lock()
        self.lost = False
        self._sock: socket.socket | None = None
        self._family = 0
        self._seq = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # close() writes to this pair's second end so that the receiving
        # thread, waiting in select(), stops at once rather than at its
        # next receive timeout: a caller timing what ends with close()
        # (a migration's CPU samplers) must not see up to 0.1 s of it.
        self._wake: tuple[socket.socket, socket.socket] | None = None

    def open(self) -> "ExitListener":
        """Register with the kernel; TaskstatsUnavailable says why it would not."""
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_GENERIC)
        try:
            self._setup(sock)
        except OSError as err:
            sock.close()
            raise TaskstatsUnavailable(
                f"taskstats refused a listener ({err.strerror or err}): counting exited threads"
                " exactly needs root; thread CPU is estimated"
            ) from None
        except TaskstatsUnavailable:
            sock.close()
            raise
        self._sock = sock
        self._wake = socket.socketpair()
        self._thread = threading.Thread(
            target=self._receive, args=(sock, self._wake[0]), name="taskstats", daemon=True
        )
        self._thread.start()
        return self

    def records(self) -> dict[int, TaskExit]:
        """The exit records received so far, by thread id."""
        with self._exits_lock:
            return dict(self._exits)

    def close(self) -> dict[int, TaskExit]:
        """Stop listening; the records of the threads that exited by now."""
        sock, self._sock = self._sock, None
        if sock is None:
            return self.records()
        self._stop.set()
        if self._wake is not None:
            self._wake[1].send(b"\0")
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._wake is not None:
            for end in self._wake:
                end.close()
            self._wake = None
        with contextlib.suppress(OSError):
            self._drain(sock)
            self._seq += 1
            mask = attribute(TASKSTATS_CMD_ATTR_DEREGISTER_CPUMASK, self._cpumask())
            sock.send(genl_request(self._family, TASKSTATS_CMD_GET, mask, self._seq))
        sock.close()
        return self.records()

    def _setup(self, sock: socket.socket) -> None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, _SO_RCVBUFFORCE, _RECEIVE_BUFFER)
        sock.bind((0, 0))
        sock.settimeout(5)
        self._family = _family_id(sock)
        self._check_layout(sock)
        self._ask(sock, attribute(TASKSTATS_CMD_ATTR_REGISTER_CPUMASK, self._cpumask()))
        sock.settimeout(0.1)  # a receive select() found ready never waits longer

    def _check_layout(self, sock: socket.socket) -> None:
        """Read this process's own record: is it laid out as this module reads it?

        The version must be one that names the thread group, and the record
        must name this process's pid and thread group where they should be.
        """
        me = os.getpid()
        replies = self._ask(sock, attribute(TASKSTATS_CMD_ATTR_PID, struct.pack("=I", me)))
        try:
            records = [record for payload in replies for record in exits_in(payload)]
        except struct.error:
            records = []
        if not any(record.tid == me and record.tgid == me for record in records):
            raise TaskstatsUnavailable(
                "this kernel's taskstats records do not read as include/uapi/linux/taskstats.h"
                " lays them out: thread CPU is estimated"
            )

    def _cpumask(self) -> bytes:
        return (self.cpus or possible_cpus()).encode() + b"\0"

    def _ask(self, sock: socket.socket, attributes: bytes) -> list[bytes]:
        """Send a TASKSTATS_CMD_GET request; its replies, once the kernel acknowledged it.

        Raises OSError with the kernel's errno if it refused.  Exit records
        that arrive meanwhile (after registering) are kept.
        """
        self._seq += 1
        sock.send(genl_request(self._family, TASKSTATS_CMD_GET, attributes, self._seq, NLM_F_ACK))
        replies = []
        while True:
            for kind, seq, payload in parse_messages(sock.recv(65536)):
                if seq != self._seq:
                    self._keep(kind, payload)
                elif kind != NLMSG_ERROR:
                    replies.append(payload)
                elif code := netlink_error(payload):
                    raise OSError(code, os.strerror(code))
                else:
                    return replies

    def _receive(self, sock: socket.socket, wake: socket.socket) -> None:
        while not self._stop.is_set():
            ready, _, _ = select.select([sock, wake], [], [])
            if wake in ready:
                return  # close() drains what is still queued
            try:
                data = sock.recv(65536)
            except TimeoutError:
                continue
            except OSError as err:
                self.lost = True  # ENOBUFS: the kernel dropped records
                if err.errno != errno.ENOBUFS:
                    return
                continue
            self._keep_all(data)

    def _drain(self, sock: socket.socket) -> None:
        """Take what is queued: the records of threads that exited by now."""
        sock.setblocking(False)
        while True:
            try:
                data = sock.recv(65536)
            except BlockingIOError:
                return
            except OSError as err:
                if err.errno != errno.ENOBUFS:
                    raise
                self.lost = True
                continue
            self._keep_all(data)

    def _keep_all(self, data: bytes) -> None:
        try:
            for kind, _seq, payload in parse_messages(data):
                self._keep(kind, payload)
        except (struct.error, TaskstatsUnavailable):
            self.lost = True  # a record this module cannot read: it may have been ours

    def _keep(self, kind: int, payload: bytes) -> None:
        if kind != self._family:
            return
        mine = [record for record in exits_in(payload) if record.tgid in self.tgids]
        with self._exits_lock:
            self._exits.update((record.tid, record) for record in mine)

    def __enter__(self) -> "ExitListener":
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()
