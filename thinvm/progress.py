"""Progress lines for long operations.

On a terminal one line is redrawn in place; in a log (CI, a pipe) a line
is printed at most every `interval` seconds, so logs stay readable.
"""

import sys
import time
from typing import TextIO


class ProgressLine:
    def __init__(self, prefix: str = "", interval: float = 2.0, stream: TextIO | None = None):
        self.prefix = prefix
        self.interval = interval
        self.stream = stream or sys.stderr
        self._tty = self.stream.isatty()
        self._last = 0.0
        self._pending = ""

    def update(self, text: str, force: bool = False) -> None:
        now = time.monotonic()
        self._pending = text
        if self._tty:
            self.stream.write(f"\r\033[K{self.prefix}{text}")
            self.stream.flush()
        elif force or now - self._last >= self.interval:
            self.stream.write(f"{self.prefix}{text}\n")
            self.stream.flush()
            self._last = now
            self._pending = ""

    def done(self, text: str | None = None) -> None:
        """Finish: the final state is always shown, once."""
        final = text if text is not None else self._pending
        if self._tty:
            self.stream.write(f"\r\033[K{self.prefix}{final}\n")
        elif final:
            self.stream.write(f"{self.prefix}{final}\n")
        self.stream.flush()
