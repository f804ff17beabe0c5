"""Whole numbers in a query string (``?limit=``, ``?days=``), as every route reads them.

A query integer is ASCII digits and nothing else. ``str.isdigit()`` is also true of '²' and
'١٢', and ``int()`` refuses the first (a 500 after an isdigit check) but takes the second, as it
takes ' 12', '+12' and '1_2'; a long enough string makes it raise as well
(``sys.int_max_str_digits``). None of those is a number a client means: each is the route's own
400, in its dialect's shape.
"""

from __future__ import annotations

from litestar.connection import ASGIConnection

from shared.errors import InvalidRequest

__all__ = ["query_int", "whole_number"]


def query_int(connection: ASGIConnection, name: str, default: int, low: int, high: int) -> int:
    """The query parameter ``name``: ``default`` when absent, else :func:`whole_number`."""
    raw = connection.query_params.get(name)
    return default if raw is None else whole_number(raw, name, low, high)


def whole_number(raw: str, name: str, low: int, high: int, message: str | None = None) -> int:
    """``raw`` as a whole number from ``low`` to ``high`` in ASCII digits (a leading '-' only when
    ``low`` is negative); anything else (empty too) is an InvalidRequest naming ``name``, with
    ``message`` or one that gives the range."""
    negative = low < 0 and raw.startswith("-")
    body = raw[1:] if negative else raw
    digits = body.lstrip("0") or "0"
    # Its length first: the number is in range only if it is no longer than the range's ends, and
    # int() is never asked to read thousands of digits.
    if body.isascii() and body.isdigit() and len(digits) <= len(str(max(abs(low), abs(high)))):
        value = -int(digits) if negative else int(digits)
        if low <= value <= high:
            return value
    raise InvalidRequest(message or f"{name} must be a whole number from {low} to {high}", param=name)
