"""A scenario's registry entry: each scenario module exports its own
(SPEC, and a second one under its own name where a module makes two), and
thinvm.bench.scenarios lists them.  A module of its own, so that the
scenario modules can import it without importing the registry."""

from collections.abc import Callable
from dataclasses import dataclass, field

from thinvm.bench.scenarios.params import check_params
from thinvm.bench.types import MIN_RUNS, BenchOptions, Scenario
from thinvm.errors import ThinvmError
from thinvm.units import parse_size

__all__ = ["MIN_RUNS", "ScenarioSpec"]


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
    # False: its guests are libvirt domains, which --guest-append cannot reach.
    own_guests: bool = True

    def build(self, options: BenchOptions) -> Scenario:
        size = options.size or parse_size(self.default_size)
        params = check_params(self.params, options.params, self.name)
        if options.guest_append and not self.own_guests:
            raise ThinvmError(
                f"{self.name}: its guests are libvirt domains; --guest-append does not reach them"
            )
        scenario = self.make(options, params, size)
        scenario.params.setdefault("build", options.build)
        if options.guest_append:
            scenario.params["guest_append"] = options.guest_append
        return scenario

    @property
    def runs(self) -> int:
        """Runs per variant unless --runs says otherwise."""
        return max(self.default_runs, MIN_RUNS)

    @property
    def command(self) -> str:
        return f"thinvm bench {self.name}"
