"""Benchmark results: statistics over runs, ratios, targets and result files.

The harness runs each variant alternately (A B A B ...), N runs each, so
slow drift of a shared machine hits every variant alike; this module then
computes per-metric median/min/max and the ratio of each variant's median
to its reference variant's (the scenario's baseline unless the variant
names another), checks the scenario's targets, and reads and writes
bench/results/SCENARIO-<UTC stamp>.json (raw runs, summary, environment).
"""

import copy
import json
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from thinvm.bench.types import MIN_RUNS, Best, Metric, Scenario, Target
from thinvm.errors import ThinvmError
from thinvm.paths import REPO
from thinvm.vm.downtime import QEMU_DEFAULT_LIMIT_MS, DowntimeVerdict

SCHEMA_VERSION = 1
RESULTS_DIR = REPO / "bench" / "results"
DOCS_PATH = REPO / "docs" / "benchmarks.md"
NOTES_PATH = REPO / "bench" / "notes.md"  # hand-written observations, quoted in the docs
STAMP_FORMAT = "%Y%m%dT%H%M%SZ"
_RESULT_NAME = re.compile(r"^(?P<scenario>[a-z0-9][a-z0-9-]*)-(?P<stamp>\d{8}T\d{6}Z)\.json$")


def summarize(values: Sequence[Metric]) -> dict[str, float | int | None] | None:
    """Median, min, max, count and spread of the values measured (not None)."""
    measured = [v for v in values if v is not None]
    if not measured:
        return None
    stats: dict[str, float | int | None] = {
        "median": statistics.median(measured),
        "min": min(measured),
        "max": max(measured),
        "n": len(measured),
    }
    stats["spread"] = spread(stats)
    return stats


def spread(stats: Mapping[str, Any]) -> float | None:
    """(max - min) / median: how far apart the runs were, relative to their middle.

    None when the median is zero (nothing to be relative to).
    """
    if not stats["median"]:
        return None
    return round(float(stats["max"] - stats["min"]) / abs(float(stats["median"])), 4)


NO_CLEAR_DIFFERENCE = "no clear difference"


