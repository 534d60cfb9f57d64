"""Byte counts as users write them: ``24GiB``, ``1.5e9``, ``512 MB``."""

from __future__ import annotations

import math
import re
from decimal import Decimal

from slackswap.errors import InputError

__all__ = ["parse_bytes", "format_bytes", "resolve_budget"]

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
MAX_BYTES = 2**63 - 1  # 8 EiB: what a signed 64-bit count holds, far beyond any memory
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str | int | float) -> int:
    """Parse a positive byte count such as ``"24GiB"``, ``"3e9"`` or ``1024``."""
    if isinstance(text, (int, float)):
        value, unit = Decimal(text), ""
    else:
        m = _PATTERN.match(text)
        if not m or m.group(2).lower() not in _UNITS:
            raise InputError(f"'{text}' is not a byte count; write e.g. 24GiB, 512MB or 3e9")
        value, unit = Decimal(m.group(1)), m.group(2).lower()
    if not value.is_finite():
        raise InputError(f"'{text}' is not a byte count; write e.g. 24GiB, 512MB or 3e9")
    if unit in ("", "b") and value != value.to_integral_value():
        raise InputError(f"'{text}' is not a whole number of bytes; write e.g. 3000000000, "
                         "or a size with a unit such as 1.5GiB")
    result = int(value * _UNITS[unit])  # (a size with a unit: whole bytes, rounded down)
    if result <= 0:
        raise InputError(f"'{text}' must be a positive number of bytes")
    if result > MAX_BYTES:
        raise InputError(f"'{text}' is more bytes than any memory holds (at most 8 EiB)")
    return result


def format_bytes(n: float) -> str:
    """Human-readable binary size, e.g. ``1.50 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def resolve_budget(spec: str | int | float, peak: int) -> int:
    """A memory budget in bytes: a fraction of ``peak`` (``0.5``), bytes, or ``"24GiB"``.

    Numbers in (0, 1] are fractions; larger whole numbers and strings with a unit are
    bytes. A larger number that is not whole (``1.5``) means neither, and is refused.
    """
    if isinstance(spec, bool):
        raise InputError(f"budget {spec} is not a budget: a fraction such as 0.5, bytes, or "
                         "a size such as 4GiB")
    try:
        value = float(spec)
    except (TypeError, ValueError):
        return parse_bytes(spec)  # type: ignore[arg-type]
    except OverflowError:
        value = math.inf
    if not math.isfinite(value):
        raise InputError(f"budget '{spec}' must be a finite number: a fraction such as 0.5, "
                         "or bytes")
    if value <= 0:
        raise InputError(f"budget '{spec}' must be positive: a fraction such as 0.5, or bytes")
    if value <= 1:
        if peak <= 0:
            raise InputError(f"budget '{spec}' is a fraction of the keep-all activation peak, "
                             "which is 0 bytes for this profile: it holds no activations, so "
                             "there is nothing to plan")
        return int(value * peak)
    if not value.is_integer():
        raise InputError(f"budget '{spec}' is neither a fraction nor bytes: fractions of the "
                         "keep-all peak are in (0, 1], bytes are whole numbers or sizes such "
                         "as 4GiB")
    return parse_bytes(spec)
