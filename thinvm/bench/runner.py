"""Run a scenario's variants alternately, record the result, regenerate the docs.

`thinvm bench` lands in main().  A run writes
bench/results/SCENARIO-<UTC stamp>.json (thinvm.bench.results), a PNG plot
next to it, and regenerates docs/benchmarks.md from the latest result of
every scenario (thinvm.bench.report).  While it runs, each finished run
is appended to SCENARIO-<stamp>.runs.jsonl beside it, removed once the
result is written, kept if the record is interrupted.  The scenarios live in
thinvm.bench.scenarios; host-side probes (syscall counters, network
namespaces, memory cgroups) in thinvm.bench.probe.
"""

import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import nullcontext
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from thinvm.bench import citations, probe, report, resume, scenarios
from thinvm.bench.environment import guest_environment, host_environment
from thinvm.bench.quiet import Observation, QuietGate, RunWatch, wait_quiet
from thinvm.bench.results import (
    DOCS_PATH,
    NOTES_PATH,
    RESULTS_DIR,
    build_result,
    iso_stamp,
    latest_results,
    load_results,
    result_stem,
    validate_result,
    write_result,
)
from thinvm.bench.types import BenchOptions, Metric, RunContext, Scenario, Variant
from thinvm.errors import ThinvmError
from thinvm.progress import ProgressLine

# Outside `thinvm bench` runs (tests) only record what the machine was like.
RECORD_ONLY = QuietGate(max_wait_s=0)

# What `thinvm bench` (thinvm.cli) uses; the options type and the default
# paths are re-exported so the CLI needs this one module.
__all__ = ["DOCS_PATH", "RESULTS_DIR", "BenchOptions", "main", "regenerate_docs", "run"]


def alternation_order(variants: Sequence[str], runs: int) -> list[tuple[int, str]]:
    """(run number, variant) pairs: A B A B ..., so drift hits all variants alike."""
    if runs < 1:
        raise ThinvmError(f"--runs must be at least 1, not {runs}")
    if not variants:
        raise ThinvmError("no variants to run")
    return [(k, name) for k in range(1, runs + 1) for name in variants]


