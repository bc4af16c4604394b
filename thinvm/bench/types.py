"""What a benchmark is made of: scenarios, their variants and targets, options.

A Scenario has named Variants; each variant is a callable that performs ONE
measurement (usually: boot fresh guests, do one thing, tear down) and
returns a dict of numeric metrics.  thinvm.bench.runner runs them,
thinvm.bench.results summarises and records them.  This module imports
nothing else of the bench, so every other module can import it.
"""

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from typing import Any

from thinvm.bench.quiet import QuietGate
from thinvm.errors import ThinvmError
from thinvm.vm.machine import VM, BalloonOptions, VMConfig
from thinvm.vm.stack import Stack

Metric = float | int | None
Metrics = dict[str, Metric]

# Appended to every benchmark guest's command line: QEMU names its threads
# (vCPUs, migration, multifd channels) only when asked to, and the CPU
# accounting (thinvm.bench.cpu) tells them apart by name.  -name options
# merge, so the guest keeps the name thinvm gave it.
GUEST_ARGS = ("-name", "debug-threads=on")

# Recorded results rest on at least this many interleaved runs of each
# variant (issue 19): fewer show no spread to judge a difference by.
# --runs may ask for fewer (smoke tests, one-pass probes).
MIN_RUNS = 5


@dataclass
class RunContext:
    """What a variant's measurement gets from the harness."""

    scenario: str
    variant: str
    run: int  # 1-based run number of this variant
    runs: int
    progress: Callable[[str], None] = lambda _text: None
    info: dict[str, Any] = field(default_factory=dict)

    def step(self, text: str) -> None:
        """Show what the run is doing now on the progress line."""
        self.progress(text)

    def note(self, key: str, value: Any) -> None:
        """Record a non-numeric fact about this run (accel, a guest's output)."""
        self.info[key] = value


@dataclass(frozen=True)
class Variant:
    name: str
    run: Callable[[RunContext], Metrics]
    description: str = ""
    # The variant this one's ratios are taken against; default: the
    # scenario's baseline.  E.g. thinvm at 8 GiB against stock at 8 GiB.
    reference: str | None = None


@dataclass(frozen=True)
class Target:
    """A goal stated as a ratio: `variant`'s median `metric` / `reference`'s <= at_most.

    "thinvm at least 3x faster than stock-best" is
    Target(..., "thinvm", "stock-best", "migration_ms", at_most=1 / 3).
    With `reference_metric` the reference's median of that metric is the
    denominator: "within 1.3x of the link's time for the bytes sent" is
    Target(..., "thinvm", "thinvm", "migration_ms", 1.3, reference_metric="link_ms").
    """

    label: str
    variant: str
    reference: str
    metric: str
    at_most: float
    reference_metric: str | None = None


@dataclass(frozen=True)
class Best:
    """A row that carries the figures of the best of several measured variants.

    "stock-best" is not one configuration chosen beforehand but whichever
    stock configuration did best in the same run (issue 19): the harness
    picks, among `candidates` that succeeded, the one with the lowest median
    of the scenario's `best_metric`, and copies its figures into this row.
    """

    name: str
    candidates: tuple[str, ...]
    description: str = ""
    # The row this one's ratios are taken against; default: the baseline.
    reference: str | None = None


