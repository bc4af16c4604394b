"""Benchmark reports: markdown tables, docs/benchmarks.md, PNG plots.

Everything here is a pure function of results documents (see thinvm.bench.results)
except plot_result(), which draws with matplotlib's Agg backend.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from thinvm.bench.quiet import gate_records, gate_watched, run_was_quiet
from thinvm.bench.results import NO_CLEAR_DIFFERENCE, downtime_verdicts, verdict
from thinvm.units import GiB, MiB, format_size

DASH = "\u2013"  # en dash, for ranges
TIMES = "\u00d7"  # multiplication sign, for ratios
LE = "\u2264"  # less-than or equal to, for targets

# A metric's unit is its name's suffix.
UNITS = {
    "_s": "s",
    "_ms": "ms",
    "_bytes": "bytes",
    "_mibps": "MiB/s",
    "_calls": "count",
    "_pages": "count",
    "_count": "count",
    "_guests": "count",
    "_syncs": "count",
}

LABELS = {
    "inflate_s": "inflate time",
    "deflate_s": "deflate time",
    "inflate_discard_calls": "discard calls (inflate)",
    "inflate_madvise_calls": "madvise calls (inflate)",
    "deflate_madvise_calls": "madvise calls (deflate)",
    "deflate_discard_calls": "discard calls (deflate)",
    "rss_before_bytes": "host RSS before",
    "thp_before_bytes": "host THP before",
    "rss_inflated_bytes": "host RSS inflated",
    "thp_inflated_bytes": "host THP inflated",
    "rss_after_bytes": "host RSS after",
    "thp_after_bytes": "host THP after",
    "touched_bytes": "guest touched",
    "touch_guest_s": "guest touch time",
    "migration_ms": "migration time",
    "save_ms": "save time",
    "restore_ms": "restore time",
    "file_bytes": "file blocks on disk",
    "file_size_bytes": "file size",
    "sparse_skipped_pages": "pages skipped unread (sparse-ram)",
    "downtime_ms": "downtime",
    "setup_ms": "setup time",
    "transferred_bytes": "bytes sent",
    "link_ms": "link time for the bytes sent",
    "normal_pages": "normal pages sent",
    "zero_pages": "zero pages",
    "dirty_syncs": "dirty-bitmap syncs",
    "src_rss_bytes": "source RSS before",
    "dst_rss_bytes": "destination RSS after",
    "dst_thp_bytes": "destination THP after",
    "achieved_mibps": "workload dirty rate",
    "max_stall_ms": "workload longest slice",
    "held_bytes": "host memory held",
    "held_per_guest_bytes": "held per guest",
    "peak_bytes": "host memory peak",
    "settle_s": "time to settle",
    "discard_calls": "discard calls",
    "boot_s": "launch to agent ready",
    "qmp_s": "launch to QMP ready",
    "fit_guests": "guests that fit",
    "oom_guests": "guests OOM-killed",
    "src_cpu_s": "source CPU",
    "src_migration_cpu_s": "source CPU: migration threads",
    "src_vcpu_cpu_s": "source CPU: vCPUs",
    "src_multifd_cpu_s": "source CPU: multifd channels",
    "src_other_cpu_s": "source CPU: other threads",
    "dst_cpu_s": "destination CPU",
    "dst_migration_cpu_s": "destination CPU: migration threads",
    "dst_vcpu_cpu_s": "destination CPU: vCPUs",
    "dst_multifd_cpu_s": "destination CPU: multifd channels",
    "dst_other_cpu_s": "destination CPU: other threads (main loop)",
    # The warm-up before a migration (thinvm.host.memory.warm_free_memory):
    # how cold the lab host was, outside the measurement.
    "host_warmed_bytes": "host memory warmed before",
    "host_warm_s": "host warm-up (not measured)",
    "host_warm_unused_bytes": "host warm reserve left unused",
    # During the migration (thinvm.bench.hostcost): what the lab host
    # charged for fresh memory, per GiB faulted in.
    "host_fault_s_per_gib": "host fault cost during run (s/GiB)",
    "host_fault_max_s_per_gib": "host fault cost, worst (s/GiB)",
    # migrate-working-set: the step before the migration (drop_caches or a
    # trim) and the hot subset read again after arrival.
    "trim_ms": "drop/trim before migrating",
    "total_ms": "drop/trim + migration",
    "hot_reread_ms": "hot subset re-read after arrival",
    "hot_reread_disk_bytes": "of it read from disk again",
    "hot_refault_pages": "hot refaults after arrival",
    "cold_read_ms": "data set read once (source)",
    "hot_read_src_ms": "hot subset read (source, warm)",
    "cache_before_bytes": "guest page cache before drop/trim",
    "cache_after_bytes": "guest page cache at migration",
    "trim_returned_bytes": "host RSS given back by drop/trim",
    "trim_reclaimed_bytes": "guest reclaimed (trim)",
    "trim_guest_s": "guest trim time",
    "trim_settle_s": "wait for reporting after drop/trim",
    "trim_reclaim_s": "guest reclaim + compaction alone",
    "trim_over_reclaim": "whole trim / reclaim alone (x)",
    # fleet-migrate: a libvirt migration's phases (thinvm.fleet.trace.PHASES).
    "libvirt_elapsed_ms": "libvirt job elapsed",
    "trace_checks_ms": "phase: thinvm's checks before virsh",
    "trace_setup_ms": "phase: libvirt + QEMU set-up (virsh called to first pass)",
    "trace_live_ms": "phase: live transfer (first pass to pause)",
    "trace_paused_ms": "phase: paused (source pause to destination resume)",
    "trace_finish_ms": "phase: libvirt's finish (resume to virsh returning)",
    "trace_stats_ms": "phase: thinvm reads the job statistics",
}


def metric_unit(name: str) -> str:
    for suffix, unit in UNITS.items():
        if name.endswith(suffix):
            return unit
    return ""


def metric_label(name: str) -> str:
    if name in LABELS:
        return LABELS[name]
    for suffix in UNITS:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    return name.replace("_", " ")


def format_value(name: str, value: float | None) -> str:
    """A metric value in its unit: 12.35 s, 830 ms, 1.50 GiB, 917,626."""
    if value is None:
        return DASH
    unit = metric_unit(name)
    if unit == "s":
        return f"{value:.2f} s"
    if unit == "ms":
        return f"{value:.0f} ms"
    if unit == "bytes":
        return format_size(value)
    if unit == "MiB/s":
        return f"{value:.1f} MiB/s"
    if unit == "count":
        return f"{round(value):,}"
    return f"{value:.4g}"


def format_ratio(value: float | None) -> str:
    if value is None:
        return ""
    return f"{TIMES}{value:.2f}" if value < 100 else f"{TIMES}{value:.0f}"


def format_cell(
    name: str,
    entry: dict[str, Any] | None,
    baseline: str | None = None,
    reference: dict[str, Any] | None = None,
) -> str:
    """`median [min-max] xratio` of one variant's metric.

    A ratio taken against another variant than the table's baseline says so.
    Where this variant's min..max range overlaps its `reference`'s (the
    entry of the variant the ratio is taken against), the ratio is no
    evidence of a gain or a loss and prints as "no clear difference".
    """
    if entry is None:
        return DASH
    text = format_value(name, entry["median"])
    low, high = format_value(name, entry["min"]), format_value(name, entry["max"])
    if low != high:
        text += f" [{low}{DASH}{high}]"
    ratio = format_ratio(entry.get("ratio"))
    if ratio and verdict(entry, reference) == NO_CLEAR_DIFFERENCE:
        ratio = NO_CLEAR_DIFFERENCE
    if ratio and baseline and entry.get("ratio_to") not in (None, baseline):
        ratio += f" vs {entry['ratio_to']}"
    return f"{text} {ratio}" if ratio else text


def ordered_metrics(result: dict[str, Any]) -> list[str]:
    """Main metric first, then the second, then the rest as reported."""
    seen: dict[str, None] = {}
    for name in (result["main_metric"], result.get("second_metric")):
        if name:
            seen[name] = None
    for variant in result["summary"].values():
        for name in variant:
            seen.setdefault(name, None)
    return [n for n in seen if any(n in v for v in result["summary"].values())]


def column_name(variant: dict[str, Any], baseline: str) -> str:
    """A table column's head: the row's name, the winner of a chosen row, the baseline."""
    name = str(variant["name"])
    if "best_of" in variant:
        name += f" = {variant.get('chosen') or 'none'}"
    return f"{name} (baseline)" if variant["name"] == baseline else name


def render_table(result: dict[str, Any]) -> str:
    """Rows: metrics; columns: variants; cells: median [min-max] xratio."""
    variants = [v["name"] for v in result["variants"]]
    baseline = result["baseline"]
    header = ["metric"] + [column_name(v, baseline) for v in result["variants"]]
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join(["---"] + ["--:"] * len(variants)) + "|",
    ]
    summary = result["summary"]
    for name in ordered_metrics(result):
        cells = [
            format_cell(name, summary[v].get(name), baseline, _reference(summary, v, name))
            for v in variants
        ]
        lines.append(f"| {metric_label(name)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _reference(
    summary: dict[str, dict[str, Any]], variant: str, name: str
) -> dict[str, Any] | None:
    """The summary entry `variant`'s ratio for `name` was taken against."""
    to = summary[variant].get(name, {}).get("ratio_to")
    reference: dict[str, Any] | None = summary.get(to, {}).get(name) if to else None
    return reference


