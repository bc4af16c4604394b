"""Figures in the manuals that name the record they come from.

A figure in README.md or docs/ is followed by a citation, an HTML comment
that markdown does not show:

    inflate x0.07 <!-- cite inflate-20261124T195310Z touched-ranges inflate_s ratio -->

naming the record (a file in bench/results without `.json`), the row, the
metric and the field of the record's summary (median, min, max or ratio;
median if left out).  The figure is the number just before the comment,
with its unit if any: a ratio (x or the multiplication sign), ms or s
for `_ms` or `_s` metrics, B, KiB, MiB, GiB, MB or GB for `_bytes`
metrics, or a bare number.  The record's value, converted to the
figure's unit and rounded to as many decimals as the figure shows, must
equal the figure.

A metric written `METRIC@COUNT` is read from the runs themselves instead
of the summary: each run's figure at that count of a sweep (the
overcommit benchmarks' `info.sweep`), summarized over the row's runs
that reached it (median, min or max; no ratio):

    3.31 s <!-- cite overcommit-20261129T130213Z thinvm work_max_s@4 min -->

The field `target` reads the measured ratio of one of the record's
Targets instead, the row and metric naming it: `VARIANT[/REFERENCE]` and
`METRIC[/REFERENCE_METRIC]` (a bound on another metric of the row, such
as the link's own time); exactly one target must match:

    x1.12 <!-- cite migrate-scale-20261130T044752Z 128G-thinvm migration_ms/link_ms target -->

`thinvm bench status` checks every citation; `--write` rewrites each
figure from its record, keeping its unit and decimals.  tests/unit/
test_cited_figures.py fails on a citation whose record does not hold it.
"""

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from thinvm.bench.results import summarize
from thinvm.errors import ThinvmError

FIELDS = ("median", "min", "max", "ratio", "target")
# The fields a ratio (x) is written for.
RATIO_FIELDS = ("ratio", "target")
CITE_RE = re.compile(r"<!--\s*cite\s+([^>]*?)\s*-->")
# The figure right before a citation: an optional ratio sign, a number,
# an optional unit, then only spaces or markdown emphasis.
FIGURE_RE = re.compile(
    r"(?P<sign>[x\u00d7]?)(?P<number>\d[\d,]*(?:\.\d+)?)(?P<space>\s?)"
    r"(?P<unit>ms|s|B|KiB|MiB|GiB|MB|GB|%)?(?P<tail>[*_]*\s*)$"
)
# A unit: the kind of metric it may cite (by name suffix) and its size in
# that kind's base unit (seconds, bytes).
UNITS = {
    "ms": ("time", 1e-3),
    "s": ("time", 1.0),
    "B": ("bytes", 1.0),
    "KiB": ("bytes", 1024.0),
    "MiB": ("bytes", 1024.0**2),
    "GiB": ("bytes", 1024.0**3),
    "MB": ("bytes", 1e6),
    "GB": ("bytes", 1e9),
}
METRIC_UNITS = {"_ms": ("time", 1e-3), "_s": ("time", 1.0), "_bytes": ("bytes", 1.0)}


def split_sweep(metric: str) -> tuple[str, str | None]:
    """`work_max_s@4` -> ("work_max_s", "4"); a plain metric has no count."""
    name, at, count = metric.partition("@")
    return name, count if at else None


def in_unit(value: float, metric: str, unit: str) -> float:
    """A metric's value in a written unit; ThinvmError where they do not match."""
    kind, size = UNITS[unit]
    metric = split_sweep(metric)[0]
    for suffix, (metric_kind, metric_size) in METRIC_UNITS.items():
        if metric.endswith(suffix) and metric_kind == kind:
            return value * metric_size / size
    raise ThinvmError(f"a figure in {unit} cannot cite {metric}")


@dataclass(frozen=True)
class Citation:
    path: Path
    line: int  # 1-based
    column: int  # where the citation's comment starts on its line
    record: str
    row: str
    metric: str
    field: str
    figure: str  # as written, unit included

    def where(self) -> str:
        return f"{self.path}:{self.line}"


@dataclass(frozen=True)
class Verdict:
    citation: Citation
    expected: str | None  # the figure the record gives, written the same way
    problem: str = ""

    @property
    def ok(self) -> bool:
        return not self.problem and self.expected == self.citation.figure


def parse_citation(words: str) -> tuple[str, str, str, str]:
    parts = words.split()
    if len(parts) not in (3, 4) or (len(parts) == 4 and parts[3] not in FIELDS):
        raise ThinvmError(f"citation {words!r}: want RECORD ROW METRIC [{'|'.join(FIELDS)}]")
    record, row, metric = parts[:3]
    return record, row, metric, parts[3] if len(parts) == 4 else "median"


def figure_before(text: str) -> re.Match[str] | None:
    return FIGURE_RE.search(text)


def citations_in(path: Path, text: str) -> list[Citation]:
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for match in CITE_RE.finditer(line):
            record, row, metric, field = parse_citation(match.group(1))
            figure = figure_before(line[: match.start()])
            written = figure.group(0).rstrip("*_ \t") if figure else ""
            found.append(Citation(path, number, match.start(), record, row, metric, field, written))
    return found


def decimals(number: str) -> int:
    return len(number.split(".", 1)[1]) if "." in number else 0


