"""stock-best and thinvm as measured: the best candidate of the same run carries the row."""

from datetime import UTC, datetime
from typing import Any

import pytest

from thinvm.bench import report
from thinvm.bench import results as bench_results
from thinvm.bench import scenarios as bench_scenarios
from thinvm.bench.types import BenchOptions, Best, Metrics, RunContext, Scenario, Target, Variant
from thinvm.errors import ThinvmError

WHEN = datetime(2026, 11, 23, 19, 0, 0, tzinfo=UTC)

# Recorded migration times (ms) of three runs per candidate, as a run of
# migrate-idle would give them.
TIMES: dict[str, list[float]] = {
    "stock-hint-mfd2": [1500, 1600, 1550],
    "stock-mfd2": [1200, 1300, 1250],  # hinting costs more than it saves
    "legacy": [4000, 4200, 4100],
    "thinvm-hint": [1100, 1150, 1120],
    "thinvm-no-hint": [700, 800, 750],
}


def _runs(times: dict[str, list[float]]) -> list[dict[str, Any]]:
    return [
        {
            "variant": name,
            "run": k + 1,
            "metrics": {"migration_ms": ms, "transferred_bytes": 10 * ms},
            "load_start": [0.5, 0.5, 0.5],
            "load_end": [0.5, 0.5, 0.5],
        }
        for k in range(3)
        for name, values in times.items()
        for ms in values[k : k + 1]
    ]


def _scenario() -> Scenario:
    def measured(ctx: RunContext) -> Metrics:
        return {"migration_ms": TIMES[ctx.variant][ctx.run - 1]}

    stock = ("stock-hint-mfd2", "stock-mfd2", "legacy")
    thinvm = ("thinvm-hint", "thinvm-no-hint")
    return Scenario(
        name="migrate-idle",
        title="t",
        description="d",
        variants=[Variant(name, measured, f"the {name} way") for name in TIMES],
        best=[
            Best("stock-best", stock, "the best stock configuration measured"),
            Best("thinvm", thinvm, "thinvm's best option measured"),
        ],
        baseline="stock-best",
        main_metric="migration_ms",
        targets=[Target("faster", "thinvm", "stock-best", "migration_ms", at_most=1.0)],
    )


def test_choose_best_takes_the_lowest_median() -> None:
    stats = bench_results.variant_stats(_runs(TIMES), list(TIMES))
    stock = ["stock-hint-mfd2", "stock-mfd2", "legacy"]
    assert bench_results.choose_best(stats, stock, "migration_ms") == "stock-mfd2"
    assert bench_results.choose_best(stats, ["thinvm-hint", "thinvm-no-hint"], "migration_ms") == (
        "thinvm-no-hint"
    )


def test_choose_best_ties_go_to_the_first_listed_and_failures_cannot_win() -> None:
    stats = bench_results.variant_stats(_runs({"a": [5.0] * 3, "b": [5.0] * 3}), ["a", "b"])
    assert bench_results.choose_best(stats, ["b", "a"], "migration_ms") == "b"
    stats["c"] = {}  # every run of c failed
    assert bench_results.choose_best(stats, ["c", "a"], "migration_ms") == "a"
    assert bench_results.choose_best(stats, ["c"], "migration_ms") is None
    assert bench_results.choose_best(stats, ["a"], "downtime_ms") is None


def _result() -> dict[str, Any]:
    return bench_results.build_result(
        _scenario(), _runs(TIMES), created=WHEN, environment={}, load={}
    )


def test_the_chosen_rows_carry_the_winners_figures() -> None:
    result = _result()
    bench_results.validate_result(result)
    summary = result["summary"]
    for row, winner in (("stock-best", "stock-mfd2"), ("thinvm", "thinvm-no-hint")):
        for metric in ("migration_ms", "transferred_bytes"):
            mine, theirs = summary[row][metric], summary[winner][metric]
            assert {k: mine[k] for k in ("median", "min", "max", "n")} == {
                k: theirs[k] for k in ("median", "min", "max", "n")
            }
    # Ratios are against the chosen stock-best, which is the baseline.
    assert summary["stock-best"]["migration_ms"]["ratio"] is None
    assert summary["thinvm"]["migration_ms"]["ratio"] == pytest.approx(750 / 1250)
    assert summary["thinvm"]["migration_ms"]["verdict"] == "lower"
    assert summary["stock-hint-mfd2"]["migration_ms"]["ratio_to"] == "stock-best"
    (target,) = result["targets"]
    assert target["ratio"] == pytest.approx(750 / 1250) and target["met"]


