"""The migrate-postcopy scenario's stacks and counters."""

from thinvm.bench import scenarios as bench_scenarios
from thinvm.bench.scenarios import postcopy
from thinvm.bench.scenarios.common import STOCK_CANDIDATES
from thinvm.bench.types import BenchOptions
from thinvm.units import GiB, MiB
from thinvm.vm.migrate import MigrationResult


def test_postcopy_variants_use_what_postcopy_allows() -> None:
    for candidate in (postcopy.POSTCOPY_STOCK, postcopy.POSTCOPY_THINVM):
        stack = candidate.stack
        # QEMU 10.0 refuses multifd with postcopy; the balloon keeps hinting off.
        assert not stack.multifd and not stack.hint and stack.reporting, candidate.name
    assert postcopy.POSTCOPY_THINVM.stack.caps == {"sparse-ram": True}
    assert postcopy.POSTCOPY_STOCK.stack.caps == {}
    # stock-best's candidates: every stock precopy configuration and stock's
    # postcopy, the precopy ones run without postcopy.
    rows = {c.name: pc for c, pc in postcopy.STOCK_ROWS}
    assert rows.pop("postcopy-stock") is True
    assert set(rows) == {c.name for c in STOCK_CANDIDATES} and not any(rows.values())


def test_postcopy_scenario_chooses_stock_best_among_every_stock_configuration() -> None:
    scenario = bench_scenarios.get("migrate-postcopy").build(BenchOptions(size=2 * GiB))
    stock = [c.name for c in STOCK_CANDIDATES]
    assert [v.name for v in scenario.variants] == [*stock, "postcopy-stock", "postcopy-thinvm"]
    (best,) = scenario.best
    assert best.name == "stock-best" and best.candidates == (*stock, "postcopy-stock")
    assert scenario.baseline_name == "stock-best"
    assert scenario.params["used"] == "256.00 MiB"
    assert {(t.variant, t.reference) for t in scenario.targets} == {
        ("postcopy-thinvm", "postcopy-stock"),
        ("postcopy-thinvm", "stock-best"),
    }


def test_postcopy_metrics_read_query_migrate() -> None:
    info = {
        "status": "completed",
        "total-time": 500,
        "ram": {"postcopy-requests": 17, "postcopy-bytes": 200 * MiB},
    }
    result = MigrationResult.from_query(info, 0.5)
    assert postcopy.postcopy_metrics(result) == {
        "postcopy_requests": 17,
        "postcopy_bytes": 200 * MiB,
    }
