"""The benchmark scenarios (issue 4): each builds a Scenario of Variants.

Every variant's run boots fresh guests, measures one thing and tears them
down (`with VM(...)`), so runs are independent and no QEMU outlives a run.
Sizes default to what fits in < 5 minutes per scenario on a 2-CPU TCG host;
`--size` scales them up.

One module per family of scenarios, each exporting its registry entry
(SPEC, a ScenarioSpec of thinvm.bench.scenarios.spec); this module lists
them in the registry, which is all the runner needs.  The families share
common (the stacks compared, guest-side steps), transport (how a migration
runs and what it reports) and params (--param parsing).
"""

from thinvm.bench.report import CatalogueEntry
from thinvm.bench.scenarios import (
    ballooned,
    density,
    dirty,
    fleet_overcommit,
    fleet_ws,
    idle,
    inflate,
    overcommit,
    postcopy,
    resize,
    save,
    scale,
    start,
    steady,
    workingset,
)
from thinvm.bench.scenarios import fleet as fleet_bench
from thinvm.bench.scenarios.spec import MIN_RUNS, ScenarioSpec
from thinvm.errors import ThinvmError

__all__ = ["MIN_RUNS", "SCENARIOS", "ScenarioSpec", "catalogue", "describe_spec", "get"]

# In the order `thinvm bench --list` and the catalogue show them.
SCENARIOS: dict[str, ScenarioSpec] = {
    spec.name: spec
    for spec in (
        inflate.SPEC,
        idle.SPEC,
        dirty.SPEC,
        ballooned.SPEC,
        scale.SPEC,
        scale.COMPRESS_SPEC,
        density.SPEC,
        density.BUDGET_SPEC,
        overcommit.SPEC,
        fleet_overcommit.SPEC,
        fleet_bench.SPEC,
        fleet_ws.SPEC,
        workingset.SPEC,
        steady.SPEC,
        resize.SPEC,
        postcopy.SPEC,
        start.SPEC,
        idle.NETWORK_SPEC,
        save.SPEC,
    )
}


def get(name: str) -> ScenarioSpec:
    try:
        return SCENARIOS[name]
    except KeyError:
        raise ThinvmError(
            f"unknown scenario {name!r}: choose one of {', '.join(SCENARIOS)}"
        ) from None


def describe_spec(spec: ScenarioSpec) -> str:
    params = " ".join(f"--param {k}={v}" for k, v in spec.params.items())
    return (
        f"{spec.name:18} {spec.title}\n{'':18} --size {spec.default_size} ({spec.size_help}), "
        f"--runs {spec.runs}" + (f", {params}" if params else "")
    )


# Parts of issue 4 the registry does not cover (yet); listed in the docs.
TODO: list[CatalogueEntry] = []


def catalogue() -> list[CatalogueEntry]:
    entries = [
        CatalogueEntry(spec.name, spec.title, spec.command, spec.todo)
        for spec in SCENARIOS.values()
    ]
    return entries + TODO
