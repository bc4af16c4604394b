"""save-restore: saving a guest to a file and restoring it."""

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from thinvm.bench.cpu import MigrationCpu
from thinvm.bench.scenarios.common import (
    LEGACY,
    STOCK_HINT,
    hold_then_idle,
    verify_pattern,
)
from thinvm.bench.scenarios.params import (
    float_param,
    used_fraction,
)
from thinvm.bench.scenarios.spec import ScenarioSpec
from thinvm.bench.scenarios.transport import (
    CHANNELS,
    MIGRATION_PARAMS,
    warm_host,
)
from thinvm.bench.types import (
    BenchOptions,
    Best,
    Metrics,
    RunContext,
    Scenario,
    Target,
    Variant,
)
from thinvm.paths import cache_dir
from thinvm.units import MiB, format_size
from thinvm.vm import migrate
from thinvm.vm.machine import VM, VMConfig
from thinvm.vm.stack import STOCK_BEST, THINVM, Stack

SAVE_SEED = 9
MAPPED = {"mapped-ram": True}
_STOCK = "stock QEMU and driver"


@dataclass(frozen=True)
class SaveCandidate:
    """One way to save: a stack, capabilities on top of its own, and
    migration parameters on top of MIGRATION_PARAMS and CHANNELS."""

    name: str
    stack: Stack
    extra: dict[str, bool]
    description: str
    params: dict[str, int] = field(default_factory=dict)


# Every stock way to save to a file: mapped-ram (every page at a fixed file
# offset, zero pages left as holes) over multifd is what libvirt's parallel
# save uses, but one channel, one stream, hinting or the plain stream may do
# better on a given machine, so stock-best is whichever measured best.
STOCK_SAVES: list[SaveCandidate] = [
    SaveCandidate(
        "stock-mapped-mfd2", STOCK_BEST, MAPPED, f"{_STOCK}; reporting, mapped-ram, multifd (2)"
    ),
    SaveCandidate(
        "stock-hint-mapped-mfd2",
        STOCK_HINT,
        MAPPED,
        f"{_STOCK}; hinting + reporting, mapped-ram, multifd (2)",
    ),
    SaveCandidate(
        "stock-mapped-mfd1",
        STOCK_BEST,
        MAPPED,
        f"{_STOCK}; reporting, mapped-ram, multifd (1)",
        {"multifd-channels": 1},
    ),
    SaveCandidate(
        "stock-mapped",
        Stack(reporting=True),
        MAPPED,
        f"{_STOCK}; reporting, mapped-ram, one stream",
    ),
    SaveCandidate("stock-reporting", Stack(reporting=True), {}, f"{_STOCK}; reporting, one stream"),
    SaveCandidate("legacy", LEGACY, {}, f"{_STOCK}, no extras, one stream"),
]
# thinvm saves as libvirt's parallel save does (multifd to a file needs
# mapped-ram) with sparse-ram on top: the pages the host never populated are
# not read at all, where stock's channels read them and find them zero.
THINVM_SAVE = SaveCandidate(
    "thinvm",
    THINVM,
    MAPPED,
    "patched QEMU, our driver; reporting + ranges, sparse-ram, mapped-ram over multifd (2)",
)


def _restore(
    config: VMConfig, uri: str, caps: dict[str, bool], params: dict[str, int], ctx: RunContext
) -> tuple[VM, Metrics]:
    """A new QEMU that loads the saved file and runs; returns it (caller owns
    it) and the CPU seconds its threads spent loading (dst_*)."""
    began = time.monotonic()
    dst = VM(config, incoming=True).start()
    try:
        started = time.monotonic()
        migrate.set_capabilities(dst, caps)
        migrate.set_parameters(dst, {**CHANNELS, **params})
        ctx.step("restoring")
        with MigrationCpu(None, dst.pid) as cpu:
            loading = time.monotonic()
            dst.qmp("migrate-incoming", uri=uri)
            migrate.wait_destination_status(dst, "running", timeout=600)
            running = time.monotonic()
    except BaseException:
        dst.kill()
        raise
    # Where a restore's time goes: the new QEMU's start (the same on every
    # stack's binary but not necessarily its machine), then the load itself.
    # Timed here, not after the block: stopping the CPU samplers can take
    # up to their poll interval (0.1 s), which is not the restore's.
    phases = {
        "restore_ms": round((running - began) * 1000, 1),
        "restore_start_ms": round((started - began) * 1000, 1),
        "restore_load_ms": round((running - loading) * 1000, 1),
    }
    return dst, {**cpu.metrics, **phases}


