"""Parsing a scenario's --param values, with errors that say what to pass."""

from thinvm.errors import ThinvmError
from thinvm.units import MiB, parse_size


def check_params(
    spec_defaults: dict[str, str], given: dict[str, str], scenario: str
) -> dict[str, str]:
    unknown = sorted(set(given) - set(spec_defaults))
    if unknown:
        known = ", ".join(spec_defaults) or "none"
        raise ThinvmError(
            f"scenario {scenario} has no parameter {', '.join(unknown)} (known: {known})"
        )
    return {**spec_defaults, **given}


def int_param(params: dict[str, str], key: str) -> int:
    try:
        return int(params[key])
    except ValueError as exc:
        raise ThinvmError(f"--param {key}={params[key]!r}: want a whole number") from exc


def float_param(params: dict[str, str], key: str) -> float:
    try:
        return float(params[key])
    except ValueError as exc:
        raise ThinvmError(f"--param {key}={params[key]!r}: want a number") from exc


def size_param(params: dict[str, str], key: str) -> int:
    try:
        return parse_size(params[key])
    except ValueError as exc:
        raise ThinvmError(f"--param {key}={params[key]!r}: want a size like 512M") from exc


def used_fraction(params: dict[str, str]) -> float:
    used = float_param(params, "used")
    if not 0 <= used < 1:
        raise ThinvmError(f"--param used={used}: want a fraction of guest RAM, 0 to below 1")
    return used


def used_bytes(params: dict[str, str], size: int) -> int:
    """The `used` fraction of a guest of `size`, in whole MiB."""
    return int(size * used_fraction(params)) // MiB * MiB
