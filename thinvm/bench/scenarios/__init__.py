"""The benchmark scenarios (issue 4): each builds a Scenario of Variants.

Every variant's run boots fresh guests, measures one thing and tears them
down (`with VM(...)`), so runs are independent and no QEMU outlives a run.
Sizes default to what fits in < 5 minutes per scenario on a 2-CPU TCG host;
`--size` scales them up.

One module per family of scenarios; this module holds the registry, which
is all the runner needs.  The families share common (the stacks compared,
guest-side steps), transport (how a migration runs and what it reports) and
params (--param parsing).
"""

from collections.abc import Callable
from dataclasses import dataclass, field

from thinvm.bench.report import CatalogueEntry
from thinvm.bench.scenarios import fleet as fleet_bench
from thinvm.bench.scenarios import overcommit, resize, steady, workingset
from thinvm.bench.scenarios.ballooned import make_migrate_ballooned
from thinvm.bench.scenarios.density import make_density, make_density_budget
from thinvm.bench.scenarios.dirty import make_migrate_dirty
from thinvm.bench.scenarios.idle import make_migrate_idle, make_network
from thinvm.bench.scenarios.inflate import make_inflate
from thinvm.bench.scenarios.params import check_params
from thinvm.bench.scenarios.postcopy import make_migrate_postcopy
from thinvm.bench.scenarios.save import make_save_restore
from thinvm.bench.scenarios.scale import make_migrate_compress, make_migrate_scale
from thinvm.bench.scenarios.start import make_start
from thinvm.bench.types import BenchOptions, Scenario
from thinvm.errors import ThinvmError
from thinvm.units import parse_size

# Recorded results rest on at least this many interleaved runs of each
# variant (issue 19): fewer show no spread to judge a difference by.
# --runs may ask for fewer (smoke tests).
MIN_RUNS = 5


@dataclass(frozen=True)
class ScenarioSpec:
    name: str
    title: str
    make: Callable[[BenchOptions, dict[str, str], int], Scenario]
    default_size: str
    size_help: str
    default_runs: int = 3
    params: dict[str, str] = field(default_factory=dict)
    todo: str = ""

    def build(self, options: BenchOptions) -> Scenario:
        size = options.size or parse_size(self.default_size)
        params = check_params(self.params, options.params, self.name)
        scenario = self.make(options, params, size)
        scenario.params.setdefault("build", options.build)
        return scenario

    @property
    def runs(self) -> int:
        """Runs per variant unless --runs says otherwise."""
        return max(self.default_runs, MIN_RUNS)

    @property
    def command(self) -> str:
        return f"thinvm bench {self.name}"


SCENARIOS: dict[str, ScenarioSpec] = {
    spec.name: spec
    for spec in (
        ScenarioSpec(
            "inflate",
            "balloon inflate to 7/8 and deflate",
            make_inflate,
            "4G",
            "guest RAM (8G on bigger hosts)",
            default_runs=2,
            params={"fraction": "0.875", "init_on_alloc": "1"},
        ),
        ScenarioSpec(
            "migrate-idle",
            "idle guest using 1/8 of its RAM: thinvm vs stock-best",
            make_migrate_idle,
            "2G",
            "guest RAM",
            default_runs=3,
            params={"idle": "2", "used": "0.125"},
        ),
        ScenarioSpec(
            "migrate-dirty",
            "migration under a fixed-rate dirtying workload",
            make_migrate_dirty,
            "1G",
            "guest RAM",
            default_runs=2,
            params={
                "wss_mib": "512",
                "rate_mibps": "256",
                "seconds": "20",
                "warmup": "6",
                "downtime_limit_ms": "300",
            },
        ),
        ScenarioSpec(
            "migrate-ballooned",
            "ballooned guest vs small guest migration, thinvm vs stock-best",
            make_migrate_ballooned,
            "4G",
            "RAM of the ballooned guest (the small one has 1/8)",
        ),
        ScenarioSpec(
            "migrate-scale",
            "migration vs guest size at fixed used memory",
            make_migrate_scale,
            "8G",
            "largest guest; sizes double from `from` up to it",
            default_runs=2,
            params={"idle": "2", "used": "512M", "from": "2G"},
        ),
        ScenarioSpec(
            "migrate-compress",
            "multifd compression none vs zstd (or zlib), stock-best and thinvm, for a big "
            "guest: uncapped (or over veth) and on a 1 Gbit/s link",
            make_migrate_compress,
            "16G",
            "guest RAM",
            default_runs=3,
            # rate: the veth link's (--net veth); cap_mbps=0: no capped rows.
            params={
                "idle": "2",
                "used": "512M",
                "compression": "zstd",
                "cap_mbps": "1000",
                "rate": "10gbit",
            },
        ),
        ScenarioSpec(
            "density",
            "host memory held after guests free memory",
            make_density,
            "1G",
            "RAM per guest",
            default_runs=2,
            params={"guests": "3", "touch": "0.8", "settle_max": "30"},
        ),
        ScenarioSpec(
            "density-budget",
            "guests that fit under a memory cgroup",
            make_density_budget,
            "512M",
            "RAM per guest",
            default_runs=1,
            params={"budget": "1G", "max_guests": "8", "touch": "0.8", "settle_max": "20"},
        ),
        ScenarioSpec(**overcommit.SPEC),
        ScenarioSpec(**fleet_bench.SPEC),
        ScenarioSpec(**workingset.SPEC),
        ScenarioSpec(**steady.SPEC),
        ScenarioSpec(**resize.SPEC),
        ScenarioSpec(
            "migrate-postcopy",
            "idle guest migrated in postcopy: thinvm vs stock",
            make_migrate_postcopy,
            "4G",
            "guest RAM",
            default_runs=3,
            params={"used": "0.125", "idle": "2"},
        ),
        ScenarioSpec(
            "start",
            "launch to agent ready with preallocation",
            make_start,
            "4G",
            "guest RAM (16G on bigger hosts)",
        ),
        ScenarioSpec(
            "network",
            "migration over loopback vs a shaped veth pair",
            make_network,
            "1G",
            "guest RAM",
            default_runs=2,
            params={"idle": "2", "used": "0.125", "rate": "10gbit"},
        ),
        ScenarioSpec(
            "save-restore",
            "save to a file and restore: thinvm vs stock-best",
            make_save_restore,
            "4G",
            "guest RAM",
            default_runs=2,
            params={"idle": "2", "used": "0.125"},
        ),
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
