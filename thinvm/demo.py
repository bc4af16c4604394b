"""The flagship scenario: balloon a guest, watch the host get memory back,
then live-migrate it with free page hinting and check its memory arrived.
"""

import sys
import time
from dataclasses import dataclass

from thinvm import balloon, migrate, workload
from thinvm.progress import ProgressLine
from thinvm.units import MiB, format_size
from thinvm.vm import VM, BalloonOptions, VMConfig

PATTERN_SIZE = 256 * MiB
PATTERN_SEED = 20261121


@dataclass
class Step:
    name: str
    seconds: float
    host_rss: int
    actual: int
    note: str = ""


def _say(text: str) -> None:
    print(f"[demo] {text}", file=sys.stderr, flush=True)


def _record(steps: list[Step], vm: VM, name: str, seconds: float, note: str = "") -> None:
    step = Step(name, seconds, vm.host_memory().rss, balloon.query(vm).actual, note)
    steps.append(step)
    _say(f"{name}: {seconds:.2f} s, host RSS {format_size(step.host_rss)} {note}")


def _timed(func: object) -> float:
    start = time.monotonic()
    func()  # type: ignore[operator]
    return time.monotonic() - start


def run(build: str = "stock", memory: int = 2048 * MiB) -> int:
    config = VMConfig(
        name="demo",
        build=build,
        memory=memory,
        balloon=BalloonOptions(deflate_on_oom=True, free_page_hint=True),
    )
    steps: list[Step] = []
    _say(f"booting a {format_size(memory)} guest ({build} QEMU, stock guest driver)")
    with VM(config).start() as src:
        _record(steps, src, "boot to agent", src.boot_seconds or 0.0, f"accel {src.accel}")
        touched = 0

        def touch() -> None:
            nonlocal touched
            touched = workload.touch_free_memory(src.agent)

        _record(steps, src, "guest touches, then frees", _timed(touch), format_size(touched))
        seconds = _timed(lambda: workload.pattern_write(src.agent, PATTERN_SIZE, PATTERN_SEED))
        _record(steps, src, "write memory pattern", seconds, format_size(PATTERN_SIZE))

        inflate = memory // 2
        balloon.set_target(src, memory - inflate)
        seconds = balloon.wait_actual(src, memory - inflate)
        _record(steps, src, "inflate balloon", seconds, f"by {format_size(inflate)}")
        balloon.set_target(src, memory)
        _record(steps, src, "deflate balloon", balloon.wait_actual(src, memory))

        _say("live-migrating to a second QEMU (free page hinting on)")
        with VM(config, incoming=True).start() as dst:
            line = ProgressLine("[demo] ")
            result = migrate.migrate(
                src, dst, progress=lambda info: line.update(migrate.describe_progress(info))
            )
            line.done()
            src.shutdown()
            note = (
                f"{format_size(result.transferred)} sent, downtime {result.downtime_ms} ms, "
                f"{result.zero_pages} zero pages"
            )
            _record(steps, dst, "live migration", result.total_time_ms / 1000, note)
            start = time.monotonic()
            check = workload.pattern_verify(dst.agent, PATTERN_SEED)
            verdict = "verified" if check.ok else f"{check.bad} BAD pages"
            seconds = time.monotonic() - start
            _record(
                steps,
                dst,
                "verify pattern on destination",
                seconds,
                f"{check.pages} pages {verdict}",
            )
    _print_table(steps)
    return 0 if check.ok else 1


def _print_table(steps: list[Step]) -> None:
    print()
    print(f"| {'step':28} | {'seconds':>8} | {'host RSS':>11} | {'actual':>11} | note")
    print(f"|{'-' * 30}|{'-' * 10}|{'-' * 13}|{'-' * 13}|------")
    for s in steps:
        print(
            f"| {s.name:28} | {s.seconds:8.2f} | {format_size(s.host_rss):>11} | "
            f"{format_size(s.actual):>11} | {s.note}"
        )
