"""The downtime rule (thinvm.vm.downtime) and how a record is judged by it."""

import json
from typing import Any

from thinvm.bench.report import render_section
from thinvm.bench.results import downtime_verdict, downtime_verdicts
from thinvm.paths import REPO
from thinvm.vm.downtime import DowntimeVerdict


def test_the_bound_is_stock_best_times_1_2_plus_20_ms_and_every_run_within_the_limit() -> None:
    assert DowntimeVerdict(51, 60, 26, 300).met  # 26 * 1.2 + 20 = 51.2
    assert not DowntimeVerdict(52, 60, 26, 300).met
    assert not DowntimeVerdict(40, 301, 26, 300).met  # one run over the limit
    assert "NOT met" in DowntimeVerdict(279, 350, 176, 300).describe()


def record(ours: dict[str, Any] | None, params: dict[str, Any] | None = None) -> dict[str, Any]:
    summary: dict[str, Any] = {"stock-best": {"downtime_ms": {"median": 26, "max": 45}}}
    if ours is not None:
        summary["thinvm"] = {"downtime_ms": ours}
    return {"summary": summary, "params": params or {}}


def test_a_record_is_judged_from_its_rows_with_qemus_default_limit() -> None:
    verdict = downtime_verdict(record({"median": 4, "max": 7}))
    assert verdict == DowntimeVerdict(4, 7, 26, 300)
    tight = downtime_verdict(record({"median": 4, "max": 7}, {"downtime-limit": 5}))
    assert tight is not None and not tight.met
    assert downtime_verdict(record(None)) is None
    assert downtime_verdict(record({"median": None, "max": None})) is None


def test_every_pair_of_rows_is_judged_prefixed_ones_too() -> None:
    summary = {
        "128G-thinvm": {"downtime_ms": {"median": 15, "max": 21}},
        "128G-stock-best": {"downtime_ms": {"median": 290, "max": 296}},
        "pkg-thinvm": {"downtime_ms": {"median": 70, "max": 400}},
        "pkg-stock-best": {"downtime_ms": {"median": 112, "max": 157}},
        "pkg-thinvm-to-stock": {"downtime_ms": {"median": 60, "max": 102}},
        "thinvm": {"downtime_ms": {"median": 4, "max": 7}},
    }
    verdicts = downtime_verdicts({"summary": summary, "params": {}})
    assert sorted(verdicts) == ["128G-", "pkg-"]  # no stock-best beside "thinvm"
    assert verdicts["128G-"] == DowntimeVerdict(15, 21, 290, 300)
    assert not verdicts["pkg-"].met  # one run over the limit


def test_a_rendered_record_states_the_verdict() -> None:
    path = REPO / "bench/results/migrate-ballooned-20261128T043337Z.json"
    section = render_section(json.loads(path.read_text()), "img")
    assert "Downtime rule (thinvm.vm.downtime): thinvm 4 ms (worst 7 ms)" in section
    assert "= 51.2 ms, limit 300 ms: met." in section


def test_a_rendered_record_judges_its_prefixed_rows() -> None:
    path = REPO / "bench/results/migrate-scale-20261129T191428Z.json"
    section = render_section(json.loads(path.read_text()), "img")
    assert "Downtime rule (thinvm.vm.downtime) (128G- rows): thinvm 15 ms (worst 21 ms)" in section
