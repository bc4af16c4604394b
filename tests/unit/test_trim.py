"""thinvm.guest.trim against fake agents: every way a guest can fail to trim."""

import json
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from thinvm.errors import GuestError
from thinvm.guest import trim
from thinvm.guest.agent import AgentClient
from thinvm.host.memory import Settled

Answer = Callable[[str], bytes | None]


def serve(path: Path, answer: Answer) -> threading.Thread:
    """A one-connection agent: PONGs, and answers other lines with answer()."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)

    def run() -> None:
        conn, _ = server.accept()
        buf = b""
        with conn:
            while True:
                chunk = conn.recv(4096)
                if not chunk:
                    return
                buf += chunk
                while b"\n" in buf:
                    line, _, buf = buf.partition(b"\n")
                    text = line.decode()
                    if text.startswith("PING "):
                        conn.sendall(f"PONG {text[5:]}\n".encode())
                        continue
                    reply = answer(text)
                    if reply is not None:
                        conn.sendall(reply)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def json_reply(data: object) -> bytes:
    body = json.dumps(data).encode()
    return b"JSON %d\n" % len(body) + body


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Callable[[Answer], AgentClient]]:
    clients: list[AgentClient] = []

    def make(answer: Answer) -> AgentClient:
        path = tmp_path / "agent.sock"
        serve(path, answer)
        client = AgentClient(str(path))
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


def test_old_agent_is_reported_not_raised(agent: Callable[[Answer], AgentClient]) -> None:
    reply, why = trim.request_trim(agent(lambda line: b"ERR unknown\n"))
    assert reply is None and "predates trimming" in why


def test_guest_without_memory_reclaim(agent: Callable[[Answer], AgentClient]) -> None:
    client = agent(lambda line: json_reply({"available": False, "error": "no cgroup2 mount"}))
    reply, why = trim.request_trim(client)
    assert reply is None and why == "the guest has no usable reclaimer: no cgroup2 mount"


def test_silent_agent_times_out_quickly(
    agent: Callable[[Answer], AgentClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(trim, "COMPACT_SLACK", 0.5)
    reply, why = trim.request_trim(agent(lambda line: None), timeout=0.5)
    assert reply is None and "did not answer the trim request" in why


def test_absent_agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trim, "SYNC_TIMEOUT", 0.5)
    reply, why = trim.request_trim(AgentClient(str(tmp_path / "nobody.sock")))
    assert reply is None and "did not answer within" in why


def test_request_carries_bounds_and_returns_the_answer(
    agent: Callable[[Answer], AgentClient],
) -> None:
    seen: list[str] = []
    answer = {"available": True, "reclaimed_bytes_trim": 5 << 20, "stop": "floor"}

    def respond(line: str) -> bytes:
        seen.append(line)
        return json_reply(answer)

    reply, why = trim.request_trim(agent(respond), max_bytes=64 << 20, timeout=2.5)
    assert (reply, why) == (answer, "")
    assert seen == [f"TRIM {64 << 20} 2500"]


def test_expected_return_is_most_of_what_the_guest_freed() -> None:
    reply = {"free_before": 100 << 20, "free_after": 1100 << 20}
    assert trim.expected_return(reply) == int(0.9 * (1000 << 20))
    # Unknown (an older agent) or nothing freed: wait for quiet instead.
    assert trim.expected_return({}) == 0
    assert trim.expected_return({"free_before": 5 << 20, "free_after": 4 << 20}) == 0


def test_describe_untrimmed_is_one_line() -> None:
    result = trim.TrimResult(False, "the guest agent did not answer within 10 s", 5, 5, 0.0)
    assert result.describe("vm1") == "vm1: not trimmed: the guest agent did not answer within 10 s"


def test_a_trim_reported_at_once_waits_for_nothing(
    agent: Callable[[Answer], AgentClient],
) -> None:
    """The driver's report_now ran before the agent answered, and QEMU
    discards what is reported before acknowledging it: the host's RSS is
    read once, with no settle wait (which would poll until a quiet 4 s)."""
    answer = {
        "available": True, "reclaimed_bytes_trim": 500 << 20, "stop": "floor",
        "free_before": 100 << 20, "free_after": 600 << 20, "reported_now": True,
        "elapsed_ms": 2100, "cache_before": 700 << 20, "cache_after": 200 << 20,
    }  # fmt: skip
    readings = iter([1000 << 20, 520 << 20])
    result = trim.trim_guest(agent(lambda _line: json_reply(answer)), lambda: next(readings), True)
    assert (result.rss_after, result.settle_seconds) == (520 << 20, 0.0)
    assert "reported at once" in result.describe("vm1")


def test_a_trim_left_to_the_kernels_pace_waits_for_the_host(
    agent: Callable[[Answer], AgentClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    answer = {
        "available": True, "reclaimed_bytes_trim": 500 << 20, "stop": "floor",
        "free_before": 100 << 20, "free_after": 600 << 20, "reported_now": False,
    }  # fmt: skip
    waited: list[int] = []

    def settle(read: Callable[[], int], timeout: float, *, enough: int) -> Settled:
        waited.append(enough)
        return Settled(read(), 7.5, 7.0, True)

    monkeypatch.setattr(trim, "wait_settled", settle)
    readings = iter([1000 << 20, 560 << 20])
    result = trim.trim_guest(agent(lambda _line: json_reply(answer)), lambda: next(readings), True)
    assert waited == [trim.expected_return(answer)]
    assert (result.rss_after, result.settle_seconds) == (560 << 20, 7.5)
    assert "settled after 7.5 s" in result.describe("vm1")


def test_reclaimer_clock_reads_both_clocks_and_refuses_an_old_agent(
    agent: Callable[[Answer], AgentClient],
) -> None:
    status = {"background": True, "cpu_ms": 1200, "thread_cpu_ms": 4500, "steps": 10}
    client = agent(lambda line: json_reply(status))
    assert trim.ReclaimerClock.read(client) == trim.ReclaimerClock(True, 1200, 4500, 10)
    del status["thread_cpu_ms"]
    with pytest.raises(GuestError, match="predates thread_cpu_ms"):
        trim.ReclaimerClock.read(client)


def test_reclaimer_usage_counts_the_whole_thread_and_its_work_apart() -> None:
    """Two guests over a 100 s window: their threads used 500 + 300 ms,
    200 + 100 of them in 3 + 1 steps; the share of a vCPU is each thread's
    (0.4% on average), not the work's."""
    before = [trim.ReclaimerClock(True, 1000, 4000, 7), trim.ReclaimerClock(True, 0, 0, 0)]
    after = [trim.ReclaimerClock(True, 1200, 4500, 10), trim.ReclaimerClock(True, 100, 300, 1)]
    assert trim.reclaimer_usage(before, after, 100.0) == {
        "reclaim_work_cpu_s": 0.3,
        "reclaim_steps": 4,
        "reclaimer_thread_cpu_s": 0.8,
        "reclaimer_thread_cpu_pct": 0.4,
    }
    assert trim.reclaimer_usage([], [], 100.0)["reclaimer_thread_cpu_pct"] == 0.0
