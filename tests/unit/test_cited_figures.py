"""Figures in README.md, docs/ and bench/notes.md that cite a record must
be what the record holds (thinvm.bench.citations, `thinvm bench status`)."""

import json
import re
from pathlib import Path

from thinvm.bench import citations
from thinvm.paths import REPO

RECORD_PATH = re.compile(r"bench/results/([A-Za-z0-9_.-]+\.(?:json|png))")


def test_every_cited_figure_in_the_manuals_holds() -> None:
    verdicts = citations.check_all(REPO)
    assert len(verdicts) >= 5, "the README's figures cite their records"
    bad = [line for v, line in zip(verdicts, citations.report(verdicts), strict=True) if not v.ok]
    assert not bad, "\n".join(bad)


def test_every_record_the_manuals_name_exists() -> None:
    missing = [
        f"{path.relative_to(REPO)}: {name}"
        for path in citations.documents(REPO)
        for name in RECORD_PATH.findall(path.read_text())
        if not (REPO / "bench" / "results" / name).is_file()
    ]
    assert not missing, missing


def make_tree(tmp_path: Path, text: str) -> Path:
    results = tmp_path / "bench" / "results"
    results.mkdir(parents=True)
    summary = {
        "thinvm": {
            "migration_ms": {"median": 121, "min": 110, "max": 160, "ratio": 0.0889},
            "transferred_bytes": {"median": 149792913, "ratio": 0.975},
        },
        "stock-best": {"migration_ms": {"median": 1361, "ratio": None}},
    }
    (results / "rec-1.json").write_text(json.dumps({"summary": summary}))
    (tmp_path / "README.md").write_text(text)
    return tmp_path


def test_units_decimals_and_fields_are_read_as_written(tmp_path: Path) -> None:
    root = make_tree(
        tmp_path,
        "a 121 ms <!-- cite rec-1 thinvm migration_ms -->, max 0.16 s"
        " <!-- cite rec-1 thinvm migration_ms max --> and **x0.089**"
        " <!-- cite rec-1 thinvm migration_ms ratio -->; 142.9 MiB"
        " <!-- cite rec-1 thinvm transferred_bytes --> or 150 MB"
        " <!-- cite rec-1 thinvm transferred_bytes -->\n",
    )
    verdicts = citations.check_all(root)
    assert [v.ok for v in verdicts] == [True] * 5, citations.report(verdicts)


def test_a_wrong_figure_is_caught_and_rewritten_from_its_record(tmp_path: Path) -> None:
    root = make_tree(
        tmp_path,
        "thinvm \u00d70.10 <!-- cite rec-1 thinvm migration_ms ratio -->"
        " in 120 ms <!-- cite rec-1 thinvm migration_ms --> against 1361 ms"
        " <!-- cite rec-1 stock-best migration_ms -->\n",
    )
    verdicts = citations.check_all(root)
    assert [v.ok for v in verdicts] == [False, False, True]
    assert [v.expected for v in verdicts] == ["\u00d70.09", "121 ms", "1361 ms"]
    assert citations.rewrite(root) == 2
    text = (root / "README.md").read_text()
    assert "thinvm \u00d70.09 <!--" in text and "in 121 ms <!--" in text
    assert all(v.ok for v in citations.check_all(root))


def test_a_citation_that_cannot_hold_is_broken(tmp_path: Path) -> None:
    root = make_tree(
        tmp_path,
        "x0.09 <!-- cite rec-1 thinvm migration_ms -->;"
        " 5 ms <!-- cite rec-2 thinvm migration_ms -->;"
        " 3 MiB <!-- cite rec-1 thinvm migration_ms -->;"
        " words <!-- cite rec-1 thinvm migration_ms -->\n",
    )
    problems = [v.problem for v in citations.check_all(root)]
    assert "must cite the field 'ratio' or 'target'" in problems[0]
    assert "no record" in problems[1]
    assert "cannot cite migration_ms" in problems[2]
    assert "no figure" in problems[3]


def test_a_sweep_count_is_summarized_over_the_runs_that_reached_it(tmp_path: Path) -> None:
    root = make_tree(
        tmp_path,
        "at 4: 3.31 s <!-- cite rec-s thinvm work_max_s@4 min -->-3.64 s"
        " <!-- cite rec-s thinvm work_max_s@4 max -->, median 3.5 s"
        " <!-- cite rec-s thinvm work_max_s@4 -->; at 6: 4.22 s"
        " <!-- cite rec-s thinvm work_max_s@6 -->;"
        " 3 s <!-- cite rec-s mom work_max_s@4 -->;"
        " x1.2 <!-- cite rec-s thinvm work_max_s@4 ratio -->\n",
    )

    def run(variant: str, sweep: dict[str, float]) -> dict[str, object]:
        counts = {count: {"work_max_s": value} for count, value in sweep.items()}
        return {"variant": variant, "info": {"sweep": counts}}

    runs = [
        run("thinvm", {"4": 3.64, "5": 3.9}),
        run("thinvm", {"4": 3.31, "5": 3.7, "6": 4.22}),
        run("thinvm", {"4": 3.5}),
        run("mom", {"3": 4.1}),
    ]
    (root / "bench" / "results" / "rec-s.json").write_text(json.dumps({"runs": runs}))
    verdicts = citations.check_all(root)
    assert [v.ok for v in verdicts[:4]] == [True] * 4, citations.report(verdicts)
    assert "no mom run measured work_max_s at 4" in verdicts[4].problem
    assert "a sweep count has no ratio" in verdicts[5].problem


def test_a_target_is_named_by_its_rows_and_metrics(tmp_path: Path) -> None:
    root = make_tree(
        tmp_path,
        "x1.12 <!-- cite rec-t big-thinvm migration_ms/link_ms target -->;"
        " x0.40 <!-- cite rec-t big-thinvm/big-stock-best migration_ms target -->;"
        " x0.4 <!-- cite rec-t big-thinvm migration_ms target -->;"
        " x0.24 <!-- cite rec-t big-thinvm src_cpu_s target -->;"
        " x0.5 <!-- cite rec-t big-thinvm downtime_ms target -->\n",
    )

    def target(
        reference: str, metric: str, ratio: float | None, other: str | None = None
    ) -> dict[str, object]:
        return {
            "variant": "big-thinvm",
            "reference": reference,
            "metric": metric,
            "reference_metric": other,
            "ratio": ratio,
        }

    targets = [
        target("big-thinvm", "migration_ms", 1.118, "link_ms"),
        target("big-stock-best", "migration_ms", 0.398),
        target("big-small", "migration_ms", 0.9),
        target("big-stock-best", "src_cpu_s", None),
    ]
    (root / "bench" / "results" / "rec-t.json").write_text(json.dumps({"targets": targets}))
    verdicts = citations.check_all(root)
    assert [v.ok for v in verdicts[:2]] == [True, True], citations.report(verdicts)
    assert "names 2 targets, not one" in verdicts[2].problem
    assert "the target was not measured" in verdicts[3].problem
    assert "names 0 targets, not one" in verdicts[4].problem
