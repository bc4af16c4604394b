"""Where thinvm keeps its caches, builds and per-VM state."""

import json
import os
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def cache_dir() -> Path:
    """Root of everything built or downloaded; outside the work tree."""
    env = os.environ.get("THINVM_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "thinvm"


def run_dir() -> Path:
    """Per-VM state of detached VMs (`thinvm up`): sockets, logs, pid.

    THINVM_RUN moves it, so that tests can use the README's VM names
    without touching a user's VMs of the same name.
    """
    env = os.environ.get("THINVM_RUN")
    return Path(env) if env else cache_dir() / "run"


def write_json_atomic(path: Path, data: Any) -> None:
    """Write `data` as JSON to `path` through a rename, so that a reader
    (another process, or this one after a crash) sees the old file or the
    new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    with open(tmp, "w") as out:
        json.dump(data, out, indent=2)
        out.write("\n")
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)