def _build_line(qemu: dict[str, Any], flavour: str) -> str:
    info = qemu.get(flavour, {})
    if "error" in info or not info:
        return f"{flavour}: not built"
    version = str(info.get("version", "")).replace("QEMU emulator version ", "")
    return f"{flavour}: {version}, patch-hash {info.get('patch_hash')}"


def machine_line(result: dict[str, Any]) -> str:
    env = result["environment"]
    mem = env.get("mem_total") or 0
    commit = env.get("thinvm_commit", "unknown")
    if env.get("thinvm_dirty"):
        commit += " (uncommitted changes)"
    qemu = env.get("qemu", {})
    package = f"Debian {env['guest_kernel_package']}, " if env.get("guest_kernel_package") else ""
    return (
        f"{env.get('cpu_model')}, {env.get('nproc')} CPUs, {mem / GiB:.1f} GiB RAM, "
        f"swap {format_size(env.get('swap_total', 0))}, host kernel {env.get('host_kernel')}, "
        f"THP {env.get('thp_enabled')}; accel {env.get('accel')}"
        f" (guest CPU {env.get('guest_cpu', 'max: byte-wise string ops on')}, "
        f"machine {env.get('guest_machine', 'q35 with its HPET')}); "
        f"QEMU {env.get('qemu_used')} unless a variant names another "
        f"({_build_line(qemu, 'stock')}; {_build_line(qemu, 'patched')}); "
        f"guest kernel {env.get('guest_kernel')} ({package}{env.get('guest_driver')} "
        f"balloon driver unless a variant names another); thinvm {commit}; "
        f"discard counter: {env.get('counter')}{_warming_note(env)}"
    )


