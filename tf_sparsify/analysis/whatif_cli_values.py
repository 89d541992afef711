"""The values of ``python -m tf_sparsify whatif``'s options: bandwidths, durations, sizes and
counts with their units, ``METHOD=MS`` overhead lists, and bounded numbers.

Each parser is an argparse ``type=``: a bad value raises :class:`OptionError`, which argparse
reports as ``argument --option: <message>`` and other callers can catch as a ValueError. The
message quotes the text as given.
"""

from __future__ import annotations

import argparse
import decimal
import math
import re
from collections.abc import Sequence

from tf_sparsify.common.checks import check_int, check_number

_SI = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_SECONDS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
_BYTES = {"b": 1, "kb": 1024, "mb": 1024**2, "gb": 1024**3}
_COUNT = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}
#: the largest model ``--params`` / ``--layers`` take (int64 element counts)
MAX_PARAMS = 2**63 - 1


class OptionError(argparse.ArgumentTypeError, ValueError):
    """A bad option value. argparse reports it as ``argument --option: <message>``; callers of
    the ``parse_*`` functions outside argparse can catch it as a ValueError."""


def _finite(value: float, text: str, expected: str) -> float:
    if not math.isfinite(value):
        raise OptionError(f"{text!r}: too large; expected e.g. {expected}")
    return value


def parse_bandwidth(text: str) -> float:
    """Bytes/s from ``<number>[k|m|g|t]bit`` (tc's units, powers of 1000)."""
    expected = "1gbit, 10gbit, 100mbit"
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgt]?)bit", text.strip().lower())
    if not match or float(match[1]) <= 0:
        raise OptionError(f"{text!r}: expected a bandwidth > 0, e.g. {expected}")
    return _finite(float(match[1]) * _SI[match[2]] / 8, text, expected)


def parse_duration(text: str) -> float:
    """Seconds from ``<number>(s|ms|us|ns)``."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(s|ms|us|ns)", text.strip().lower())
    if not match:
        raise OptionError(f"{text!r}: expected a duration with its unit, e.g. 25us, 0.1ms, 0s")
    return _finite(float(match[1]) * _SECONDS[match[2]], text, "25us")


def parse_size(text: str) -> float:
    """Bytes from ``<number>[b|kb|mb|gb]`` (tc's units, powers of 1024)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(b|kb|mb|gb)?", text.strip().lower())
    if not match:
        raise OptionError(f"{text!r}: expected a size, e.g. 512kb, 0")
    return _finite(float(match[1]) * _BYTES[match[2] or "b"], text, "512kb")


def parse_count(text: str) -> int:
    """A whole number >= 1 from ``<number>[k|M|G]`` (powers of 1000)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)", text.strip().lower())
    if not match:
        raise OptionError(f"{text!r}: expected a count, e.g. 25M, 1.5G, 300000")
    count = decimal.Decimal(match[1]) * _COUNT[match[2]]
    if count != count.to_integral_value() or not 1 <= count <= MAX_PARAMS:
        raise OptionError(f"{text!r}: expected a whole number from 1 to 2^63 - 1, e.g. 25M")
    return int(count)


def overhead_items(text: str) -> list[tuple[str, float, str]]:
    """``(method, ms, item)`` of each ``METHOD=MS`` in a comma list (at least one)."""
    expected = "expected METHOD=MS[,METHOD=MS...], MS >= 0 (milliseconds), e.g. topk=8,qsgd=20"
    items = []
    for item in filter(None, (i.strip() for i in text.split(","))):
        name, sep, value = (s.strip() for s in item.partition("="))
        try:
            ms = check_number("MS", float(value), low=0)
        except ValueError:
            ms = None
        if not name or not sep or ms is None:
            where = "" if item == text.strip() else f" in {text!r}"
            raise OptionError(f"{item!r}{where}: {expected}")
        items.append((name, ms, item))
    if not items:
        raise OptionError(f"{text!r}: {expected}")
    return items


def merge_overheads(groups: Sequence[list[tuple[str, float, str]]]) -> dict[str, float]:
    """``{method: seconds}``; a method given twice (in one list or across lists) is an error."""
    out: dict[str, float] = {}
    first: dict[str, str] = {}
    for name, ms, item in (entry for group in groups for entry in group):
        if name in first:
            raise OptionError(f"{name!r} given twice ({first[name]!r}, then {item!r})")
        first[name], out[name] = item, ms / 1e3
    return out


def parse_overheads(text: str) -> dict[str, float]:
    """``{"topk": 0.008, ...}`` seconds from ``topk=8,qsgd=20`` (ms)."""
    return merge_overheads([overhead_items(text)])


def number(minimum: float = 0.0, inclusive: bool = True, maximum: float = math.inf):
    """An argparse type: a finite float ``>= minimum`` (``>`` if not inclusive),
    ``<= maximum``; the error quotes the text given."""
    high = None if maximum == math.inf else maximum

    def parse(text: str) -> float:
        try:
            return check_number("value", float(text), minimum, high, low_open=not inclusive)
        except ValueError:
            relation = ">=" if inclusive else ">"
            bound = f" and <= {maximum:g}" if high is not None else ""
            raise OptionError(
                f"expected a finite number {relation} {minimum:g}{bound}; got {text!r}"
            ) from None

    return parse


def integer(minimum: int = 1, maximum: int | None = None, note: str = ""):
    """An argparse type: an integer in ``[minimum, maximum]``; the error quotes the text given."""

    def parse(text: str) -> int:
        try:
            return check_int("value", int(text), minimum, maximum)
        except ValueError:
            bound = f" and <= {maximum}" if maximum is not None else ""
            raise OptionError(
                f"expected an integer >= {minimum}{bound}{note}; got {text!r}"
            ) from None

    return parse
