"""Advisory file locks that the kernel drops when their holder dies.

thinvm's clients of one VM (CLI commands, the balance controller, tests)
are separate processes that may be killed at any moment, so their
coordination must not leave anything behind to clean up: flock(2) locks
belong to an open file and vanish with it.
"""

import contextlib
import fcntl
import os
import time
from pathlib import Path

POLL_SECONDS = 0.05
MISSING_GRACE = 2.0  # seconds a lock's directory may be missing while replaced


class FileLock:
    """flock(2) on `path` (created if missing), shared or exclusive.

    A lock file that is renamed away or replaced while we wait for it (a
    VM's run directory replaced by a local migration) is not the lock any
    more: acquiring checks that `path` still names the inode we locked.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def try_acquire(self, exclusive: bool = True) -> bool:
        """Take the lock if nobody holds it in a conflicting mode."""
        if self._fd is not None:
            raise RuntimeError(f"lock {self.path} is held already")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
            current = os.stat(self.path).st_ino
        except (BlockingIOError, FileNotFoundError):
            os.close(fd)
            return False
        if current != os.fstat(fd).st_ino:
            os.close(fd)
            return False
        self._fd = fd
        return True

    def acquire(self, timeout: float, exclusive: bool = True) -> bool:
        """Wait up to `timeout` seconds for the lock; False if it stayed taken.

        A directory that is missing for a moment (renamed away, its
        successor renamed in) is waited for; one that stays missing for
        MISSING_GRACE raises FileNotFoundError.
        """
        deadline = time.monotonic() + timeout
        missing_since: float | None = None
        while True:
            try:
                if self.try_acquire(exclusive):
                    return True
                missing_since = None
            except FileNotFoundError:
                now = time.monotonic()
                missing_since = missing_since or now
                if now - missing_since >= MISSING_GRACE:
                    raise
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_SECONDS)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.release()