def _warming_note(env: dict[str, Any]) -> str:
    """Records made before the fact was kept say nothing about it."""
    if env.get("host_warming", True):
        return ""
    return "; free host memory not warmed (THINVM_BENCH_WARM_HOST=0)"


def load_line(result: dict[str, Any]) -> str:
    runs = result["runs"]
    one_minute = [r["load_start"][0] for r in runs] + [r["load_end"][0] for r in runs]
    others = [r.get("other_qemu", 0) for r in runs]
    cpus = result["load"].get("cpus")
    text = (
        f"1-min load average during the runs {min(one_minute, default=0):.1f}{DASH}"
        f"{max(one_minute, default=0):.1f} on {cpus} CPUs"
    )
    if any(others):
        text += f"; other QEMU processes on the host at run start: {min(others)}{DASH}{max(others)}"
    return text + _gate_text(result)


def _gate_text(result: dict[str, Any]) -> str:
    """What the quiet gate saw, for results recorded with one."""
    gate = result["load"].get("gate")
    seen = gate_records(result)
    if not gate or not seen:
        return ""
    waited = [s["waited_s"] for s in seen]
    quiet = sum(1 for s in seen if s["quiet"])
    text = (
        f"; quiet gate (1-min load < {gate['max_load']:g}, no other QEMU, wait at most "
        f"{gate['max_wait_s']:.0f} s): {quiet} of {len(seen)} runs started on a quiet "
        f"machine, after waiting {min(waited):.0f}{DASH}{max(waited):.0f} s"
    )
    watched = [s for s in seen if "other_qemu_during" in s]
    if watched:
        calm = sum(1 for s in watched if not s["other_qemu_during"])
        text += f"; {calm} of {len(watched)} saw no other QEMU while they ran"
    sittings = result["load"].get("sittings")
    if sittings:
        text += f"; made in {len(sittings)} sittings (--resume), begun {', '.join(sittings)}"
        again = len(result["load"].get("cut_runs", []))
        if again:
            text += f" ({again} run(s) of a pass an interruption cut made again)"
    return text


def quiet_warning(result: dict[str, Any]) -> str | None:
    """A line above the table of a record with runs that were not quiet."""
    seen = gate_records(result)
    noisy = [s for s in seen if not run_was_quiet(s)]
    if not result["load"].get("gate") or not noisy:
        return None
    return (
        f"**Not quiet: {len(noisy)} of {len(seen)} runs** started on a busy machine or "
        "saw another QEMU while they ran; compare this table's figures with care."
    )


def command_line(result: dict[str, Any]) -> str:
    """The recorded command, as `thinvm bench ...` whatever the path to thinvm."""
    args = [str(a) for a in result.get("command", [])[1:]]
    return " ".join(["thinvm", *args]) if args else f"thinvm bench {result['scenario']}"


