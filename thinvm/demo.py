"""The flagship scenario, run twice: on the stock stack and on thinvm's.

A guest touches and frees most of its memory, writes a pattern, inflates
and deflates its balloon, and live-migrates; the destination verifies the
pattern.  The stock side is the best a user can configure on Debian's
QEMU and the in-tree balloon driver: free page reporting and multifd
with its zero-page detection (not free page hinting, which measured
slower: thinvm.vm.stack).  The thinvm stack is the patched QEMU with our
driver, page-range ballooning, free page reporting and sparse-ram over
the same multifd transport.  Both
migrate over loopback with QEMU's 128 MiB/s bandwidth cap lifted, so the
table measures the migration, not the cap.  The host memory column shows
what the guest gave back at each step.
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
                params=migrate.UNCAPPED,
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


def format_table(header: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
    """A markdown table whose columns are as wide as their widest cell."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        padded = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join(
        "-" * (w + 1) + (":" if i in right else "-") for i, w in enumerate(widths)
    )
    return [line(header), rule + "|", *(line(row) for row in rows)]


def _print_table(steps: list[Step]) -> None:
    rows = [
        [s.name, f"{s.seconds:.2f}", format_size(s.host_rss), format_size(s.actual), s.note]
        for s in steps
    ]
    print()
    print(
        "\n".join(format_table(["step", "seconds", "host RSS", "actual", "note"], rows, {1, 2, 3}))
    )


def _print_comparison(stock: list[Step], thinvm: list[Step]) -> None:
    """thinvm against stock-best, step by step: time and host memory after it."""
    rows = []
    for a, b in zip(stock, thinvm, strict=True):
        time_ratio = f"x{b.seconds / a.seconds:.2f}" if a.seconds else "-"
        rss_ratio = f"x{b.host_rss / a.host_rss:.2f}" if a.host_rss else "-"
        rows.append([a.name, time_ratio, rss_ratio])
    header = ["step", "time thinvm/stock-best", "host RSS thinvm/stock-best"]
    print()
    print("\n".join(format_table(header, rows, right={1, 2})))
