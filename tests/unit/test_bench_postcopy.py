"""The migrate-postcopy scenario's stacks and counters."""

from thinvm.bench import scenarios as bench_scenarios
from thinvm.bench.scenarios import postcopy
from thinvm.bench.types import BenchOptions
from thinvm.units import GiB, MiB
from thinvm.vm.migrate import MigrationResult


def test_postcopy_variants_use_what_postcopy_allows() -> None:
    stacks = {name: (stack, pc) for name, stack, pc, _ in postcopy.POSTCOPY_STACKS}
    assert next(iter(stacks)) == "stock-best" and not stacks["stock-best"][1]
    for name in ("postcopy-stock", "postcopy-thinvm"):
        stack, pc = stacks[name]
        # QEMU 10.0 refuses multifd with postcopy; the balloon keeps hinting off.
        assert pc and not stack.multifd and not stack.hint and stack.reporting, name
    assert stacks["postcopy-thinvm"][0].caps == {"sparse-ram": True}
    assert stacks["postcopy-stock"][0].caps == {}


def test_postcopy_scenario_is_registered_with_its_target() -> None:
    scenario = bench_scenarios.get("migrate-postcopy").build(BenchOptions(size=2 * GiB))
    assert [v.name for v in scenario.variants] == [
        "stock-best",
        "postcopy-stock",
        "postcopy-thinvm",
    ]
    assert scenario.params["used"] == "256.00 MiB"
    (target,) = scenario.targets
    assert (target.variant, target.reference) == ("postcopy-thinvm", "postcopy-stock")


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
