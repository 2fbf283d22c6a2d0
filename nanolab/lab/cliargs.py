"""The benches' command-line values, checked where they are parsed: each error names its flag and
what it takes, for `python -m nanolab` to print as one `error:` line."""

from __future__ import annotations

import argparse
import math


def positive_int(text: str | int, flag: str, minimum: int = 1) -> int:
    """An integer of at least `minimum`, from text or an int argparse already made."""
    try:
        value = int(text) if isinstance(text, str) else text
    except ValueError:
        raise ValueError(f"{flag}: {text!r} is not an integer") from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{flag}: {value!r} is not an integer")
    if value < minimum:
        raise ValueError(f"{flag}: {value} must be at least {minimum}")
    return value


def _parts(text: str, flag: str, what: str) -> list[str]:
    """The comma-separated entries of `text`, stripped: none empty ("1,,2"), none twice."""
    parts = [part.strip() for part in text.split(",")]
    if not any(parts):
        raise ValueError(f"{flag}: {text!r} holds no value (comma-separated {what})")
    if not all(parts):
        raise ValueError(f"{flag}: {text!r} has an empty entry")
    return parts


def _unique(values: list, text: str, flag: str) -> list:
    if len(set(values)) != len(values):
        raise ValueError(f"{flag}: {text!r} names a value twice")
    return values


def int_list(text: str, flag: str, minimum: int = 1) -> list[int]:
    """"1,8,32" -> [1, 8, 32], each at least `minimum`, none twice; an empty list or entry is an error."""
    return _unique([positive_int(part, flag, minimum) for part in _parts(text, flag, "integers")], text, flag)


def int_pair(text: str, flag: str) -> tuple[int, int]:
    """"lo,hi" -> (lo, hi), 1 <= lo <= hi."""
    parts = text.split(",")
    if len(parts) != 2:
        raise ValueError(f"{flag}: {text!r} must be lo,hi")
    lo, hi = (positive_int(p.strip(), flag) for p in parts)
    if lo > hi:
        raise ValueError(f"{flag}: {text!r} has lo above hi")
    return lo, hi


def int_pair_arg(text: str) -> tuple[int, int]:
    """`int_pair` as an argparse type: argparse names the flag in front of the message."""
    try:
        return int_pair(text, "lo,hi")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def positive_float(value: str | float, flag: str) -> float:
    """A finite number above 0."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{flag}: {value!r} is not a number") from None
    if not math.isfinite(number) or number <= 0:
        raise ValueError(f"{flag}: {value!r} must be a finite number above 0")
    return number


def float_list(text: str, flag: str) -> list[float]:
    """"1,2.5" -> [1.0, 2.5], each finite and above 0, none twice; an empty list or entry is an error."""
    return _unique([positive_float(part, flag) for part in _parts(text, flag, "numbers")], text, flag)