def render(value: float, figure: re.Match[str], metric: str) -> str:
    """`value` written as `figure` is: same sign, unit and decimals."""
    unit = figure.group("unit") or ""
    scaled = in_unit(value, metric, unit) if unit in UNITS else value
    number = figure.group("number")
    text = f"{scaled:,.{decimals(number)}f}" if "," in number else f"{scaled:.{decimals(number)}f}"
    return f"{figure.group('sign')}{text}{figure.group('space')}{unit}"


def sweep_summary(record: dict[str, Any], citation: Citation) -> dict[str, Any]:
    """The row's runs' `metric` at one count of their sweep, summarized."""
    metric, count = split_sweep(citation.metric)
    if citation.field == "ratio":
        raise ThinvmError(f"{citation.record}: a sweep count has no ratio")
    values = [
        run["info"]["sweep"][count].get(metric)
        for run in record.get("runs", [])
        if run.get("variant") == citation.row and count in run.get("info", {}).get("sweep", {})
    ]
    stats = summarize(values)
    if stats is None:
        raise ThinvmError(f"{citation.record}: no {citation.row} run measured {metric} at {count}")
    return stats


def _matches(target: dict[str, Any], citation: Citation) -> bool:
    variant, _, reference = citation.row.partition("/")
    metric, _, reference_metric = citation.metric.partition("/")
    return (
        target.get("variant") == variant
        and reference in ("", target.get("reference"))
        and target.get("metric") == metric
        and (target.get("reference_metric") or "") == reference_metric
    )


def target_ratio(record: dict[str, Any], citation: Citation) -> float:
    """The measured ratio of the one target the citation names."""
    found = [t for t in record.get("targets", []) if _matches(t, citation)]
    what = f"{citation.record}: {citation.row} {citation.metric}"
    if len(found) != 1:
        raise ThinvmError(f"{what} names {len(found)} targets, not one")
    if found[0].get("ratio") is None:
        raise ThinvmError(f"{what}: the target was not measured")
    return float(found[0]["ratio"])


def record_value(results: Path, citation: Citation) -> float:
    path = results / f"{citation.record}.json"
    if not path.is_file():
        raise ThinvmError(f"no record {path}")
    record = json.loads(path.read_text())
    if citation.field == "target":
        return target_ratio(record, citation)
    if split_sweep(citation.metric)[1] is not None:
        return float(sweep_summary(record, citation)[citation.field])
    summary = record.get("summary", {})
    try:
        value = summary[citation.row][citation.metric][citation.field]
    except KeyError as exc:
        raise ThinvmError(
            f"{citation.record} has no {citation.row}/{citation.metric}/{citation.field}"
        ) from exc
    if value is None:
        raise ThinvmError(
            f"{citation.record}: {citation.row}/{citation.metric} has no {citation.field}"
        )
    return float(value)


def check(citation: Citation, results: Path) -> Verdict:
    figure = figure_before(citation.figure)
    if not citation.figure or figure is None:
        return Verdict(citation, None, "no figure right before the citation")
    if figure.group("sign") and citation.field not in RATIO_FIELDS:
        return Verdict(citation, None, "a ratio (x) must cite the field 'ratio' or 'target'")
    try:
        value = record_value(results, citation)
        expected = render(value, figure, citation.metric)
    except ThinvmError as exc:
        return Verdict(citation, None, str(exc))
    return Verdict(citation, expected)


def documents(root: Path) -> list[Path]:
    """The files whose figures are checked: README, docs, the bench notes
    (bench/notes.md and the topic notes under bench/notes/)."""
    paths = [root / "README.md", root / "bench" / "notes.md"]
    paths += sorted((root / "bench" / "notes").glob("*.md"))
    paths += sorted((root / "docs").rglob("*.md"))
    return [p for p in paths if p.is_file()]


def check_all(root: Path) -> list[Verdict]:
    results = root / "bench" / "results"
    return [
        check(c, results)
        for path in documents(root)
        for c in citations_in(path.relative_to(root), path.read_text())
    ]


def rewrite(root: Path) -> int:
    """Write each cited figure as its record gives it; how many changed."""
    changed = 0
    by_path: dict[Path, list[Verdict]] = {}
    for verdict in check_all(root):
        by_path.setdefault(verdict.citation.path, []).append(verdict)
    for path, verdicts in by_path.items():
        lines = (root / path).read_text().split("\n")
        # Right to left, so that a rewrite leaves the columns before it valid.
        for v in sorted(verdicts, key=lambda v: (v.citation.line, -v.citation.column)):
            if v.expected is None or v.ok:
                continue
            c = v.citation
            lines[c.line - 1] = _replace_figure(lines[c.line - 1], c.column, c.figure, v.expected)
            changed += 1
        (root / path).write_text("\n".join(lines))
    return changed


def _replace_figure(line: str, column: int, old: str, new: str) -> str:
    head = line[:column]
    at = head.rfind(old)
    return head[:at] + new + head[at + len(old) :] + line[column:] if at >= 0 else line


def report(verdicts: list[Verdict]) -> list[str]:
    lines = []
    for v in verdicts:
        c = v.citation
        what = f"{c.record} {c.row} {c.metric} {c.field}"
        if v.ok:
            lines.append(f"ok        {c.where()}: {c.figure} ({what})")
        elif v.problem:
            lines.append(f"BROKEN    {c.where()}: {c.figure or '?'} ({what}): {v.problem}")
        else:
            gives = f"the record gives {v.expected}"
            lines.append(f"MISMATCH  {c.where()}: {c.figure}, {gives} ({what})")
    return lines
