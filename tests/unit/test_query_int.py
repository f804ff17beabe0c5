"""Whole numbers in a query string (api/query.py): ASCII digits in the route's range, or the
route's 400; never a number ``int()`` would read from other digits, and never a 500."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from api.query import query_int
from shared.errors import InvalidRequest


def asked(**query: str):
    return SimpleNamespace(query_params=query)


def test_absent_is_the_default_and_ascii_digits_in_range_are_the_number():
    assert query_int(asked(), "limit", 50, 1, 500) == 50
    assert query_int(asked(limit="7"), "limit", 50, 1, 500) == 7
    assert query_int(asked(limit="500"), "limit", 50, 1, 500) == 500
    assert query_int(asked(limit="007"), "limit", 50, 1, 500) == 7
    assert query_int(asked(limit="0" * 5000 + "1"), "limit", 50, 1, 500) == 1


@pytest.mark.parametrize("raw", [
    "²", "١٢", "１２", "߁", "12²",  # isdigit() is true of each; int() refuses '²', reads '١٢' as 12
    " 12", "12 ", "+12", "-1", "1_2", "1e3", "0x10", "1.0", "",  # int() reads the first four
    "0", "501", "9" * 5000,  # out of range; the last one's int() raises (sys.int_max_str_digits)
])
def test_anything_else_is_the_routes_400_naming_the_parameter(raw: str):
    with pytest.raises(InvalidRequest, match="limit must be a whole number from 1 to 500") as caught:
        query_int(asked(limit=raw), "limit", 50, 1, 500)
    assert caught.value.param == "limit"


@pytest.mark.parametrize(("raw", "value"), [("-1", -1), ("0", 0), ("42", 42), (str(2**63 - 1), 2**63 - 1)])
def test_a_range_below_zero_takes_a_leading_minus(raw: str, value: int):
    assert query_int(asked(starting_after=raw), "starting_after", -1, -1, 2**63 - 1) == value


@pytest.mark.parametrize("raw", ["-2", "--1", "-", "-١", "+1", str(2**63), "١٢"])
def test_a_sequence_number_is_ascii_and_in_range(raw: str):
    with pytest.raises(InvalidRequest):
        query_int(asked(starting_after=raw), "starting_after", -1, -1, 2**63 - 1)
