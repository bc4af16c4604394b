"""Finishing an interrupted record with --resume (thinvm.bench.resume)."""

import json
from pathlib import Path
from typing import Any

import pytest

from thinvm.bench import probe as bench_probe
from thinvm.bench import report, resume, runner
from thinvm.bench import scenarios as bench_scenarios
from thinvm.bench import types as bench_types
from thinvm.bench.types import BenchOptions, RunContext, Scenario, Variant
from thinvm.errors import ThinvmError


class _Silent:
    def update(self, text: str, force: bool = False) -> None:
        pass

    def done(self, text: str | None = None) -> None:
        pass


def _install(
    monkeypatch: pytest.MonkeyPatch, calls: list[str], stop_at: str | None, size: str = "1G"
) -> None:
    """A two-variant scenario that stops (as Ctrl-C would) at the run named stop_at."""

    def variant(name: str) -> Variant:
        def run(ctx: RunContext) -> bench_types.Metrics:
            if f"{name}{ctx.run}" == stop_at:
                raise KeyboardInterrupt
            calls.append(f"{name}{ctx.run}")
            return {"inflate_s": float(ctx.run)}

        return Variant(name, run)

    def make(opts: BenchOptions, params: dict[str, str], size_bytes: int) -> Scenario:
        return Scenario(
            "inflate", "t", "d", [variant("a"), variant("b")], "inflate_s", params={"size": size}
        )

    spec = bench_scenarios.ScenarioSpec("inflate", "t", make, "1G", "RAM", 5)
    monkeypatch.setattr(bench_scenarios, "SCENARIOS", {"inflate": spec})
    monkeypatch.setattr(runner, "guest_environment", lambda *args: {"qemu": {}, "accel": "tcg"})
    monkeypatch.setattr(bench_probe, "counter_backend", lambda requested: "perf")


def _run(results: Path, **options: Any) -> Path:
    return runner.run(
        "inflate",
        BenchOptions(quiet_wait=0, **options),
        results_dir=results,
        docs=None,
        command=["thinvm", "bench", "inflate"],
        line=_Silent(),  # type: ignore[arg-type]
    )


def _interrupted(
    monkeypatch: pytest.MonkeyPatch, results: Path, calls: list[str], stop_at: str = "a3"
) -> str:
    _install(monkeypatch, calls, stop_at=stop_at)
    with pytest.raises(KeyboardInterrupt):
        _run(results)
    (log,) = results.glob("*.runs.jsonl")
    return resume.stem_of(str(log))


def test_a_resumed_record_makes_only_the_runs_it_lacks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    stem = _interrupted(monkeypatch, tmp_path, calls)
    assert calls == ["a1", "b1", "a2", "b2"]
    _install(monkeypatch, calls, stop_at=None)
    path = _run(tmp_path, resume=stem)
    assert path.name == f"{stem}.json"  # the record keeps its first sitting's stamp
    assert calls == ["a1", "b1", "a2", "b2", "a3", "b3", "a4", "b4", "a5", "b5"]
    data = json.loads(path.read_text())
    pairs = [(r["variant"], r["run"]) for r in data["runs"]]
    assert sorted(pairs) == sorted({(v, k) for v in "ab" for k in range(1, 6)})
    assert len(data["load"]["sittings"]) == 2
    assert data["load"]["resumed_with"] == [["thinvm", "bench", "inflate"]]
    assert data["wall_seconds"] >= 0
    assert "made in 2 sittings (--resume), begun " in report.render_document(
        [data], bench_scenarios.catalogue(), image_dir="."
    )
    assert not list(tmp_path.glob("*.runs.jsonl")) and not list(tmp_path.glob("*.start.json"))


def test_a_pass_the_interruption_cut_is_made_again_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Overcommit's variants judge against the bar their pass's first row
    set: a pass is never split between two sittings."""
    calls: list[str] = []
    stem = _interrupted(monkeypatch, tmp_path, calls, stop_at="b3")
    assert calls == ["a1", "b1", "a2", "b2", "a3"]
    _install(monkeypatch, calls, stop_at=None)
    data = json.loads(_run(tmp_path, resume=stem).read_text())
    assert calls[5:] == ["a3", "b3", "a4", "b4", "a5", "b5"]
    assert sorted((r["variant"], r["run"]) for r in data["runs"]) == sorted(
        (v, k) for v in "ab" for k in range(1, 6)
    )
    assert [(r["variant"], r["run"]) for r in data["load"]["cut_runs"]] == [("a", 3)]
    assert "(1 run(s) of a pass an interruption cut made again)" in report.render_document(
        [data], bench_scenarios.catalogue(), image_dir="."
    )


def test_resume_refuses_other_parameters(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    stem = _interrupted(monkeypatch, tmp_path, calls)
    _install(monkeypatch, calls, stop_at=None, size="2G")
    with pytest.raises(ThinvmError, match=r"params\.size: '1G' then, '2G' now"):
        _run(tmp_path, resume=stem)
    assert calls == ["a1", "b1", "a2", "b2"]  # nothing more was run


def test_resume_refuses_another_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    stem = _interrupted(monkeypatch, tmp_path, calls)
    _install(monkeypatch, calls, stop_at=None)
    start = tmp_path / f"{stem}.start.json"
    saved = json.loads(start.read_text())
    saved["environment"]["thinvm_commit"] = "0123456789ab"
    start.write_text(json.dumps(saved))
    with pytest.raises(ThinvmError, match=r"environment\.thinvm_commit: '0123456789ab' then"):
        _run(tmp_path, resume=stem)


def test_resume_needs_a_start_file(tmp_path: Path) -> None:
    with pytest.raises(ThinvmError, match="cannot be resumed"):
        resume.load(tmp_path, "inflate-20261130T000000Z")


def test_stem_of_accepts_either_file() -> None:
    stem = "fleet-overcommit-20261130T013049Z"
    for text in (stem, f"bench/results/{stem}.runs.jsonl", f"/x/{stem}.start.json"):
        assert resume.stem_of(text) == stem
