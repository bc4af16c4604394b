"""The downtime rule thinvm keeps against stock-best (issue 47).

A migration's downtime is what operators watch most, so thinvm's may not
be worse than the best stock configuration's beyond noise: its median at
most stock-best's median x 1.2 + 20 ms, and every run within the
migration's `downtime-limit`.  The benchmarks' records and `make demo`
judge by this one rule.
"""

from dataclasses import dataclass

FACTOR = 1.2
SLACK_MS = 20.0
QEMU_DEFAULT_LIMIT_MS = 300


@dataclass(frozen=True)
class DowntimeVerdict:
    ours_ms: float  # thinvm's median
    ours_max_ms: float  # thinvm's worst run
    stock_ms: float  # stock-best's median
    limit_ms: float

    @property
    def bound_ms(self) -> float:
        return self.stock_ms * FACTOR + SLACK_MS

    @property
    def met(self) -> bool:
        return self.ours_ms <= self.bound_ms and self.ours_max_ms <= self.limit_ms

    def describe(self) -> str:
        return (
            f"thinvm {self.ours_ms:g} ms (worst {self.ours_max_ms:g} ms), bound "
            f"stock-best {self.stock_ms:g} ms x {FACTOR:g} + {SLACK_MS:g} = "
            f"{self.bound_ms:.1f} ms, limit {self.limit_ms:g} ms: "
            f"{'met' if self.met else 'NOT met'}"
        )
