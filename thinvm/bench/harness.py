"""Benchmark harness: run a scenario's variants alternately, summarise, record.

A Scenario has named Variants; each variant is a callable that performs ONE
measurement (usually: boot fresh guests, do one thing, tear down) and
returns a dict of numeric metrics.  The harness runs the variants
alternately (A B A B ...), N runs each, so slow drift of a shared machine
hits every variant alike; it then computes per-metric median/min/max and the
ratio of each variant's median to its reference variant's (the scenario's
baseline unless the variant names another), checks the scenario's targets,
and writes
bench/results/SCENARIO-<UTC stamp>.json (raw runs, summary, environment),
a PNG plot next to it, and regenerates docs/benchmarks.md from the latest
result of every scenario.

The scenarios themselves live in thinvm.bench.scenarios; the report
(markdown and plot) in thinvm.bench.report; host-side probes (syscall
counters, network namespaces, memory cgroups) in thinvm.bench.probe.
"""

import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from thinvm.errors import ThinvmError
from thinvm.paths import REPO
from thinvm.progress import ProgressLine

SCHEMA_VERSION = 1
RESULTS_DIR = REPO / "bench" / "results"
DOCS_PATH = REPO / "docs" / "benchmarks.md"
NOTES_PATH = REPO / "bench" / "notes.md"  # hand-written observations, quoted in the docs
STAMP_FORMAT = "%Y%m%dT%H%M%SZ"
_RESULT_NAME = re.compile(r"^(?P<scenario>[a-z0-9][a-z0-9-]*)-(?P<stamp>\d{8}T\d{6}Z)\.json$")

Metric = float | int | None
Metrics = dict[str, Metric]


# -- scenario model --------------------------------------------------------


@dataclass
class RunContext:
    """What a variant's measurement gets from the harness."""

    scenario: str
    variant: str
    run: int  # 1-based run number of this variant
    runs: int
    progress: Callable[[str], None] = lambda _text: None
    info: dict[str, Any] = field(default_factory=dict)

    def step(self, text: str) -> None:
        """Show what the run is doing now on the progress line."""
        self.progress(text)

    def note(self, key: str, value: Any) -> None:
        """Record a non-numeric fact about this run (accel, a guest's output)."""
        self.info[key] = value


@dataclass(frozen=True)
class Variant:
    name: str
    run: Callable[[RunContext], Metrics]
    description: str = ""
    # The variant this one's ratios are taken against; default: the
    # scenario's baseline.  E.g. thinvm at 8 GiB against stock at 8 GiB.
    reference: str | None = None


@dataclass(frozen=True)
class Target:
    """A goal stated as a ratio: `variant`'s median `metric` / `reference`'s <= at_most.

    "thinvm at least 3x faster than stock-best" is
    Target(..., "thinvm", "stock-best", "migration_ms", at_most=1 / 3).
    """

    label: str
    variant: str
    reference: str
    metric: str
    at_most: float


@dataclass
class Scenario:
    name: str
    title: str
    description: str  # markdown: what it measures and how
    variants: list[Variant]
    main_metric: str
    second_metric: str | None = None
    baseline: str | None = None  # default: the first variant
    params: dict[str, Any] = field(default_factory=dict)
    targets: list[Target] = field(default_factory=list)
    # Entered once around all runs (e.g. a veth link, a memory cgroup).
    context: Callable[[], AbstractContextManager[Any]] | None = None

    @property
    def baseline_name(self) -> str:
        return self.baseline or self.variants[0].name

    @property
    def references(self) -> dict[str, str]:
        """Variant -> the variant its ratios are taken against, where that was run."""
        names = {v.name for v in self.variants}
        return {
            v.name: v.reference
            for v in self.variants
            if v.reference is not None and v.reference in names and v.reference != v.name
        }

    def select(self, names: Sequence[str]) -> None:
        """Keep only the named variants, in the order given."""
        known = {v.name: v for v in self.variants}
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ThinvmError(
                f"scenario {self.name} has no variant {', '.join(unknown)}: "
                f"choose from {', '.join(known)}"
            )
        self.variants = [known[n] for n in names]
        if self.baseline not in names:
            self.baseline = None


# -- pure logic ------------------------------------------------------------