def _loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def run_scenario(
    scenario: Scenario,
    runs: int,
    line: ProgressLine | None = None,
    gate: QuietGate = RECORD_ONLY,
    runs_log: Path | None = None,
    earlier: Sequence[dict[str, Any]] = (),
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run every variant `runs` times, alternately; returns (runs, load record).

    Each run waits for the quiet `gate` first (by default it only records
    what it sees).  Each finished run is appended to `runs_log` (JSON
    lines) at once: a record of an hour that is interrupted keeps what it
    measured.  The (run, variant) pairs of `earlier` runs (an interrupted
    record's, thinvm.bench.resume) are not run again.
    """
    order = alternation_order([v.name for v in scenario.variants], runs)
    by_name = {v.name: v for v in scenario.variants}
    line = line or ProgressLine(f"[bench {scenario.name}] ")
    records: list[dict[str, Any]] = list(earlier)
    done = {(int(r["run"]), str(r["variant"])) for r in earlier}
    load: dict[str, Any] = {"start": _loadavg(), "cpus": os.cpu_count()}
    with scenario.context() if scenario.context else nullcontext():
        for index, (k, name) in enumerate(order, 1):
            if (k, name) in done:
                continue
            head = f"run {k}/{runs} {name} [{index}/{len(order)}]"
            line.update(head, force=True)
            ctx = RunContext(
                scenario.name,
                name,
                k,
                runs,
                progress=lambda text, head=head: line.update(f"{head}: {text}"),  # type: ignore[misc]
            )
            record = _measure(by_name[name], ctx, _wait_quiet(gate, line, head), gate)
            records.append(record)
            if runs_log is not None:
                with runs_log.open("a") as log:
                    log.write(json.dumps(record, default=str) + "\n")
            outcome = f"error: {record['error']}" if record.get("error") else "done"
            line.update(f"{head}: {outcome} in {record['seconds']:.0f} s", force=True)
    load["end"] = _loadavg()
    failed = sum(1 for r in records if r.get("error"))
    line.done(f"{len(records) - failed}/{len(records)} runs succeeded")
    return records, load


def _wait_quiet(gate: QuietGate, line: ProgressLine, head: str) -> dict[str, Any]:
    def show(seen: Observation, waited: float) -> None:
        line.update(
            f"{head}: waiting for a quiet machine ({waited:.0f}/{gate.max_wait_s:.0f} s): "
            f"load {seen.load:.2f} (want < {gate.max_load:g}), other QEMUs {seen.other_qemu}",
            force=True,
        )

    return wait_quiet(gate, on_wait=show)


def _measure(
    variant: Variant, ctx: RunContext, quiet: dict[str, Any], gate: QuietGate
) -> dict[str, Any]:
    record: dict[str, Any] = {
        "variant": variant.name,
        "run": ctx.run,
        "started": iso_stamp(datetime.now(UTC)),
        "load_start": _loadavg(),
        "other_qemu": quiet["other_qemu"],
        "quiet": quiet,
    }
    start = time.monotonic()
    watch = RunWatch(gate.poll_s)
    try:
        with watch:
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
    record["quiet"] = {**quiet, **watch.as_record()}
    record["load_end"] = _loadavg()
    record["info"] = ctx.info
    return record


def _plain(value: Metric) -> Metric:
    if isinstance(value, float):
        return round(value, 6)
    return value


def regenerate_docs(
    directory: Path = RESULTS_DIR, docs: Path = DOCS_PATH, notes: Path = NOTES_PATH
) -> Path:
    """Rewrite docs/benchmarks.md from the latest JSON of every scenario,
    quoting the hand-written observations in `notes` if that file exists."""
    results = load_results(directory)
    image_dir = os.path.relpath(directory, docs.parent)
    text = report.render_document(
        results,
        scenarios.catalogue(),
        image_dir=image_dir,
        notes=notes.read_text() if notes.is_file() else None,
        cited=readme_records(directory, {report.record_stem(r) for r in results}),
    )
    docs.parent.mkdir(parents=True, exist_ok=True)
    docs.write_text(text)
    return docs


def readme_records(directory: Path, shown: set[str]) -> list[dict[str, Any]]:
    """The records README.md (beside `directory`'s bench/) cites that are
    not among `shown`, oldest first."""
    readme = directory.parent.parent / "README.md"
    if not readme.is_file():
        return []
    stems = {c.record for c in citations.citations_in(Path(readme.name), readme.read_text())}
    records = []
    for stem in sorted(stems - shown, key=lambda s: s.rsplit("-", 1)[-1]):
        path = directory / f"{stem}.json"
        if path.is_file():
            data = json.loads(path.read_text())
            validate_result(data)
            records.append(data)
    return records


def _start_record(
    scenario: Scenario,
    runs: int,
    gate: QuietGate,
    environment: dict[str, Any],
    command: Sequence[str],
    created: datetime,
) -> dict[str, Any]:
    """What a record starts with (thinvm.bench.resume keeps it beside the runs)."""
    return {
        "created": iso_stamp(created),
        "command": list(command),
        "scenario": scenario.name,
        "params": scenario.params,
        "variants": [v.name for v in scenario.variants],
        "runs": runs,
        "gate": gate.as_record(),
        "environment": environment,
        "sittings": [iso_stamp(created)],
        "wall_seconds": 0.0,
    }


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
    spec = scenarios.get(name)
    scenario = spec.build(options)
    if options.variants:
        scenario.select(options.variants)
    runs = options.runs or spec.runs
    gate = QuietGate(max_load=options.quiet_load, max_wait_s=options.quiet_wait)
    created = datetime.now(UTC)
    environment = {
        **host_environment(),
        **guest_environment(options.build, options.kernel, options.driver, options.accel),
    }
    environment["counter"] = probe.counter_backend(options.counter)
    start = time.monotonic()
    results_dir.mkdir(parents=True, exist_ok=True)
    started = _start_record(scenario, runs, gate, environment, command, created)
    earlier: list[dict[str, Any]] = []
    if options.resume:
        started, earlier = resume.resumed(results_dir, options.resume, started)
        created = resume.parse_stamp(started["created"])
    stem = result_stem(name, created)
    runs_log = results_dir / f"{stem}{resume.RUNS_SUFFIX}"
    resume.write_start(results_dir, stem, started)
    try:
        records, load = run_scenario(scenario, runs, line, gate, runs_log, earlier)
    except BaseException:
        started["wall_seconds"] += time.monotonic() - start
        resume.write_start(results_dir, stem, started)
        if runs_log.exists():
            done = len(runs_log.read_text().splitlines())
            print(
                f"interrupted: the {done} finished runs are in {runs_log}; "
                f"finish the record with the same command and --resume {stem}",
                file=sys.stderr,
            )
        raise
    load["gate"] = gate.as_record()
    load.update(resume.sittings_record(started))
    errors = [r["error"] for r in records if r.get("error")]
    if len(errors) == len(records):
        resume.remove(results_dir, stem)
        raise ThinvmError(
            f"all {len(records)} runs of {name} failed, nothing written; first error: {errors[0]}"
        )
    result = build_result(
        scenario,
        records,
        created=created,
        environment=environment,
        load=load,
        command=started["command"],
        wall_seconds=started["wall_seconds"] + time.monotonic() - start,
    )
    result["plot"] = f"{stem}.png"
    validate_result(result)
    path = write_result(result, results_dir, stem)
    resume.remove(results_dir, stem)
    report.plot_result(result, results_dir / f"{stem}.png")
    if docs is not None:
        regenerate_docs(results_dir, docs, results_dir.parent / "notes.md")
    return path


def iter_scenarios() -> Iterator[tuple[str, str, str]]:
    """(name, default size, one-line title) of every scenario."""
    for spec in scenarios.SCENARIOS.values():
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
    if list_only:
        for spec in scenarios.SCENARIOS.values():
            print(scenarios.describe_spec(spec))
        return 0
    if report_only:
        for result_path in latest_results(results_dir).values():
            result = json.loads(result_path.read_text())
            if result.get("plot"):
                report.plot_result(result, results_dir / result["plot"])
        path = regenerate_docs(results_dir, docs or DOCS_PATH, results_dir.parent / "notes.md")
        print(f"regenerated {path} and the plots of the latest results")
        return 0
    if not scenario:
        raise ThinvmError("name a scenario (see 'thinvm bench --list'), or pass --report")
    path = run(scenario, options, results_dir=results_dir, docs=docs, command=sys.argv)
    result = json.loads(path.read_text())
    print(report.render_table(result))
    if result.get("targets"):
        print("\nTargets:")
        print("\n".join(report.render_target(t, result["summary"]) for t in result["targets"]))
    print(f"\nresults: {path}\nplot:    {path.with_suffix('.png')}")
    if docs is not None:
        print(f"docs:    {docs}")
    failed = sum(1 for r in result["runs"] if r.get("error"))
    return 1 if failed else 0