def render_target(target: dict[str, Any], summary: dict[str, Any] | None = None) -> str:
    """One target: what it asks, what was measured, met or not.

    With the result's `summary`, a target whose two variants' min..max
    ranges overlap says so: its ratio is then no clear difference.
    """
    bound = format_ratio(target["at_most"])
    what = f"{_target_rows(target)} must be {LE} {bound}"
    if target.get("ratio") is None:
        return f"- {target['label']}: {what}; not measured in this run."
    met = "**met**" if target["met"] else "**not met**"
    if _ranges_overlap(target, summary or {}):
        met += f" (the ranges overlap: {NO_CLEAR_DIFFERENCE})"
    return f"- {target['label']}: {what}; measured {format_ratio(target['ratio'])}: {met}."


def _target_rows(target: dict[str, Any]) -> str:
    """'thinvm / stock-best migration time', or with a reference metric of
    its own 'thinvm migration time / thinvm link time for the bytes sent'."""
    metric, other = target["metric"], target.get("reference_metric")
    if other:
        return (
            f"{target['variant']} {metric_label(metric)} / "
            f"{target['reference']} {metric_label(other)}"
        )
    return f"{target['variant']} / {target['reference']} {metric_label(metric)}"


def _ranges_overlap(target: dict[str, Any], summary: dict[str, Any]) -> bool:
    """Whether the target's two rows' min..max ranges overlap (a bound on
    another metric, such as the link's time, is not a comparison of rows)."""
    if target.get("reference_metric"):
        return False
    value, reference = (
        summary.get(target[v], {}).get(target["metric"]) for v in ("variant", "reference")
    )
    return value is not None and verdict(value, reference) == NO_CLEAR_DIFFERENCE


def render_params(params: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items())


def render_section(result: dict[str, Any], image_dir: str, heading: str | None = None) -> str:
    """A record's section; `heading` replaces the scenario's own (whose
    anchor the scenario table links to) for a record that is not the latest."""
    runs = result["runs"]
    failed = [r for r in runs if r.get("error")]
    lines = [
        heading or f"## {result['scenario']}: {result['title']}",
        "",
        result["description"].strip(),
        "",
        "Variants: "
        + "; ".join(
            f"**{v['name']}**" + (f": {v['description']}" if v["description"] else "")
            for v in result["variants"]
        )
        + ".",
        "",
        *([warning, ""] if (warning := quiet_warning(result)) else []),
        render_table(result),
        "",
        f"Median [min{DASH}max] of {result['runs_per_variant']} run(s) per variant, run "
        f"alternately; {TIMES}ratio = median / median of the baseline variant, or of the "
        f"variant named after `vs` (for a metric that variant does not report: of the "
        f"baseline, else of the first variant that does); where the two variants' "
        f"min{DASH}max ranges overlap, the ratio is shown as {NO_CLEAR_DIFFERENCE}. "
        f"Recorded {result['created']} in {result['wall_seconds']:.0f} s by "
        f"`{command_line(result)}`; parameters: {render_params(result['params'])}.",
        "",
        f"Machine: {machine_line(result)}.",
        "",
        f"Load: {load_line(result)}.",
    ]
    if not result["load"].get("gate"):
        lines += ["", _before_rules(result)]
    if result.get("targets"):
        lines += ["", "Targets:", ""]
        lines += [render_target(t, result["summary"]) for t in result["targets"]]
    for prefix, downtime in downtime_verdicts(result).items():
        rows = f" ({prefix} rows)" if prefix else ""
        lines += ["", f"Downtime rule (thinvm.vm.downtime){rows}: {downtime.describe()}."]
    if failed:
        lines += ["", f"{len(failed)} run(s) failed and are left out of the table:"]
        lines += [f"- {r['variant']} run {r['run']}: {r['error']}" for r in failed]
    if result.get("plot"):
        lines += ["", f"![{result['scenario']}]({image_dir}/{result['plot']})"]
    return "\n".join(lines)


@dataclass(frozen=True)
class CatalogueEntry:
    """A scenario as the docs list it, measured or not."""

    name: str
    title: str
    command: str
    todo: str = ""  # why it is not (fully) implemented


