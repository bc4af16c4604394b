"""Finishing an interrupted record: `thinvm bench NAME ... --resume STEM`.

A record of two hours (five overcommit passes) does not always fit in one
sitting.  While it runs, the runner keeps what it started with in
STEM.start.json beside the runs log (STEM.runs.jsonl): the scenario, its
parameters, the variants, the runs per variant, the quiet gate and the
environment (commit, QEMU builds, guest kernel, host).  A resumed record
runs only the passes the log does not hold whole, in the same alternating
order, and refuses unless every one of those is what the interrupted
record started with: runs measured with other code, another guest or
another gate would not belong in one record.  A pass (run k of every
variant) is made in one sitting: the runs of a pass the interruption cut
are made again, since a scenario may carry state from one variant to the
next within a pass (overcommit's time bar comes from the pass's
unconstrained run).  The record keeps the time each sitting began, so a
reader sees that it was made in parts.
"""

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from thinvm.bench.results import ISO_FORMAT
from thinvm.errors import ThinvmError

RUNS_SUFFIX = ".runs.jsonl"
START_SUFFIX = ".start.json"

# What must be equal for runs of two sittings to stand in one record.
SAME_KEYS = ("scenario", "params", "variants", "runs", "gate", "environment")


@dataclass
class Sitting:
    """What a record started with, and the runs it has finished so far."""

    stem: str
    start: dict[str, Any]
    records: list[dict[str, Any]]


def parse_stamp(text: str) -> datetime:
    return datetime.strptime(text, ISO_FORMAT).replace(tzinfo=UTC)


def stem_of(text: str) -> str:
    """The record's stem from what the user passed: a stem or either file's path."""
    name = Path(text).name
    for suffix in (RUNS_SUFFIX, START_SUFFIX, ".json"):
        name = name.removesuffix(suffix)
    return name


def write_start(directory: Path, stem: str, start: dict[str, Any]) -> Path:
    path = directory / f"{stem}{START_SUFFIX}"
    path.write_text(json.dumps(start, indent=1, default=str) + "\n")
    return path


def remove(directory: Path, stem: str) -> None:
    """Once the record is written, its runs log and start file are in it."""
    for suffix in (RUNS_SUFFIX, START_SUFFIX):
        (directory / f"{stem}{suffix}").unlink(missing_ok=True)


def load(directory: Path, stem: str) -> Sitting:
    start_path = directory / f"{stem}{START_SUFFIX}"
    runs_path = directory / f"{stem}{RUNS_SUFFIX}"
    if not start_path.is_file():
        raise ThinvmError(
            f"--resume {stem}: no {start_path} (records started before --resume existed, "
            "or already written, cannot be resumed)"
        )
    start = json.loads(start_path.read_text())
    lines = runs_path.read_text().splitlines() if runs_path.is_file() else []
    records = [json.loads(line) for line in lines if line.strip()]
    return Sitting(stem, start, records)


def differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What differs between the interrupted record's start and this one,
    down to the environment's keys (e.g. 'environment.thinvm_commit')."""
    found = []
    for key in SAME_KEYS:
        before, after = saved.get(key), _plain(now.get(key))
        if before == after:
            continue
        if isinstance(before, dict) and isinstance(after, dict):
            found += [
                f"{key}.{k}: {before.get(k)!r} then, {after.get(k)!r} now"
                for k in sorted(set(before) | set(after))
                if before.get(k) != after.get(k)
            ]
        else:
            found.append(f"{key}: {before!r} then, {after!r} now")
    return found


def check_same(sitting: Sitting, now: dict[str, Any]) -> None:
    found = differences(sitting.start, now)
    if found:
        raise ThinvmError(
            f"--resume {sitting.stem}: this sitting would not measure what the record "
            "started with:\n  " + "\n  ".join(found)
        )


def split_passes(
    records: list[dict[str, Any]], variants: list[str]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The runs of the passes that hold every variant, and the others (the
    runs of a pass an interruption cut)."""
    seen: dict[int, set[str]] = {}
    for record in records:
        seen.setdefault(int(record["run"]), set()).add(str(record["variant"]))
    whole = {k for k, names in seen.items() if names >= set(variants)}
    kept = [r for r in records if int(r["run"]) in whole]
    cut = [r for r in records if int(r["run"]) not in whole]
    return kept, cut


def resumed(
    directory: Path, text: str, started: dict[str, Any]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """This sitting's start record merged into the interrupted record's,
    and the runs of the passes that record holds whole (the runs log is
    rewritten to hold only those); refuses a sitting that would measure
    something else (check_same)."""
    sitting = load(directory, stem_of(text))
    check_same(sitting, started)
    saved = sitting.start
    earlier, cut = split_passes(sitting.records, saved["variants"])
    runs_log = directory / f"{sitting.stem}{RUNS_SUFFIX}"
    runs_log.write_text("".join(json.dumps(r, default=str) + "\n" for r in earlier))
    merged = {
        **started,
        "created": saved["created"],
        "command": saved["command"],
        "sittings": [*saved["sittings"], *started["sittings"]],
        # Lost if the sitting was killed outright: its runs' own time then.
        "wall_seconds": saved.get("wall_seconds") or sum(r["seconds"] for r in sitting.records),
        "resumed_with": [*saved.get("resumed_with", []), started["command"]],
        # Measured, then made again with the rest of their pass: kept, not
        # counted in the summary.
        "cut_runs": [*saved.get("cut_runs", []), *cut],
    }
    return merged, earlier


def sittings_record(started: dict[str, Any]) -> dict[str, Any]:
    """For the record's load: when each sitting began and the commands that
    resumed it (the first command is the record's own), if made in parts."""
    if len(started["sittings"]) < 2:
        return {}
    return {
        "sittings": started["sittings"],
        "resumed_with": started["resumed_with"],
        # Runs of passes an interruption cut, measured and then made again.
        "cut_runs": started["cut_runs"],
    }


def _plain(value: Any) -> Any:
    """As the start file stores it (tuples become lists, paths strings)."""
    return json.loads(json.dumps(value, default=str))