def ranges_overlap(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether the min..max ranges of two summaries share a value."""
    return bool(a["min"] <= b["max"] and b["min"] <= a["max"])


def verdict(entry: Mapping[str, Any], reference: Mapping[str, Any] | None) -> str | None:
    """What a ratio may claim: "lower", "higher" or "no clear difference".

    A difference is clear only when every run of one variant lies beyond
    every run of the other: if the min..max ranges overlap, some run of the
    slower variant beat some run of the faster, and on a shared machine the
    medians' ratio is then no evidence of a gain or a loss.  None without a
    reference.
    """
    if reference is None:
        return None
    if ranges_overlap(entry, reference):
        return NO_CLEAR_DIFFERENCE
    return "lower" if entry["median"] < reference["median"] else "higher"


def metric_names(runs: Sequence[dict[str, Any]]) -> list[str]:
    """Every metric any run reported, in first-seen order."""
    names: dict[str, None] = {}
    for run in runs:
        for name in run.get("metrics", {}):
            names.setdefault(name, None)
    return list(names)


Summary = dict[str, dict[str, dict[str, Any]]]


def summarize_runs(
    runs: Sequence[dict[str, Any]],
    variants: Sequence[str],
    baseline: str,
    references: Mapping[str, str] | None = None,
) -> Summary:
    """summary[variant][metric] = {median, min, max, n, spread, ratio, ratio_to, verdict}.

    `ratio` is this variant's median over its reference's median: the
    variant `references` names for it, else the baseline.  For a metric the
    reference does not report (a no-migration baseline has no migration
    time), it is the baseline, then the first variant in run order that
    does.  A variant that is its own reference has no ratio.  `verdict`
    says whether the ratio shows a difference at all (see verdict()).
    """
    summary = variant_stats(runs, variants)
    add_ratios(summary, variants, baseline, references or {})
    return summary


def variant_stats(runs: Sequence[dict[str, Any]], variants: Sequence[str]) -> Summary:
    """summary[variant][metric] = {median, min, max, n, spread} over successful runs."""
    names = metric_names(runs)
    summary: Summary = {}
    for variant in variants:
        mine = [r for r in runs if r["variant"] == variant and not r.get("error")]
        summary[variant] = {}
        for name in names:
            stats = summarize([r["metrics"].get(name) for r in mine])
            if stats is not None:
                summary[variant][name] = dict(stats)
    return summary


def add_ratios(
    summary: Summary, rows: Sequence[str], baseline: str, references: Mapping[str, str]
) -> None:
    """Give every entry its ratio, ratio_to and verdict (see summarize_runs)."""
    fallback = [baseline, *[v for v in rows if v != baseline]]
    names = {name: None for row in rows for name in summary[row]}
    for name in names:
        for variant in rows:
            entry = summary[variant].get(name)
            if entry is None:
                continue
            own = references.get(variant)
            order = [own, *fallback] if own is not None and own in summary else fallback
            reference = next((v for v in order if name in summary[v]), None)
            if reference is None or variant == reference:
                entry["ratio"], entry["ratio_to"] = None, None
                continue
            entry["ratio"] = ratio(entry["median"], summary[reference][name]["median"])
            entry["ratio_to"] = reference
            entry["verdict"] = verdict(entry, summary[reference][name])


def choose_best(summary: Summary, candidates: Sequence[str], metric: str) -> str | None:
    """The candidate with the lowest median `metric`; the first listed on a tie.

    Candidates without a successful run (no `metric`) cannot win; None if
    none has one.
    """
    measured = [c for c in candidates if metric in summary.get(c, {})]
    if not measured:
        return None
    return min(measured, key=lambda c: float(summary[c][metric]["median"]))


def add_best_rows(summary: Summary, best: Sequence[Best], metric: str) -> dict[str, str | None]:
    """Add each chosen row to `summary` as a copy of its winner's figures.

    Returns row -> winning candidate (None: no candidate succeeded; the row
    is then empty).
    """
    chosen: dict[str, str | None] = {}
    for row in best:
        winner = chosen[row.name] = choose_best(summary, row.candidates, metric)
        summary[row.name] = copy.deepcopy(summary[winner]) if winner else {}
    return chosen


def evaluate_targets(
    summary: Mapping[str, Mapping[str, Mapping[str, Any]]], targets: Sequence[Target]
) -> list[dict[str, Any]]:
    """Each target with its measured ratio and whether it is met (None: not measured)."""
    evaluated = []
    for target in targets:
        value = summary.get(target.variant, {}).get(target.metric)
        reference = summary.get(target.reference, {}).get(target.reference_metric or target.metric)
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


def downtime_verdict(result: Mapping[str, Any], prefix: str = "") -> DowntimeVerdict | None:
    """The downtime rule (thinvm.vm.downtime) for a migration record with a
    thinvm row and a stock-best row (PREFIXthinvm and PREFIXstock-best);
    None for any other record.  Judged from the record alone, so older
    records are judged by it too."""
    summary = result.get("summary", {})
    ours = summary.get(f"{prefix}thinvm", {}).get("downtime_ms")
    stock = summary.get(f"{prefix}stock-best", {}).get("downtime_ms")
    if not ours or not stock or ours.get("median") is None or stock.get("median") is None:
        return None
    limit = result.get("params", {}).get("downtime-limit", QEMU_DEFAULT_LIMIT_MS)
    return DowntimeVerdict(ours["median"], ours["max"], stock["median"], limit)


def downtime_verdicts(result: Mapping[str, Any]) -> dict[str, DowntimeVerdict]:
    """The downtime rule for every pair of rows a record holds: thinvm and
    stock-best, and each prefixed pair (`128G-`, `pkg-`), by prefix."""
    prefixes = {
        row.removesuffix("thinvm") for row in result.get("summary", {}) if row.endswith("thinvm")
    }
    found = {p: downtime_verdict(result, p) for p in sorted(prefixes)}
    return {p: v for p, v in found.items() if v is not None}


def ratio(value: float, reference: float) -> float | None:
    """value / reference; None when the reference is zero."""
    if reference == 0:
        return None if value != 0 else 1.0
    return value / reference


ISO_FORMAT = "%Y-%m-%dT%H:%M:%SZ"  # a record's "created", a run's "started"


def iso_stamp(when: datetime) -> str:
    return when.astimezone(UTC).strftime(ISO_FORMAT)


def result_stem(scenario: str, when: datetime) -> str:
    return f"{scenario}-{when.astimezone(UTC).strftime(STAMP_FORMAT)}"


def parse_result_name(filename: str) -> tuple[str, str] | None:
    """(scenario, stamp) of a results file name, or None if it is not one."""
    match = _RESULT_NAME.match(filename)
    return (match["scenario"], match["stamp"]) if match else None


def latest_results(directory: Path) -> dict[str, Path]:
    """The newest results JSON of every scenario found in directory that
    measured its targets with the guests as they boot by default, at
    MIN_RUNS runs per variant.  A record of a few rows only (an A/B of the
    time reference, say) judges none of them, one whose guests booted with
    other kernel arguments (`--guest-append`) is a variation of the
    scenario, and a one-pass probe has no spread: none displaces the record
    that stands for it; a scenario with no such record is represented by
    its newest."""
    found: dict[str, list[tuple[str, Path]]] = {}
    if not directory.is_dir():
        return {}
    for path in directory.glob("*.json"):
        parsed = parse_result_name(path.name)
        if parsed is not None:
            scenario, stamp = parsed
            found.setdefault(scenario, []).append((stamp, path))
    latest = {}
    for scenario, records in sorted(found.items()):
        newest_first = [path for _, path in sorted(records, reverse=True)]
        standing = (path for path in newest_first if _stands_for_its_scenario(path))
        latest[scenario] = next(standing, newest_first[0])
    return latest


def _stands_for_its_scenario(path: Path) -> bool:
    """Whether the record judged some of its targets (or has none),
    booted its guests with their default kernel arguments and ran each
    variant MIN_RUNS times (records that do not say count as such)."""
    try:
        data = json.loads(path.read_text())
        targets = data.get("targets") or []
        varied = bool((data.get("params") or {}).get("guest_append"))
        runs = int(data.get("runs_per_variant") or MIN_RUNS)
    except (OSError, ValueError, TypeError, AttributeError):
        return True
    judged_none = bool(targets) and all(t.get("met") is None for t in targets)
    return not judged_none and not varied and runs >= MIN_RUNS


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
    references = scenario.references
    metric = scenario.choice_metric
    summary = variant_stats(runs, [v.name for v in scenario.variants])
    chosen = add_best_rows(summary, scenario.best, metric)
    add_ratios(summary, scenario.rows, scenario.baseline_name, references)
    return {
        "schema": SCHEMA_VERSION,
        "scenario": scenario.name,
        "title": scenario.title,
        "description": scenario.description,
        "created": iso_stamp(created),
        "command": list(command),
        "params": scenario.params,
        "variants": [
            *(_best_row(b, chosen[b.name], metric, references) for b in scenario.best),
            *(
                {"name": v.name, "description": v.description, "reference": references.get(v.name)}
                for v in scenario.variants
            ),
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


def _best_row(
    best: Best, winner: str | None, metric: str, references: Mapping[str, str]
) -> dict[str, Any]:
    """A chosen row's entry in the result's variants: what it was chosen from, and how."""
    chosen = winner or "none (no candidate succeeded)"
    return {
        "name": best.name,
        "description": (
            f"{best.description + '; ' if best.description else ''}the best of "
            f"{', '.join(best.candidates)} by median {metric} (lowest wins): {chosen}"
        ),
        "reference": references.get(best.name),
        "best_of": list(best.candidates),
        "best_metric": metric,
        "chosen": winner,
    }


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