INTRO = """\
# Benchmarks

Every thinvm feature has to prove its speed against the best stock setup in
the same run. For migration that is **stock-best**: the best stock QEMU
({qemu}) configuration measured in the same run (see "How results are
measured"), with the guest kernel's own virtio-balloon driver; **the
{times}ratios of migration tables are against stock-best**. **thinvm** is
likewise the best of thinvm's options (patched QEMU, our driver with page
ranges, reporting, sparse-ram, multifd; with and without hinting).
**legacy** (stock QEMU and driver, no extras, one stream) stays as a
reference row. Results recorded before these rules (their sections say so)
have a fixed stock-best: hinting, reporting and multifd (2 channels) with
its zero-page detection, QEMU's default since 9.0; and a fixed thinvm
(with hinting). Scenarios that do not migrate (inflate, density, start)
compare with stock QEMU and the guest kernel's own driver.

This page is regenerated by
`thinvm bench SCENARIO` (or `thinvm bench --report`) from the newest
`bench/results/SCENARIO-<UTC time>.json` of each scenario that measured its
targets with its guests' default kernel arguments and at least 5 runs per
variant (a record of a few rows only, such as an A/B of a time reference,
one made with `--guest-append`, or a one-pass probe does not displace it;
bench/notes.md quotes those; the other records README.md quotes follow in
full at the end);
do not edit it by hand. The JSON files hold every
raw run, the load on the machine, and the exact QEMU builds, guest
kernel, host and thinvm commit.

How to read the tables:

- Each run boots fresh guests and measures one thing. Variants run
  alternately (A B A B ...), so drift on the host hits all of them alike.
- A cell is `median [min{dash}max]` over the runs, then `{times}ratio`: the median
  divided by the baseline variant's median, or by the median of the variant
  named after `vs` (e.g. thinvm at 8 GiB against stock-best at 8 GiB).
- Targets (issue 13) are checked against the medians and say met or not
  met under each table that has them.
- Discard calls are counted on the host, on the QEMU process, with the
  kernel's syscall tracepoints (`perf stat -e syscalls:sys_enter_madvise`
  filtered on MADV_DONTNEED/FREE/REMOVE, plus fallocate), which cost almost
  nothing. `--counter strace` uses `strace -f -c` instead, but ptrace stops
  every QEMU syscall: on this machine it made a 1.75 GiB inflation 2.7x and
  its deflation 10x slower, so timings taken with strace attached are not
  comparable.
- Guests run under TCG on a 2-CPU host that is shared with other work
  (other guests, QEMU builds): absolute times are slow and noisy, which is
  why every section records the load. Compare ratios within one section,
  not absolute numbers across machines.
- Migrations run over loopback TCP with `max-bandwidth` raised to
  100 GiB/s (QEMU's default of 128 MiB/s would cap them) and
  `multifd-channels` 2 on both sides, for every variant alike (only the
  multifd variants use the channels); the downtime limit is QEMU's
  default (300 ms) unless a scenario's parameters say otherwise.
- Guests boot with their kernel's defaults; Debian's zero every page they
  allocate (`init_on_alloc=1`), also the free pages a hinting guest takes
  to hint them, which under TCG dominates hinting's guest work.
  `thinvm bench --guest-append ARGS` adds kernel arguments to every guest
  a scenario boots (for example `init_on_alloc=0`) and the record lists
  them as `guest_append`: compare its rows with a record made with the
  same arguments only.
- Since 2026-11-28 the source QEMU (the guest's vCPUs with it) and the
  destination QEMU of a migration run on CPUs of their own (each process's
  affinity, one CPU each on this 2-CPU machine), standing for two hosts,
  so that a CPU-bound side cannot starve the other; each run records the
  placement (`info.placement`). `thinvm bench --unpinned` lets them share
  the CPUs, as every record before that date did: compare a pinned record
  with an unpinned one only as a change of rules.
  On libvirt clusters libvirt starts the QEMUs and resets their affinity
  to every online CPU when the XML pins nothing, so there each simulated
  host's cpuset cgroup holds its CPU instead (source host CPU 0,
  destination CPU 1) and each run records `info.qemu_cpus`:
  `fleet-working-set` since 2026-11-28, `fleet-migrate` since 2026-11-29
  (its records before that shared both CPUs).
- A figure in README.md, docs/ or bench/notes.md that comes from a record
  is followed by a citation naming the record, row, metric and field
  (an HTML comment `cite RECORD ROW METRIC [median|min|max|ratio]`,
  invisible in the rendered page; a target's measured ratio is cited as
  `cite RECORD VARIANT[/REFERENCE] METRIC[/REFERENCE_METRIC] target`).
  `thinvm bench status` checks every one against its record (`--write`
  rewrites the figures from the records), and the unit
  test `test_cited_figures.py` fails on a figure its record does not hold
  and on a record named anywhere that does not exist.

## How results are measured

The machine is shared (2 CPUs, other engineers' builds and guests), so a
recorded result follows these rules (issue 19):

- **Quiet gate.** Before every run the harness waits until the 1-minute
  load average is below `--quiet-load` (default 1.5: a build on this
  2-CPU machine keeps it at 2 or more, our own previous run falls below
  1.5 within about 20 s) and no QEMU runs that
  the harness did not start (directly, or through a benchmark cluster's
  libvirtd: guests named `bench-*`), for at most `--quiet-wait` seconds
  (default 60); then the run starts anyway. Until 2026-11-30 the
  defaults were 1.0 and 600 s while the records since 2026-11-25 passed
  1.5 and 30-120 s; each record's load line states the gate it ran with. While the run goes on it
  looks for other QEMU processes every 5 s (the load average is then the
  run's own, so it is only recorded). A QEMU that has exited and waits
  to be reaped is not counted (on the fast cluster hosts, whose QEMUs this
  machine's PID 1 adopts and reaps 1-2 s late, a migration's source
  counted as another QEMU until 2026-11-30). A run is quiet when the gate was met
  at its start and no other QEMU appeared during it. Every run records
  what it saw; each section's load line states the gate that record ran
  with and how many runs were quiet, and a record with runs that were not
  says so above its table. Records made before 2026-11-28 were gated at
  their start only.
- **At least 5 runs per variant**, interleaved A B A B ..., unless `--runs`
  asks for fewer (then the section shows the smaller count). A record too
  long for one sitting may be finished with `--resume STEM`: only the
  passes it lacks are made, in the same order, and only with the same
  commit, builds, guest, parameters and gate; a pass the interruption cut
  is made again whole (a pass may carry state from variant to variant,
  such as overcommit's time bar); its load line names each sitting's start.
- **Spread and verdict.** A ratio is a gain or a loss only when the two
  variants' min{dash}max ranges are apart, i.e. every run of one beat every
  run of the other. Where the ranges overlap, the table prints **no clear
  difference** instead of the ratio, and a target met or missed on such
  ranges says so. The JSON keeps the ratio, the spread ((max {dash} min) /
  median) and the verdict of every metric.
- **stock-best as measured.** Each migration scenario measures seven stock
  configurations: free page reporting with and without hinting, each over
  multifd with 2 channels (`stock-hint-mfd2`, `stock-mfd2`), with 1 channel
  (`stock-hint-mfd1`, `stock-mfd1`) and without multifd (`stock-hint`,
  `stock-reporting`), and `legacy`. The **stock-best** row carries the
  figures of the one with the **lowest median migration time** in that run
  (on a tie, the first listed); its column head names it
  (`stock-best = stock-mfd2`). The **thinvm** row is chosen the same way
  from `thinvm-hint` and `thinvm-no-hint`. Per guest size or link the rows
  are named `8G-stock-best`, `veth-thinvm` and so on. migrate-postcopy's
  stock-best is chosen among the same stock configurations and stock's
  postcopy, save-restore's among every stock way to save (mapped-ram over
  two or one multifd channels, with or without hinting, one stream, the
  plain stream) by save + restore time, migrate-compress's among the same
  stock configurations and stock's multifd with compression, at each cap
  (records before 2026-11-29 compared fixed stacks).
- **The lab host's price for memory.** During each migration a probe
  faults 16 MiB of fresh memory in every second (thinvm.bench.hostcost):
  `host_fault_s_per_gib` (median) and `host_fault_max_s_per_gib` say what
  the host charged per GiB while the variant ran, ~0.09 s when its free
  memory was warm, ~2.2 s when its own hypervisor had taken it back.
- **Cost, not only time.** Every migration records the CPU seconds of the
  source and the destination QEMU from just before `migrate` until the
  source completes (source) or the guest runs again (destination), split by
  QEMU's thread names (guests run with `-name debug-threads=on`):
  `src_cpu_s`, `src_migration_cpu_s` (migration thread and helpers),
  `src_vcpu_cpu_s`, `src_multifd_cpu_s` (multifd channels),
  `src_other_cpu_s` (main loop and the rest), and the same for `dst_`. They
  come from `/proc/PID/task/TID/stat` (user + system time, 10 ms ticks) for
  the threads that still run at the end, and for each thread that exits
  during the migration (multifd channels do) from the record the kernel
  sends as it exits (taskstats: its name and the scheduler's CPU time), so
  a thread counts under its own kind however briefly it lived. The totals
  are the whole process's (`/proc/PID/stat`, which keeps the time of exited
  threads); what is left over (tick rounding) goes to other.
  `src_cpu_split_exact` (and `dst_`) is 1 when the split was counted so, 0
  when taskstats was unavailable (not root, a kernel without it or older
  than taskstats version 12): threads are then sampled every 100 ms, a
  thread that exits between two samples is not seen, and the time the
  samples miss goes to the kinds of the threads seen to exit, or to other if
  none was. On the destination,
  precopy loads the main stream in the main loop, so its cost shows in
  `dst_other_cpu_s`. Bytes sent and pages sent, read as zero and skipped
  unread come from `query-migrate`.
- **Warm host memory.** This lab's machines are themselves microVMs whose
  kernel reports free memory to their hypervisor (free page reporting,
  8 MiB blocks): memory free for ~2 s is taken back, and the next process
  to fault it in pays for the hypervisor backing it again, 2.2 s of CPU
  per GiB against 0.09 s for memory freed just before (measured
  2026-11-25). A destination QEMU faults in everything it receives, so
  before 2026-11-25 its CPU and the migration's time depended on what the
  host had done seconds earlier: perf put ~90% of a destination's 1.1 s in
  the kernel zeroing fresh huge pages, and the same runs took 0.15-0.24 s
  once warmed. From then until 2026-11-28, right before each migration the
  harness faulted in and released as much memory as the destination would
  populate, outside the measured window; the kernel hands out those
  unreported pages first, as a bare-metal host's memory always is. But
  released at once, that memory went cold again ~2 s into the migration:
  enough for a fast one, not for a 17 s one (the audit of issue 48). Since
  2026-11-28 the harness holds it (the source's RSS + 256 MiB, faulted in
  before the measured window) and hands it back in 64 MiB chunks, 512 MiB
  ahead of the destination QEMU's growing RSS (read every 50 ms), for the
  whole migration (`thinvm.host.memory.WarmReserve`); a restore, which
  reads its file in well under 2 s, still gets it released at once.
  `host_warm_s` records how long warming took (how cold the host was),
  `host_warm_unused_bytes` what the destination never took, and
  `host_fault_s_per_gib` what fresh memory cost during the run (a warm
  host: ~0.1 s); `THINVM_BENCH_WARM_HOST=0` turns warming off,
  and a record made so says it in its machine line (`host_warming`).

Run a scenario with `thinvm bench SCENARIO [--size SIZE] [--runs N]
[--variants a,b] [--param key=value]`; `thinvm bench --list` shows every
scenario with its defaults. `bench/run-baselines.sh` runs them all.
"""


