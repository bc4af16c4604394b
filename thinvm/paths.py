"""Where thinvm keeps its caches, builds and per-VM state."""

import os
from pathlib import Path

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