def alternation_order(variants: Sequence[str], runs: int) -> list[tuple[int, str]]:
    """(run number, variant) pairs: A B A B ..., so drift hits all variants alike."""
    if runs < 1:
        raise ThinvmError(f"--runs must be at least 1, not {runs}")
    if not variants:
        raise ThinvmError("no variants to run")
    return [(k, name) for k in range(1, runs + 1) for name in variants]


def summarize(values: Sequence[Metric]) -> dict[str, float | int] | None:
    """Median, min, max and count of the values that were measured (not None)."""
    measured = [v for v in values if v is not None]
    if not measured:
        return None
    return {
        "median": statistics.median(measured),
        "min": min(measured),
        "max": max(measured),
        "n": len(measured),
    }


def metric_names(runs: Sequence[dict[str, Any]]) -> list[str]:
    """Every metric any run reported, in first-seen order."""
    names: dict[str, None] = {}
    for run in runs:
        for name in run.get("metrics", {}):
            names.setdefault(name, None)
    return list(names)


def summarize_runs(
    runs: Sequence[dict[str, Any]],
    variants: Sequence[str],
    baseline: str,
    references: Mapping[str, str] | None = None,
) -> dict[str, dict[str, dict[str, Any]]]:
    """summary[variant][metric] = {median, min, max, n, ratio, ratio_to}.

    `ratio` is this variant's median over its reference's median: the
    variant `references` names for it, else the baseline.  For a metric the
    reference does not report (a no-migration baseline has no migration
    time), it is the baseline, then the first variant in run order that
    does.  A variant that is its own reference has no ratio.
    """
    names = metric_names(runs)
    summary: dict[str, dict[str, dict[str, Any]]] = {}
    for variant in variants:
        mine = [r for r in runs if r["variant"] == variant and not r.get("error")]
        summary[variant] = {}
        for name in names:
            stats = summarize([r["metrics"].get(name) for r in mine])
            if stats is not None:
                summary[variant][name] = dict(stats)
    fallback = [baseline, *[v for v in variants if v != baseline]]
    for name in names:
        for variant in variants:
            entry = summary[variant].get(name)
            if entry is None:
                continue
            own = (references or {}).get(variant)
            order = [own, *fallback] if own is not None and own in summary else fallback
            reference = next((v for v in order if name in summary[v]), None)
            if reference is None or variant == reference:
                entry["ratio"], entry["ratio_to"] = None, None
                continue
            entry["ratio"] = ratio(entry["median"], summary[reference][name]["median"])
            entry["ratio_to"] = reference
    return summary


def evaluate_targets(
    summary: Mapping[str, Mapping[str, Mapping[str, Any]]], targets: Sequence[Target]
) -> list[dict[str, Any]]:
    """Each target with its measured ratio and whether it is met (None: not measured)."""
    evaluated = []
    for target in targets:
        value = summary.get(target.variant, {}).get(target.metric)
        reference = summary.get(target.reference, {}).get(target.metric)
        measured = (
            ratio(value["median"], reference["median"])
            if value is not None and reference is not None
            else None
        )
        evaluated.append(
            {
                **asdict(target),
                "ratio": measured,
                "met": None if measured is None else measured <= target.at_most,
            }
        )
    return evaluated


def ratio(value: float, reference: float) -> float | None:
    """value / reference; None when the reference is zero."""
    if reference == 0:
        return None if value != 0 else 1.0
    return value / reference


def result_stem(scenario: str, when: datetime) -> str:
    return f"{scenario}-{when.astimezone(UTC).strftime(STAMP_FORMAT)}"


def parse_result_name(filename: str) -> tuple[str, str] | None:
    """(scenario, stamp) of a results file name, or None if it is not one."""
    match = _RESULT_NAME.match(filename)
    return (match["scenario"], match["stamp"]) if match else None


def latest_results(directory: Path) -> dict[str, Path]:
    """The newest results JSON of every scenario found in directory."""
    latest: dict[str, tuple[str, Path]] = {}
    if not directory.is_dir():
        return {}
    for path in directory.glob("*.json"):
        parsed = parse_result_name(path.name)
        if parsed is None:
            continue
        scenario, stamp = parsed
        if scenario not in latest or stamp > latest[scenario][0]:
            latest[scenario] = (stamp, path)
    return {name: path for name, (_, path) in sorted(latest.items())}