def _before_rules(result: dict[str, Any]) -> str:
    """What a result recorded before issue 19's rules lacks."""
    text = (
        'Recorded before the rules of "How results are measured": no quiet gate, '
        f"{result['runs_per_variant']} run(s) per variant"
    )
    if result["main_metric"] == "migration_ms" and not any(
        "best_of" in v for v in result["variants"]
    ):
        text += ", stock-best and thinvm fixed configurations rather than the best measured"
    return text + "."


def render_document(
    results: Sequence[dict[str, Any]],
    catalogue: Sequence[CatalogueEntry],
    image_dir: str = "../bench/results",
    notes: str | None = None,
    cited: Sequence[dict[str, Any]] = (),
) -> str:
    """The whole page: the latest record of each scenario in `results`, and
    the other records the README quotes (`cited`), each in full."""
    by_name = {r["scenario"]: r for r in results}
    qemu = "not measured yet"
    for result in results:
        stock = result["environment"].get("qemu", {}).get("stock", {})
        if "version" in stock:
            qemu = f"{stock['version']}, Debian {stock.get('debian_version')}"
            break
    parts = [INTRO.format(qemu=qemu, dash=DASH, times=TIMES), "## Scenarios", ""]
    parts.append("| scenario | what | command | latest result |")
    parts.append("|---|---|---|---|")
    for entry in catalogue:
        found = by_name.get(entry.name)
        latest = found["created"] if found else "not run yet"
        older_rules = gate_watched(found) if found else ""
        if older_rules:
            latest += f" ({older_rules}: before the rules)"
        parts.append(
            f"| [{entry.name}](#{_anchor(found, entry)}) | {entry.title} | "
            f"`{entry.command}` | {latest} |"
        )
    known = {e.name for e in catalogue}
    ordered = [by_name[e.name] for e in catalogue if e.name in by_name]
    ordered += [r for r in results if r["scenario"] not in known]
    parts += ["", *render_targets_table([*ordered, *cited])]
    if notes:
        parts += ["", "## Observations", "", notes.strip()]
    todos = [e for e in catalogue if e.todo]
    if todos:
        parts += ["", "### Not implemented yet", ""]
        parts += [f"- **{e.name}**: {e.todo}" for e in todos]
    for result in ordered:
        parts += ["", render_section(result, image_dir)]
    if cited:
        parts += ["", "## Other records the README quotes", "", CITED_INTRO]
    for result in cited:
        heading = f"### {record_stem(result)}: {result['title']}"
        parts += ["", render_section(result, image_dir, heading)]
    return "\n".join(parts).rstrip() + "\n"


