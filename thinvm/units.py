"""Parsing and printing of memory sizes, and parsing of durations."""

import argparse
import math
import re

from thinvm.errors import ThinvmError

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
TiB = 1024 * GiB

_SUFFIX = {"": MiB, "b": 1, "k": KiB, "m": MiB, "g": GiB, "t": TiB}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([bkmgt]?)(?:i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str | int, default_unit: str = "m") -> int:
    """Parse "2G", "512M", "1.5GiB" or a bare number (MiB by default) to bytes."""
    if isinstance(text, int):
        return text
    match = _SIZE_RE.match(text)
    if not match:
        raise ThinvmError(f"cannot parse size {text!r}: use e.g. 512M, 2G or 1.5GiB")
    number, suffix = match.groups()
    unit = _SUFFIX[(suffix or default_unit).lower()]
    value = float(number) * unit
    if value != int(value):
        raise ThinvmError(f"size {text!r} is not a whole number of bytes")
    return int(value)


_RATE_UNIT = {"bit": 1, "kbit": 1000, "mbit": 1000**2, "gbit": 1000**3, "tbit": 1000**4}
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?bit)\s*$", re.IGNORECASE)


def parse_rate(text: str) -> int:
    """A link rate as tc writes it ("10gbit", "400mbit") in bits per second;
    tc's bit units are decimal, as link speeds are."""
    match = _RATE_RE.match(text)
    if not match:
        raise ThinvmError(f"cannot parse link rate {text!r}: use e.g. 10gbit or 400mbit")
    number, unit = match.groups()
    return int(float(number) * _RATE_UNIT[unit.lower()])


def format_size(nbytes: float) -> str:
    """Human-readable binary size: 1.50 GiB, 512.0 MiB, 12.0 KiB."""
    sign = "-" if nbytes < 0 else ""
    value = abs(float(nbytes))
    for unit, scale in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if value >= scale:
            return f"{sign}{value / scale:.2f} {unit}"
    return f"{sign}{value:.0f} B"


def parse_seconds(text: str, allow_zero: bool = False) -> float:
    """Parse a duration in seconds ("30", "2.5"): a finite number above 0
    (or 0 itself with allow_zero).  float() alone takes "nan" and "inf",
    which a socket timeout or sleep() then refuses with a traceback."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        want = "0 or more seconds" if allow_zero else "a positive number of seconds"
        raise ThinvmError(f"{text!r} is not {want}: use e.g. 30 or 2.5")
    return value


def seconds(text: str) -> float:
    """argparse type: a timeout, a positive and finite number of seconds."""
    try:
        return parse_seconds(text)
    except ThinvmError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def seconds_or_zero(text: str) -> float:
    """argparse type: a delay, 0 or more seconds (finite)."""
    try:
        return parse_seconds(text, allow_zero=True)
    except ThinvmError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
