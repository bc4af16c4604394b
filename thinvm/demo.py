"""The flagship scenario, run twice: on the stock stack and on thinvm's.

A guest touches and frees most of its memory, writes a pattern, inflates
and deflates its balloon, and live-migrates; the destination verifies the
pattern.  The stock stack is Debian's QEMU and the in-tree balloon driver
with free page hinting; the thinvm stack is the patched QEMU with our
driver, page-range ballooning, free page reporting and sparse-ram.  The
host memory column shows what the guest gave back at each step.
"""

import sys
import time
from dataclasses import dataclass

from thinvm.guest import workload
from thinvm.progress import ProgressLine
from thinvm.units import MiB, format_size
from thinvm.vm import balloon, migrate
from thinvm.vm.machine import VM, VMConfig
from thinvm.vm.stack import STOCK_BEST, THINVM, Stack

PATTERN_SIZE = 256 * MiB
PATTERN_SEED = 20261121
IDLE_SECONDS = 10.0
STACKS = (("stock-best", STOCK_BEST), ("thinvm", THINVM))


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


def run(memory: int = 2048 * MiB) -> int:
    """Both stacks, one after the other; 0 only if both kept the pattern."""
    results = [(name, stack, run_stack(name, stack, memory)) for name, stack in STACKS]
    for name, stack, (steps, _) in results:
        print(f"\n{name}: {stack.describe()}")
        _print_table(steps)
    _print_comparison(results[0][2][0], results[1][2][0])
    return 0 if all(ok for _, _, (_, ok) in results) else 1


def run_stack(name: str, stack: Stack, memory: int) -> tuple[list[Step], bool]:
    config = VMConfig(
        name=f"demo-{name}",
        build=stack.build,
        memory=memory,
        guest_driver=stack.driver,
        balloon=stack.balloon(deflate_on_oom=True),
    )
    steps: list[Step] = []
    _say(f"{name}: booting a {format_size(memory)} guest ({stack.describe()})")
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

        # Free page reporting works in the background, in 2 MiB+ blocks
        # a couple of seconds after they are freed; both stacks idle alike.
        _record(steps, src, "guest idles", _timed(lambda: time.sleep(IDLE_SECONDS)))

        _say(f"{name}: live-migrating to a second QEMU")
        with VM(config, incoming=True).start() as dst:
            line = ProgressLine("[demo] ")
            result = migrate.migrate(
                src,
                dst,
                caps=stack.caps,
                progress=lambda info: line.update(migrate.describe_progress(info)),
            )
            line.done()
            src.shutdown()
            note = (
                f"{format_size(result.transferred)} sent, downtime {result.downtime_ms} ms, "
                f"{result.zero_pages} zero pages, {result.sparse_skipped} skipped unread"
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
    return steps, check.ok


def _print_table(steps: list[Step]) -> None:
    print()
    print(f"| {'step':28} | {'seconds':>8} | {'host RSS':>11} | {'actual':>11} | note")
    print(f"|{'-' * 30}|{'-' * 10}|{'-' * 13}|{'-' * 13}|------")
    for s in steps:
        print(
            f"| {s.name:28} | {s.seconds:8.2f} | {format_size(s.host_rss):>11} | "
            f"{format_size(s.actual):>11} | {s.note}"
        )


def _print_comparison(stock: list[Step], thinvm: list[Step]) -> None:
    """thinvm against stock, step by step: time and host memory after it."""
    print(f"\n| {'step':28} | {'time thinvm/stock':>18} | {'host RSS thinvm/stock':>22}")
    print(f"|{'-' * 30}|{'-' * 20}|{'-' * 23}")
    for a, b in zip(stock, thinvm, strict=True):
        time_ratio = f"x{b.seconds / a.seconds:.2f}" if a.seconds else "-"
        rss_ratio = f"x{b.host_rss / a.host_rss:.2f}" if a.host_rss else "-"
        print(f"| {a.name:28} | {time_ratio:>18} | {rss_ratio:>22}")
