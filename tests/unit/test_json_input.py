"""shared/json_input.py: every malformed input is a msgspec.DecodeError (never a
UnicodeDecodeError or RecursionError), and the depth limit is exact."""

from __future__ import annotations

import codecs
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared import json_input
from shared.json_input import MAX_DEPTH, decode, decoder_for, loads, nesting_depth
from tests.support.fuzzing import deep


class Body(msgspec.Struct):
    prompt: str
    extra: Any = None


def _depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


# Strings full of brackets, quotes and escapes: they must not count.
_tricky = st.text(alphabet='[]{}"\\ab\u00e9\U0001f600', max_size=8)
_json = st.recursive(st.one_of(st.none(), st.integers(), st.floats(allow_nan=False, allow_infinity=False), _tricky),
                     lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(_tricky, inner, max_size=3)),
                     max_leaves=30)


@settings(max_examples=300, deadline=None)
@given(_json)
def test_nesting_depth_is_the_depth_of_the_value(value):
    assert nesting_depth(msgspec.json.encode(value)) == _depth(value)


def _nested(levels: int, objects: bool = False) -> Any:
    """What ``deep(b"1", levels, objects=objects)`` decodes to."""
    value: Any = 1
    for _ in range(levels):
        value = {"a": value} if objects else [value]
    return value


def test_the_limit_is_exact():
    # At the limit: decoded whole, to the innermost value.
    assert decode(deep(b"1", MAX_DEPTH), decoder_for(Any)) == _nested(MAX_DEPTH)
    assert decode(deep(b"1", MAX_DEPTH, objects=True), decoder_for(Any)) == _nested(MAX_DEPTH, objects=True)
    for body in (deep(b"1", MAX_DEPTH + 1), deep(b"1", MAX_DEPTH + 1, objects=True),
                 b'{"prompt": "x", "extra": ' + deep(b"{}", MAX_DEPTH) + b"}"):
        with pytest.raises(msgspec.DecodeError, match=f"nested deeper than {MAX_DEPTH} levels"):
            decode(body, decoder_for(Any))
    # Brackets inside strings are text: a flat body with many of them is fine.
    assert decode(b'{"prompt": "' + b"[{" * 1000 + b'"}', json_input.decoder_for(Body)).prompt == "[{" * 1000


@pytest.mark.parametrize("body,says", [
    (b"", "empty input"),
    (b" \n\t", "empty input"),
    (codecs.BOM_UTF8 + b'{"prompt": "x"}', "byte order mark"),
    (b'{"prompt": "\xff"}', "invalid UTF-8 (byte 0xff at offset 12"),
    (b'{"prompt": "x", "ignored": "\xc0\xaf"}', "invalid UTF-8"),
    (b'{"prompt": "\xed\xa0\x80"}', "invalid UTF-8"),
    (b'{"prompt": "x", "extra": NaN}', "malformed"),
    (b"[" * 100_000, None),
    (b'{"a":' * 100_000, f"nested deeper than {MAX_DEPTH} levels"),
    (b'{"prompt": "x"', "truncated"),
])
def test_malformed_input_is_a_decode_error(body, says):
    with pytest.raises(msgspec.DecodeError) as info:
        decode(body, decoder_for(Body))
    if says is not None:
        assert says in str(info.value)


def test_a_schema_mismatch_stays_a_validation_error():
    with pytest.raises(msgspec.ValidationError):
        decode(b'{"prompt": 1e999}', decoder_for(Body))
    with pytest.raises(msgspec.ValidationError):
        decode(b"[]", decoder_for(Body))


def test_duplicate_keys_keep_the_last():
    assert decode(b'{"prompt": "a", "prompt": "b"}', decoder_for(Body)).prompt == "b"


def test_loads_is_json_loads_without_its_leniencies():
    assert loads('{"a": [1, 2.5, "\u00e9"]}') == {"a": [1, 2.5, "\u00e9"]}
    for text in ('{"a": NaN}', '"\\ud800"', "\ufeff{}", "\ud800", "", deep(b"1", MAX_DEPTH + 1).decode()):
        with pytest.raises(ValueError):
            loads(text)


def test_a_request_body_decodes_without_http_and_every_failure_is_invalid_request():
    """api.body.decode is what a route's decode_body does with the bytes it read."""
    from api.body import decode as decode_request
    from shared.errors import InvalidRequest

    assert decode_request(Body, b'{"prompt": "hi"}') == Body(prompt="hi")
    with pytest.raises(InvalidRequest, match="^Invalid request body: Expected `str`"):
        decode_request(Body, b'{"prompt": 1}')
    for malformed in (b"", b"{", codecs.BOM_UTF8 + b"{}", b'"\xff"'):
        with pytest.raises(InvalidRequest, match="^Malformed JSON body: "):
            decode_request(Body, malformed)