@dataclass(frozen=True)
class SaveRestoreRun:
    """One save of a fresh guest to a file and its restore in a new QEMU."""

    opts: BenchOptions
    size: int
    used: int
    idle: float
    candidate: SaveCandidate

    @property
    def stack(self) -> Stack:
        return self.candidate.stack

    def __call__(self, ctx: RunContext) -> Metrics:
        config = self.opts.vm_config("b-save", self.size, self.stack)
        caps = {**self.stack.caps, **self.candidate.extra}
        path = cache_dir() / "bench-save" / f"{ctx.variant}-{os.getpid()}.mig"
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            metrics, result = self._save(ctx, config, caps, path)
            st = path.stat()
            metrics.update(warm_host(ctx, st.st_blocks * 512))
            metrics.update(self._restore(ctx, config, caps, f"file:{path}"))
        finally:
            path.unlink(missing_ok=True)
        return {
            "save_ms": result.total_time_ms,
            "save_restore_ms": result.total_time_ms + float(metrics["restore_ms"] or 0),
            "file_bytes": st.st_blocks * 512,
            "file_size_bytes": st.st_size,
            "transferred_bytes": result.transferred,
            "normal_pages": result.normal_pages,
            "zero_pages": result.zero_pages,
            "sparse_skipped_pages": result.sparse_skipped,
            **metrics,
        }

    def _save(
        self, ctx: RunContext, config: VMConfig, caps: dict[str, bool], path: Path
    ) -> tuple[Metrics, migrate.MigrationResult]:
        with VM(config).start() as src:
            metrics = hold_then_idle(ctx, src, self.stack, self.used, SAVE_SEED, self.idle)
            ctx.step(f"saving to {path.name}")
            with MigrationCpu(src.pid, None) as cpu:
                params = {**MIGRATION_PARAMS, **CHANNELS, **self.candidate.params}
                result = migrate.migrate_to_uri(src, f"file:{path}", caps=caps, params=params)
            metrics.update(cpu.metrics)
        return metrics, result

    def _restore(
        self, ctx: RunContext, config: VMConfig, caps: dict[str, bool], uri: str
    ) -> Metrics:
        """Restore in a new QEMU; the time until the guest runs, its data verified."""
        restored, metrics = _restore(config, uri, caps, self.candidate.params, ctx)
        with restored as dst:
            dst.wait_agent(timeout=60)
            if self.used:
                verify_pattern(dst, ctx, SAVE_SEED)
            metrics["dst_rss_bytes"] = dst.host_memory().rss
        return metrics


def make_save_restore(opts: BenchOptions, params: dict[str, str], size: int) -> Scenario:
    idle = float_param(params, "idle")
    fraction = used_fraction(params)
    used = int(size * fraction) // MiB * MiB

    def variant(candidate: SaveCandidate) -> Variant:
        run = SaveRestoreRun(opts, size, used, idle, candidate)
        return Variant(candidate.name, run, candidate.description)

    stock_best = Best(
        "stock-best",
        tuple(c.name for c in STOCK_SAVES),
        "the best stock way to save and restore measured (lowest save + restore time)",
    )

    targets = [
        Target(
            f"issue 13: save/restore of a mostly idle guest at least 5x smaller and "
            f"faster with thinvm than with stock-best ({what})",
            "thinvm",
            "stock-best",
            metric,
            at_most=0.2,
        )
        for metric, what in (
            ("file_bytes", "allocated file size"),
            ("save_ms", "save time"),
            ("restore_ms", "restore time"),
        )
    ]
    return Scenario(
        name="save-restore",
        title="save to a file and restore, thinvm vs stock-best",
        description=(
            f"A {format_size(size)} guest writes {format_size(used)} of data "
            f"({fraction:g} of its RAM, a pattern in tmpfs), touches the rest of its free "
            f"memory and frees it, idles {idle:g} s (with free page reporting: until the "
            "source's RSS stops falling), then `migrate` saves it to `file:` on the host's "
            "disk (page cache); a new QEMU restores it from that file "
            "(`migrate-incoming`) and verifies the data page by page. Save time is "
            "`query-migrate`'s total time; restore time (`restore_ms`) is from starting the "
            "new QEMU until the guest runs again: `restore_start_ms` that QEMU's start "
            "(until its QMP answers), `restore_load_ms` from `migrate-incoming` until "
            "the guest runs (records before 2026-11-29 have only the sum; up to "
            "save-restore-20261129T013418Z it also held up to 0.1 s of the CPU samplers' "
            "stop). File bytes are "
            "the blocks the file holds on disk "
            "(mapped-ram leaves zero pages as holes); file size is its apparent size. "
            "**stock-best** is the stock candidate with the lowest median save + restore "
            "time (`save_restore_ms`) in the same run."
        ),
        variants=[variant(c) for c in [*STOCK_SAVES, THINVM_SAVE]],
        best=[stock_best],
        baseline="stock-best",
        best_metric="save_restore_ms",
        main_metric="save_ms",
        second_metric="file_bytes",
        params={
            "size": format_size(size),
            "used": format_size(used),
            "idle_s": idle,
            **MIGRATION_PARAMS,
            **CHANNELS,
        },
        targets=targets,
    )


SPEC = ScenarioSpec(
    "save-restore",
    "save to a file and restore: thinvm vs stock-best",
    make_save_restore,
    "4G",
    "guest RAM",
    default_runs=2,
    params={"idle": "2", "used": "0.125"},
)