CITED_INTRO = (
    "Records that README.md quotes besides the latest of their scenario: "
    "another guest size, guests booted with other kernel arguments "
    "(`guest_append` in their parameters), an earlier kernel's record, or a "
    "record made before the newest one. Each in full, as above."
)


def record_stem(result: dict[str, Any]) -> str:
    """SCENARIO-STAMP, the name its JSON and plot files share."""
    return Path(result.get("plot") or result["scenario"]).stem


def render_targets_table(results: Sequence[dict[str, Any]]) -> list[str]:
    """Every target of every record shown here in one table: the list a
    reader checks the headline ratios against, met or not."""
    lines = [
        "## Targets at a glance",
        "",
        "Each target of the records below, as its section states it: the ratio "
        "of the two rows' medians, the bound, and the verdict (a target met or "
        "missed while the two rows' ranges overlap says so).",
        "",
        "| record, runs per row | target | rows | measured | bound | verdict |",
        "|---|---|---|---|---|---|",
    ]
    for result in results:
        for target in result.get("targets", []):
            lines.append(_target_row(result, target))
    return lines


def _target_row(result: dict[str, Any], target: dict[str, Any]) -> str:
    stem = f"{record_stem(result)}, {result['runs_per_variant']} runs"
    rows = _target_rows(target)
    bound = f"{LE} {format_ratio(target['at_most'])}"
    if target.get("ratio") is None:
        return f"| {stem} | {target['label']} | {rows} | not measured | {bound} | {DASH} |"
    outcome = "met" if target["met"] else "**not met**"
    if _ranges_overlap(target, result["summary"]):
        outcome += f" ({NO_CLEAR_DIFFERENCE})"
    measured = format_ratio(target["ratio"])
    return f"| {stem} | {target['label']} | {rows} | {measured} | {bound} | {outcome} |"


