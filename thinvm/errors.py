"""Errors a user can act on.

Anything raised as ThinvmError is printed by the CLI as one line that says
what was wrong and what to do, never as a traceback.
"""


class ThinvmError(Exception):
    """A failure the user can fix: bad input, missing build, dead port."""


class GuestError(ThinvmError):
    """The guest did not answer, or a guest command failed."""


class AgentBusy(GuestError):
    """The guest agent serves one request at a time and another one held it."""
