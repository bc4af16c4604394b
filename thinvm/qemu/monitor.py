"""A blocking façade over qemu.qmp's asyncio QMPClient.

The control plane is sequential (start a VM, ask it things, migrate it),
so each Monitor runs its own private event loop and every call blocks
until QEMU answers.  The protocol itself is entirely qemu.qmp's.
"""

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any, TypeVar

from qemu.qmp import ConnectError, ExecuteError, QMPClient, QMPError

from thinvm.errors import ThinvmError

T = TypeVar("T")


class Monitor:
    """One QMP connection to one QEMU process."""

    def __init__(self, name: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._client = QMPClient(name)
        self._connected = False

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float | None) -> T:
        return self._loop.run_until_complete(asyncio.wait_for(coro, timeout))

    def connect(self, path: str, timeout: float = 10.0) -> None:
        try:
            self._run(self._client.connect(path), timeout)
        except (ConnectError, OSError, TimeoutError) as exc:
            raise ThinvmError(f"cannot connect to QMP socket {path}: {exc}") from exc
        self._connected = True

    def cmd(
        self, command: str, timeout: float | None = 60.0, oob: bool = False, **args: Any
    ) -> Any:
        """Execute one QMP command; QMP errors become ThinvmError.

        `oob` sends it out of band, for the few commands that allow it
        (migrate-recover, migrate-pause): they are answered even while
        QEMU's main thread waits, e.g. on a postcopy page fault.
        """
        args = {key.replace("_", "-"): value for key, value in args.items()}
        try:
            return self._run(self._client.execute(command, args or None, oob=oob), timeout)
        except ExecuteError as exc:
            raise ThinvmError(f"QMP {command} failed: {exc.error.error.desc}") from exc
        except (QMPError, EOFError, OSError) as exc:
            # QEMU went away mid-command (it quit, crashed or was killed).
            raise ThinvmError(f"QMP {command}: connection to QEMU lost ({exc!r})") from exc

    def close(self) -> None:
        """Disconnect and close the private loop (idempotent).

        qemu.qmp's reader and writer are tasks on our loop.  A loop closed
        (or garbage-collected at interpreter exit) with those still pending
        makes Python print "Task was destroyed but it is pending" and
        "no running event loop" tracebacks, so every task is finished here,
        inside the loop, before it closes.
        """
        if self._loop.is_closed():
            return
        if self._connected:
            # After `quit` the reader task ends with EOFError; that is the goodbye.
            with contextlib.suppress(OSError, EOFError, TimeoutError, asyncio.CancelledError):
                self._run(self._client.disconnect(), 5.0)
            self._connected = False
        self._finish_tasks()
        self._loop.close()

    def _finish_tasks(self) -> None:
        pending = asyncio.all_tasks(self._loop)
        for task in pending:
            task.cancel()
        if pending:
            self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self._loop.run_until_complete(self._loop.shutdown_asyncgens())

    def __del__(self) -> None:
        # A Monitor nobody closed (an error path, interpreter exit) must not
        # leave tracebacks behind either.
        with contextlib.suppress(Exception):
            self.close()