def _anchor(result: dict[str, Any] | None, entry: CatalogueEntry) -> str:
    """GitHub's anchor for the section heading `## name: title`."""
    title = result["title"] if result else entry.title
    heading = f"{entry.name}: {title}".lower()
    kept = "".join(c for c in heading if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


# -- plots -----------------------------------------------------------------


def _plot_scale(name: str) -> tuple[float, str]:
    unit = metric_unit(name)
    if unit == "bytes":
        return float(MiB), "MiB"
    return 1.0, unit


def plot_series(result: dict[str, Any], name: str) -> list[tuple[str, float, float, float]]:
    """(variant, median, min, max) in plot units, for the variants reporting it."""
    scale, _ = _plot_scale(name)
    series = []
    for variant in result["variants"]:
        entry = result["summary"][variant["name"]].get(name)
        if entry is not None:
            series.append(
                (
                    variant["name"],
                    entry["median"] / scale,
                    entry["min"] / scale,
                    entry["max"] / scale,
                )
            )
    return series


def bar_label(value: float) -> str:
    """1234.5 -> 1,234; 12.345 -> 12.3; 0.01234 -> 0.0123."""
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def plot_result(result: dict[str, Any], path: Path) -> Path:
    """Median bars with min/max error bars, one panel per plotted metric."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [m for m in (result["main_metric"], result.get("second_metric")) if m]
    fig, axes = plt.subplots(1, len(metrics), figsize=(5.2 * len(metrics), 4.0), squeeze=False)
    for ax, name in zip(axes[0], metrics, strict=True):
        series = plot_series(result, name)
        _, unit = _plot_scale(name)
        if not series:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        else:
            labels = [s[0] for s in series]
            medians = [s[1] for s in series]
            errors = [[s[1] - s[2] for s in series], [s[3] - s[1] for s in series]]
            colors = ["#777777" if v == result["baseline"] else "#3b75af" for v in labels]
            bars = ax.bar(labels, medians, yerr=errors, capsize=6, color=colors)
            ax.bar_label(bars, labels=[bar_label(m) for m in medians], padding=3, fontsize=8)
            ax.tick_params(axis="x", labelrotation=15 if len(labels) > 2 else 0, labelsize=8)
        ax.set_title(metric_label(name), fontsize=10)
        ax.set_ylabel(unit if unit != "count" else "count")
        ax.margins(y=0.15)
    fig.suptitle(
        f"{result['scenario']}: {result['title']} "
        f"(median, min{DASH}max of {result['runs_per_variant']} runs; {result['created']})",
        fontsize=9,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