REQUIRED_FIELDS = (
    "schema",
    "scenario",
    "title",
    "description",
    "created",
    "params",
    "variants",
    "baseline",
    "main_metric",
    "runs",
    "summary",
    "environment",
    "load",
)


def validate_result(data: dict[str, Any]) -> None:
    """Raise ThinvmError if a results document lacks what the report needs."""
    missing = [key for key in REQUIRED_FIELDS if key not in data]
    if missing:
        raise ThinvmError(f"benchmark result lacks {', '.join(missing)}")
    names = [v["name"] for v in data["variants"]]
    if data["baseline"] not in names:
        raise ThinvmError(f"baseline {data['baseline']!r} is not one of the variants {names}")
    for run in data["runs"]:
        for key in ("variant", "run", "metrics", "load_start", "load_end"):
            if key not in run:
                raise ThinvmError(f"benchmark run lacks {key}: {run}")
    if set(data["summary"]) != set(names):
        raise ThinvmError("benchmark summary does not cover exactly the variants")


def build_result(
    scenario: Scenario,
    runs: list[dict[str, Any]],
    *,
    created: datetime,
    environment: dict[str, Any],
    load: dict[str, Any],
    command: Sequence[str] = (),
    wall_seconds: float = 0.0,
) -> dict[str, Any]:
    """The results document (the JSON written to bench/results/)."""
    variants = [v.name for v in scenario.variants]
    references = scenario.references
    summary = summarize_runs(runs, variants, scenario.baseline_name, references)
    return {
        "schema": SCHEMA_VERSION,
        "scenario": scenario.name,
        "title": scenario.title,
        "description": scenario.description,
        "created": created.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": list(command),
        "params": scenario.params,
        "variants": [
            {"name": v.name, "description": v.description, "reference": references.get(v.name)}
            for v in scenario.variants
        ],
        "baseline": scenario.baseline_name,
        "main_metric": scenario.main_metric,
        "second_metric": scenario.second_metric,
        "runs_per_variant": max((r["run"] for r in runs), default=0),
        "runs": runs,
        "summary": summary,
        "targets": evaluate_targets(summary, scenario.targets),
        "environment": environment,
        "load": load,
        "wall_seconds": round(wall_seconds, 1),
    }


# -- running ---------------------------------------------------------------


def _loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _other_qemu_count() -> int:
    """QEMU processes on the host at a run's start (none of them ours)."""
    out = subprocess.run(
        ["pgrep", "-c", "qemu-system"], capture_output=True, text=True, check=False
    ).stdout
    return int(out.strip() or 0)