@dataclass
class Scenario:
    name: str
    title: str
    description: str  # markdown: what it measures and how
    variants: list[Variant]
    main_metric: str
    second_metric: str | None = None
    baseline: str | None = None  # default: the first row
    params: dict[str, Any] = field(default_factory=dict)
    targets: list[Target] = field(default_factory=list)
    # Entered once around all runs (e.g. a veth link, a memory cgroup).
    context: Callable[[], AbstractContextManager[Any]] | None = None
    # Rows chosen from the measured variants, shown before them.
    best: list[Best] = field(default_factory=list)
    best_metric: str | None = None  # default: main_metric; lower wins

    @property
    def rows(self) -> list[str]:
        """Every row of the results: the chosen ones, then the measured variants."""
        return [b.name for b in self.best] + [v.name for v in self.variants]

    @property
    def baseline_name(self) -> str:
        return self.baseline or self.rows[0]

    @property
    def choice_metric(self) -> str:
        return self.best_metric or self.main_metric

    @property
    def references(self) -> dict[str, str]:
        """Row -> the row its ratios are taken against, where that exists."""
        names = set(self.rows)
        pairs = [(v.name, v.reference) for v in self.variants]
        pairs += [(b.name, b.reference) for b in self.best]
        return {
            name: reference
            for name, reference in pairs
            if reference is not None and reference in names and reference != name
        }

    def select(self, names: Sequence[str]) -> None:
        """Keep only the named variants, in the order given.

        Naming a chosen row (stock-best) keeps all its candidates; a chosen
        row stays if any of its candidates does, chosen among those.
        """
        known = {v.name: v for v in self.variants}
        groups = {b.name: b.candidates for b in self.best}
        unknown = [n for n in names if n not in known and n not in groups]
        if unknown:
            raise ThinvmError(
                f"scenario {self.name} has no variant {', '.join(unknown)}: "
                f"choose from {', '.join([*groups, *known])}"
            )
        wanted: dict[str, None] = {}
        for name in names:
            wanted.update(dict.fromkeys(groups.get(name, (name,))))
        self.variants = [known[n] for n in wanted]
        self.best = [
            replace(b, candidates=tuple(c for c in b.candidates if c in wanted))
            for b in self.best
            if any(c in wanted for c in b.candidates)
        ]
        if self.baseline not in self.rows:
            self.baseline = None


@dataclass
class BenchOptions:
    """How to run a scenario; the CLI fills it from its flags."""

    size: int | None = None
    runs: int | None = None
    variants: list[str] = field(default_factory=list)
    params: dict[str, str] = field(default_factory=dict)
    build: str = "stock"
    kernel: str = "6.1"
    driver: str = "stock"
    accel: str = "auto"
    counter: str = "auto"
    net: str = "loopback"
    # The quiet gate (thinvm.bench.quiet): each run waits up to quiet_wait
    # seconds for a 1-minute load below quiet_load and no foreign QEMU.
    quiet_load: float = QuietGate.max_load
    quiet_wait: float = QuietGate.max_wait_s
    # The class the scenarios start their guests with: users' VM, booted as
    # users boot it; the test suite passes its KeptBootVM (thinvm.testing),
    # which only checks that the scenarios run, not what they measure.
    vm_class: type[VM] = VM
    # Migrations: the source (its guest's vCPUs with it) and the destination
    # on CPUs of their own (Transport, side_cpus), standing for two hosts.
    pin_sides: bool = True
    # Kernel arguments added to every guest the harness boots itself (not
    # libvirt domains), e.g. "init_on_alloc=0": one record of every
    # variant under the same guest, recorded in its params.
    guest_append: str = ""
    # Finish an interrupted record (thinvm.bench.resume): its stem.
    resume: str | None = None

    def vm_config(
        self,
        name: str,
        memory: int,
        stack: Stack | None = None,
        *,
        reporting: bool = False,
        prealloc: bool = False,
        prealloc_threads: int = 1,
        reserve: bool = True,
    ) -> VMConfig:
        """The one place a benchmark guest's VMConfig is built.

        With a `stack`, its build, driver and balloon features decide; without
        one, the --build and --driver the run was given, and a balloon with
        free page reporting if `reporting`.
        """
        if stack is not None and reporting:
            raise ValueError("reporting comes from the stack when one is given")
        return VMConfig(
            name=name,
            build=stack.build if stack else self.build,
            memory=memory,
            accel=self.accel,
            kernel=self.kernel,
            guest_driver=stack.driver if stack else self.driver,
            prealloc=prealloc,
            prealloc_threads=prealloc_threads,
            reserve=reserve,
            balloon=stack.balloon() if stack else BalloonOptions(free_page_reporting=reporting),
            extra_args=list(GUEST_ARGS),
            append=self.guest_append,
        )
