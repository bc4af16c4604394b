"""save-restore: saving a guest to a file and restoring it."""

import os
import time
from dataclasses import dataclass
from pathlib import Path

from thinvm.bench.cpu import MigrationCpu
from thinvm.bench.scenarios.common import (
    LEGACY,
    hold_then_idle,
    verify_pattern,
)
from thinvm.bench.scenarios.params import (
    float_param,
    used_fraction,
)
from thinvm.bench.scenarios.transport import (
    CHANNELS,
    MIGRATION_PARAMS,
    warm_host,
)
from thinvm.bench.types import BenchOptions, Metrics, RunContext, Scenario, Target, Variant
from thinvm.paths import cache_dir
from thinvm.units import MiB, format_size
from thinvm.vm import migrate
from thinvm.vm.machine import VM, VMConfig
from thinvm.vm.stack import STOCK_BEST, THINVM, Stack

SAVE_SEED = 9
# Saving to a file: stock's best is mapped-ram (every page at a fixed file
# offset, zero pages left as holes) over multifd, what libvirt's parallel
# save uses.  thinvm saves the same way (multifd to a file needs
# mapped-ram) with sparse-ram on top: the difference is only that the
# pages the host never populated are not read at all, where stock-best's
# channels read them and find them zero.
SAVE_STACKS: list[tuple[str, Stack, dict[str, bool], str]] = [
    (
        "stock-best",
        STOCK_BEST,
        {"mapped-ram": True},
        "stock QEMU and driver; reporting, mapped-ram over multifd (2 channels)",
    ),
    (
        "thinvm",
        THINVM,
        {"mapped-ram": True},
        "patched QEMU, our driver; reporting + ranges, sparse-ram, mapped-ram "
        "over multifd (2 channels)",
    ),
    ("legacy", LEGACY, {}, "stock QEMU and driver, no extras, one stream (reference)"),
]


def _restore(
    config: VMConfig, uri: str, caps: dict[str, bool], ctx: RunContext
) -> tuple[VM, Metrics]:
    """A new QEMU that loads the saved file and runs; returns it (caller owns
    it) and the CPU seconds its threads spent loading (dst_*)."""
    dst = VM(config, incoming=True).start()
    try:
        migrate.set_capabilities(dst, caps)
        migrate.set_parameters(dst, dict(CHANNELS))
        ctx.step("restoring")
        with MigrationCpu(None, dst.pid) as cpu:
            dst.qmp("migrate-incoming", uri=uri)
            migrate.wait_destination_status(dst, "running", timeout=600)
    except BaseException:
        dst.kill()
        raise
    return dst, cpu.metrics


@dataclass(frozen=True)
class SaveRestoreRun:
    """One save of a fresh guest to a file and its restore in a new QEMU."""

    opts: BenchOptions
    size: int
    used: int
    idle: float
    stack: Stack
    extra: dict[str, bool]

    def __call__(self, ctx: RunContext) -> Metrics:
        config = self.opts.vm_config("b-save", self.size, self.stack)
        caps = {**self.stack.caps, **self.extra}
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
                result = migrate.migrate_to_uri(
                    src, f"file:{path}", caps=caps, params={**MIGRATION_PARAMS, **CHANNELS}
                )
            metrics.update(cpu.metrics)
        return metrics, result

    def _restore(
        self, ctx: RunContext, config: VMConfig, caps: dict[str, bool], uri: str
    ) -> Metrics:
        """Restore in a new QEMU; the time until the guest runs, its data verified."""
        began = time.monotonic()
        restored, metrics = _restore(config, uri, caps, ctx)
        with restored as dst:
            metrics["restore_ms"] = (time.monotonic() - began) * 1000
            dst.wait_agent(timeout=60)
            if self.used:
                verify_pattern(dst, ctx, SAVE_SEED)
            metrics["dst_rss_bytes"] = dst.host_memory().rss
        return metrics


def make_save_restore(opts: BenchOptions, params: dict[str, str], size: int) -> Scenario:
    idle = float_param(params, "idle")
    fraction = used_fraction(params)
    used = int(size * fraction) // MiB * MiB

    def variant(stack: Stack, extra: dict[str, bool]) -> SaveRestoreRun:
        return SaveRestoreRun(opts, size, used, idle, stack, extra)

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
            "`query-migrate`'s total time; restore time is from `migrate-incoming` until "
            "the guest runs again. File bytes are the blocks the file holds on disk "
            "(mapped-ram leaves zero pages as holes); file size is its apparent size."
        ),
        variants=[
            Variant(name, variant(stack, extra), text) for name, stack, extra, text in SAVE_STACKS
        ],
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