def run_scenario(
    scenario: Scenario, runs: int, line: ProgressLine | None = None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run every variant `runs` times, alternately; returns (runs, load record)."""
    order = alternation_order([v.name for v in scenario.variants], runs)
    by_name = {v.name: v for v in scenario.variants}
    line = line or ProgressLine(f"[bench {scenario.name}] ")
    records: list[dict[str, Any]] = []
    load: dict[str, Any] = {"start": _loadavg(), "cpus": os.cpu_count()}
    with scenario.context() if scenario.context else nullcontext():
        for index, (k, name) in enumerate(order, 1):
            head = f"run {k}/{runs} {name} [{index}/{len(order)}]"
            line.update(head, force=True)
            ctx = RunContext(
                scenario.name,
                name,
                k,
                runs,
                progress=lambda text, head=head: line.update(f"{head}: {text}"),  # type: ignore[misc]
            )
            record = _measure(by_name[name], ctx)
            records.append(record)
            outcome = f"error: {record['error']}" if record.get("error") else "done"
            line.update(f"{head}: {outcome} in {record['seconds']:.0f} s", force=True)
    load["end"] = _loadavg()
    failed = sum(1 for r in records if r.get("error"))
    line.done(f"{len(records) - failed}/{len(records)} runs succeeded")
    return records, load


def _measure(variant: Variant, ctx: RunContext) -> dict[str, Any]:
    record: dict[str, Any] = {
        "variant": variant.name,
        "run": ctx.run,
        "started": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "load_start": _loadavg(),
        "other_qemu": _other_qemu_count(),
    }
    start = time.monotonic()
    try:
        metrics = variant.run(ctx)
        record["metrics"] = {k: _plain(v) for k, v in metrics.items()}
    except Exception as exc:
        # A failed measurement is recorded and left out of the summary; the
        # other runs still count.  Unexpected exceptions are recorded with
        # their type, so a bug shows in the results instead of ending a
        # long run.
        record["metrics"] = {}
        record["error"] = str(exc) if isinstance(exc, ThinvmError) else repr(exc)
    record["seconds"] = round(time.monotonic() - start, 2)
    record["load_end"] = _loadavg()
    record["info"] = ctx.info
    return record


def _plain(value: Metric) -> Metric:
    if isinstance(value, float):
        return round(value, 6)
    return value


# -- environment -----------------------------------------------------------


def _first_line(cmd: list[str]) -> str:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=REPO)
    except OSError:
        return ""
    return proc.stdout.strip().splitlines()[0] if proc.stdout.strip() else ""


def _bracketed(path: str) -> str:
    """The selected value of a sysfs choice file: 'always [madvise] never' -> madvise."""
    try:
        text = Path(path).read_text()
    except OSError:
        return "unknown"
    match = re.search(r"\[(\w+)\]", text)
    return match.group(1) if match else text.strip()


def cpu_model(cpuinfo: str) -> str:
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            return value.strip()
    return "unknown"


def host_environment() -> dict[str, Any]:
    """Facts about the host that decide what the numbers mean."""
    from thinvm.host.memory import host_meminfo

    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    meminfo = host_meminfo()
    # Uncommitted or untracked changes to the code that ran make the commit
    # an incomplete description.
    status = _first_line(["git", "status", "--porcelain", "--", "thinvm", "guest", "qemu"])
    return {
        "cpu_model": cpu_model(cpuinfo),
        "nproc": os.cpu_count(),
        "mem_total": meminfo.get("MemTotal"),
        "swap_total": meminfo.get("SwapTotal", 0),
        "host_kernel": platform.release(),
        "thp_enabled": _bracketed("/sys/kernel/mm/transparent_hugepage/enabled"),
        "thp_defrag": _bracketed("/sys/kernel/mm/transparent_hugepage/defrag"),
        "thinvm_commit": _first_line(["git", "rev-parse", "--short=12", "HEAD"]) or "unknown",
        "thinvm_dirty": bool(status),
        "python": platform.python_version(),
    }


def guest_environment(build: str, kernel: str, driver: str, accel: str) -> dict[str, Any]:
    """Both QEMU builds, the guest kernel and the accelerator the guests use."""
    from thinvm.guest.image import ensure_image
    from thinvm.qemu import accel as accel_mod
    from thinvm.qemu import builds

    qemu: dict[str, Any] = {}
    for flavour in builds.FLAVOURS:
        try:
            qemu[flavour] = builds.find_build(flavour).describe()
        except (ThinvmError, OSError, subprocess.CalledProcessError) as exc:
            qemu[flavour] = {"flavour": flavour, "error": str(exc)}
    image = ensure_image(kernel, driver)
    return {
        "qemu": qemu,
        "qemu_used": build,
        "guest_kernel": image.kernel_version,
        "guest_kernel_package": str(image.meta.get("package_version", "unknown")),
        "guest_kernel_series": kernel,
        "guest_driver": driver,
        "accel": accel_mod.resolve(accel, builds.find_build(build)),
    }


# -- writing ---------------------------------------------------------------


def write_result(result: dict[str, Any], directory: Path, stem: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{stem}.json"
    path.write_text(json.dumps(result, indent=1, sort_keys=False) + "\n")
    return path


def load_results(directory: Path) -> list[dict[str, Any]]:
    """The latest result of every scenario, validated."""
    results = []
    for path in latest_results(directory).values():
        data = json.loads(path.read_text())
        validate_result(data)
        results.append(data)
    return results


def regenerate_docs(
    directory: Path = RESULTS_DIR, docs: Path = DOCS_PATH, notes: Path = NOTES_PATH
) -> Path:
    """Rewrite docs/benchmarks.md from the latest JSON of every scenario,
    quoting the hand-written observations in `notes` if that file exists."""
    from thinvm.bench import report as bench_report
    from thinvm.bench import scenarios as bench_scenarios

    results = load_results(directory)
    image_dir = os.path.relpath(directory, docs.parent)
    text = bench_report.render_document(
        results,
        bench_scenarios.catalogue(),
        image_dir=image_dir,
        notes=notes.read_text() if notes.is_file() else None,
    )
    docs.parent.mkdir(parents=True, exist_ok=True)
    docs.write_text(text)
    return docs


@dataclass
class BenchOptions:
    """How to run a scenario; the CLI fills it from its flags."""

    size: int | None = None
    runs: int | None = None
    variants: list[str] = field(default_factory=list)
    params: dict[str, str] = field(default_factory=dict)
    build: str = "stock"
    kernel: str = "6.1"
    driver: str = "stock"
    accel: str = "auto"
    counter: str = "auto"
    net: str = "loopback"


def run(
    name: str,
    options: BenchOptions,
    *,
    results_dir: Path = RESULTS_DIR,
    docs: Path | None = DOCS_PATH,
    command: Sequence[str] = (),
    line: ProgressLine | None = None,
) -> Path:
    """Run one scenario end to end; returns the results JSON path."""
    from thinvm.bench import report as bench_report
    from thinvm.bench import scenarios as bench_scenarios

    spec = bench_scenarios.get(name)
    scenario = spec.build(options)
    if options.variants:
        scenario.select(options.variants)
    runs = options.runs or spec.default_runs
    created = datetime.now(UTC)
    environment = {
        **host_environment(),
        **guest_environment(options.build, options.kernel, options.driver, options.accel),
    }
    from thinvm.bench.probe import counter_backend

    environment["counter"] = counter_backend(options.counter)
    start = time.monotonic()
    records, load = run_scenario(scenario, runs, line)
    errors = [r["error"] for r in records if r.get("error")]
    if len(errors) == len(records):
        raise ThinvmError(
            f"all {len(records)} runs of {name} failed, nothing written; first error: {errors[0]}"
        )
    result = build_result(
        scenario,
        records,
        created=created,
        environment=environment,
        load=load,
        command=command,
        wall_seconds=time.monotonic() - start,
    )
    stem = result_stem(name, created)
    result["plot"] = f"{stem}.png"
    validate_result(result)
    path = write_result(result, results_dir, stem)
    bench_report.plot_result(result, results_dir / f"{stem}.png")
    if docs is not None:
        regenerate_docs(results_dir, docs, results_dir.parent / "notes.md")
    return path


def iter_scenarios() -> Iterator[tuple[str, str, str]]:
    """(name, default size, one-line title) of every scenario."""
    from thinvm.bench import scenarios as bench_scenarios

    for spec in bench_scenarios.SCENARIOS.values():
        yield spec.name, spec.default_size, spec.title


def main(
    scenario: str | None,
    options: BenchOptions,
    *,
    list_only: bool = False,
    report_only: bool = False,
    results_dir: Path = RESULTS_DIR,
    docs: Path | None = DOCS_PATH,
) -> int:
    """Entry point for `thinvm bench`."""
    from thinvm.bench import report as bench_report
    from thinvm.bench import scenarios as bench_scenarios

    if list_only:
        for spec in bench_scenarios.SCENARIOS.values():
            print(bench_scenarios.describe_spec(spec))
        return 0
    if report_only:
        for result_path in latest_results(results_dir).values():
            result = json.loads(result_path.read_text())
            if result.get("plot"):
                bench_report.plot_result(result, results_dir / result["plot"])
        path = regenerate_docs(results_dir, docs or DOCS_PATH, results_dir.parent / "notes.md")
        print(f"regenerated {path} and the plots of the latest results")
        return 0
    if not scenario:
        raise ThinvmError("name a scenario (see 'thinvm bench --list'), or pass --report")
    path = run(scenario, options, results_dir=results_dir, docs=docs, command=sys.argv)
    result = json.loads(path.read_text())
    print(bench_report.render_table(result))
    print(f"\nresults: {path}\nplot:    {path.with_suffix('.png')}")
    if docs is not None:
        print(f"docs:    {docs}")
    failed = sum(1 for r in result["runs"] if r.get("error"))
    return 1 if failed else 0