def test_the_result_names_the_winner_and_what_it_was_chosen_from() -> None:
    rows = {v["name"]: v for v in _result()["variants"]}
    assert list(rows)[:2] == ["stock-best", "thinvm"]  # the chosen rows come first
    best = rows["stock-best"]
    assert best["chosen"] == "stock-mfd2"
    assert best["best_of"] == ["stock-hint-mfd2", "stock-mfd2", "legacy"]
    assert best["best_metric"] == "migration_ms"
    assert "by median migration_ms (lowest wins): stock-mfd2" in best["description"]
    assert "chosen" not in rows["legacy"]


def test_the_table_names_the_winning_configuration() -> None:
    table = report.render_table(_result()).splitlines()
    head = "| metric | stock-best = stock-mfd2 (baseline) | thinvm = thinvm-no-hint |"
    assert table[0].startswith(head + " stock-hint-mfd2 |")


def test_a_chosen_row_without_a_successful_candidate_is_empty() -> None:
    runs = [r for r in _runs(TIMES) if not r["variant"].startswith("thinvm")]
    runs += [{**_runs({"thinvm-hint": [1.0] * 3})[0], "metrics": {}, "error": "boom"}]
    result = bench_results.build_result(_scenario(), runs, created=WHEN, environment={}, load={})
    rows = {v["name"]: v for v in result["variants"]}
    assert rows["thinvm"]["chosen"] is None and result["summary"]["thinvm"] == {}
    assert "thinvm = none" in report.render_table(result)


def test_selecting_a_chosen_row_runs_all_its_candidates() -> None:
    scenario = _scenario()
    scenario.select(["stock-best", "thinvm-hint"])
    assert [v.name for v in scenario.variants] == [
        "stock-hint-mfd2",
        "stock-mfd2",
        "legacy",
        "thinvm-hint",
    ]
    assert [(b.name, b.candidates) for b in scenario.best] == [
        ("stock-best", ("stock-hint-mfd2", "stock-mfd2", "legacy")),
        ("thinvm", ("thinvm-hint",)),
    ]
    assert scenario.baseline_name == "stock-best"


def test_selecting_candidates_keeps_only_rows_they_feed() -> None:
    scenario = _scenario()
    with pytest.raises(ThinvmError, match="choose from stock-best, thinvm, stock-hint-mfd2"):
        scenario.select(["ghost"])
    scenario.select(["legacy"])
    assert scenario.rows == ["stock-best", "legacy"]


@pytest.mark.parametrize("name", ["migrate-idle", "migrate-dirty", "migrate-ballooned", "network"])
def test_migration_scenarios_choose_stock_best_and_thinvm(name: str) -> None:
    scenario = bench_scenarios.get(name).build(BenchOptions())
    best = {b.name.rsplit("-", 2)[-2:] == ["stock", "best"]: b for b in scenario.best}
    assert best[True].candidates and best[False].candidates
    names = {v.name for v in scenario.variants}
    assert all(set(b.candidates) <= names for b in scenario.best)
    assert scenario.baseline_name.endswith("stock-best")


def test_migrate_scale_chooses_per_guest_size() -> None:
    options = BenchOptions(size=8 * 2**30, params={"from": "4G"})
    scenario = bench_scenarios.get("migrate-scale").build(options)
    assert [b.name for b in scenario.best] == [
        "4G-stock-best",
        "4G-thinvm",
        "8G-stock-best",
        "8G-thinvm",
    ]
    assert all(c.startswith("8G-stock") or c == "8G-legacy" for c in scenario.best[2].candidates)
    assert scenario.references["8G-thinvm"] == "8G-stock-best"
    assert "8G-stock-best" not in scenario.references  # growth: against 4G-stock-best


def test_recorded_results_still_load_and_render() -> None:
    """Result files written before stock-best was chosen (a variant of its own) still work."""
    results = bench_results.load_results(bench_results.RESULTS_DIR)
    assert any(r["scenario"] == "migrate-idle" for r in results)
    text = report.render_document(results, bench_scenarios.catalogue(), image_dir="x")
    assert "## migrate-idle" in text


def test_a_section_says_when_it_was_recorded_before_the_rules() -> None:
    old = {**_result(), "load": {}, "runs_per_variant": 3, "environment": {}, "wall_seconds": 1}
    old["variants"] = [v for v in old["variants"] if "best_of" not in v]
    text = report.render_section(old, "x")
    assert "Recorded before the rules" in text and "fixed configurations" in text
    new = {**_result(), "load": {"gate": {"max_load": 1.0, "max_wait_s": 600.0}}}
    new.update(runs_per_variant=5, wall_seconds=1)
    assert "Recorded before the rules" not in report.render_section(new, "x")
