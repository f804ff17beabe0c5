"""Hypothesis strategies for fuzzing request bodies, shared by the unit and HTTP fuzz tests.

Bodies are built from a dialect's real field names (read from its msgspec Struct, so a new
field is fuzzed without touching the tests) with values that are usually of the right type
and near the edges of the declared ranges, mixed with random keys and junk: huge and negative
ints, extreme floats, the non-JSON literals ``NaN``/``Infinity``/``1e400`` (as raw bytes), and
strings a lenient converter turns into numbers ("inf", "nan", "1e400").

Below the JSON level, :func:`malformed_bodies` and :func:`odd_bodies` mutate the bytes of valid
bodies the way broken clients and hostile ones do: truncated, a byte order mark, invalid UTF-8
spliced into a string, ``NaN``/``Infinity``/``1e999``/``10**30`` for a number, a value wrapped in
deep nesting, a duplicated key, an empty body. Every body from ``malformed_bodies`` must get a
4xx; ``odd_bodies`` may be valid JSON (a huge number, a duplicate key, nesting within the limit).

:func:`draw` takes examples out of a strategy for a test that sends them itself (over HTTP, from
an event loop hypothesis's ``@given`` cannot drive).
"""

from __future__ import annotations

import codecs
import math
import re
from typing import Any, TypeVar

import msgspec
import msgspec.inspect as mi
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.json_input import MAX_DEPTH

__all__ = ["junk", "texts", "typed", "struct_body", "dict_body", "encode_body", "raw_bodies", "single_field_bodies",
           "SPECIAL_NUMBERS", "NUMBER_STRINGS", "FIELD_VALUES", "malformed_bodies", "odd_bodies", "INVALID_UTF8",
           "deep", "draw"]

T = TypeVar("T")


def draw(strategy: st.SearchStrategy[T], n: int) -> list[T]:
    """n examples of ``strategy``, drawn by hypothesis (synchronously, outside any event loop)."""
    out: list[T] = []

    @settings(max_examples=n, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(strategy)
    def collect(body: T) -> None:
        out.append(body)

    collect()
    return out

# Written as-is into the JSON text: a value msgspec cannot produce from a Python float.
SPECIAL_NUMBERS = [msgspec.Raw(x) for x in (b"NaN", b"Infinity", b"-Infinity", b"1e400", b"-1e400", b"1e-400",
                                             b"-0", b"123456789012345678901234567890", b"-9223372036854775809",
                                             b"18446744073709551616", b"1.7976931348623157e308")]
NUMBER_STRINGS = ["inf", "-inf", "nan", "1e400", "-1", "0", "1", "0.5", "2.5", "true", "false", "", " ", "null",
                   "99999999999999999999"]

_INTS = [0, 1, -1, 2, 5, 16, 20, 21, 32, 33, 128, 129, 1023, 2047, 2048, 4096, 2**31 - 1, 2**31, 2**32 - 1, 2**32,
         2**53 + 1, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64 - 1, 2**64, -(2**64), 10**30, -(10**30)]
_FLOATS = [0.0, -0.0, 1e-9, -1e-9, 0.5, 1.0, 1.5, 2.0, 2.0000001, 2.5, 3.0, 100.0, 1e6, -0.5, -1.0, -2.0, -2.0000001,
           -3.0, 1e-300, 5e-324, 1.7976931348623157e308, -1.7976931348623157e308]

# Edge values first: hypothesis draws every branch of a one_of alike, and these find bugs.
ints = st.one_of(st.sampled_from(_INTS), st.integers(-5, 300), st.integers())
floats = st.one_of(st.sampled_from(_FLOATS), st.floats(allow_nan=False, allow_infinity=False))
texts = st.one_of(st.text(max_size=12), st.sampled_from(NUMBER_STRINGS))
scalars = st.one_of(st.none(), st.booleans(), ints, floats, texts, st.sampled_from(SPECIAL_NUMBERS),
                    st.just("x" * 3000), st.just("\x00\ud7ff\U0010ffff"))
junk = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(texts, inner, max_size=4)),
    max_leaves=12,
)


def _edges(lo: float | None, hi: float | None, step: float) -> list[float]:
    out: list[float] = []
    for bound in (lo, hi):
        if bound is not None:
            out += [bound - step, bound, bound + step]
    return out


def _int(t: mi.IntType) -> st.SearchStrategy[int]:
    lo = t.ge if t.ge is not None else (t.gt + 1 if t.gt is not None else None)
    hi = t.le if t.le is not None else (t.lt - 1 if t.lt is not None else None)
    edges = [int(x) for x in _edges(lo, hi, 1)]
    inside = st.integers(lo if lo is not None else -5, hi if hi is not None else max(300, (lo or 0) + 300))
    return st.one_of(st.sampled_from(edges or [0]), inside, inside, ints)


def _float(t: mi.FloatType) -> st.SearchStrategy[float]:
    lo = t.ge if t.ge is not None else t.gt
    hi = t.le if t.le is not None else t.lt
    edges = _edges(lo, hi, 1e-9)
    inside = st.floats(lo if lo is not None else -1e6, hi if hi is not None else 1e6, allow_nan=False)
    return st.one_of(st.sampled_from(edges or [0.0]), inside, inside, floats)


def typed(t: mi.Type, depth: int = 0, *, wild: bool = False) -> st.SearchStrategy[Any]:
    """Values of type ``t`` (edges of its ranges included); ``wild`` mixes in anything at all."""
    if isinstance(t, mi.IntType):
        good: st.SearchStrategy[Any] = _int(t)
    elif isinstance(t, mi.FloatType):
        good = _float(t)
    elif isinstance(t, mi.StrType):
        good = texts if not t.min_length else st.one_of(st.text(min_size=t.min_length, max_size=12), st.just(""))
    elif isinstance(t, mi.BoolType):
        good = st.booleans()
    elif isinstance(t, mi.NoneType):
        good = st.none()
    elif isinstance(t, mi.LiteralType):
        good = st.sampled_from(list(t.values))
    elif isinstance(t, mi.UnionType):
        good = st.one_of(*(typed(x, depth, wild=wild) for x in t.types))
    elif isinstance(t, (mi.ListType, mi.SetType, mi.FrozenSetType, mi.VarTupleType)):
        good = st.lists(typed(t.item_type, depth + 1, wild=wild), max_size=4 if depth < 2 else 1)
    elif isinstance(t, mi.DictType):
        key = texts if isinstance(t.key_type, mi.StrType) else st.one_of(ints, texts).map(str)
        good = st.dictionaries(key, typed(t.value_type, depth + 1, wild=wild), max_size=4)
    elif isinstance(t, mi.StructType):
        good = struct_body(t.cls, depth + 1, wild=wild)
    else:  # Any, Raw, ...
        good = junk
    return st.one_of(good, junk) if wild and depth < 3 else good


def struct_body(cls: type, depth: int = 0, *, wild: bool | None = None) -> st.SearchStrategy[dict[str, Any]]:
    """A JSON object for Struct ``cls``: required fields usually present, optional ones sometimes,
    plus random keys. At the top (``wild=None``) half the bodies are well typed, so the
    translators see many decodable bodies, and half have junk anywhere."""
    if wild is None:
        return st.one_of(struct_body(cls, depth, wild=False), struct_body(cls, depth, wild=True))
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    required = {f.encode_name: typed(f.type, depth, wild=wild) for f in info.fields if f.required}
    optional = {f.encode_name: typed(f.type, depth, wild=wild) for f in info.fields if not f.required}
    body = _some_of(required, optional)
    return st.one_of(
        body,
        body,
        _with_junk_keys(body),
        # Occasionally a required field is dropped.
        body.flatmap(lambda d: st.sampled_from(sorted(d) or [""]).map(lambda k: _without(d, k))),
    )


def _without(d: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k != key}


def _with_junk_keys(body: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    return st.tuples(body, st.dictionaries(texts, junk, min_size=1, max_size=2)).map(lambda x: {**x[1], **x[0]})


def _some_of(required: dict[str, st.SearchStrategy[Any]], optional: dict[str, st.SearchStrategy[Any]]
             ) -> st.SearchStrategy[dict[str, Any]]:
    """The required fields and a few optional ones: with all of them present, some field is
    nearly always out of range and the translators would rarely run."""
    names = sorted(optional)
    chosen = st.lists(st.sampled_from(names), unique=True, max_size=min(5, len(names))) if names else st.just([])
    return chosen.flatmap(lambda keys: st.fixed_dictionaries({**required, **{k: optional[k] for k in keys}}))


def dict_body(fields: dict[str, st.SearchStrategy[Any]], required: dict[str, st.SearchStrategy[Any]] | None = None
              ) -> st.SearchStrategy[dict[str, Any]]:
    """A JSON object for a dialect decoded as a plain dict: a few of ``fields``, maybe junk keys."""
    body = _some_of(required or {}, fields)
    return st.one_of(body, body, _with_junk_keys(body))


def encode_body(value: Any) -> bytes:
    """JSON text of ``value``; non-finite floats (which JSON cannot spell) become literal NaN/Infinity."""
    def fix(v: Any) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            return msgspec.Raw(b"NaN" if math.isnan(v) else (b"Infinity" if v > 0 else b"-Infinity"))
        if isinstance(v, dict):
            return {k: fix(x) for k, x in v.items()}
        if isinstance(v, list):
            return [fix(x) for x in v]
        return v
    return msgspec.json.encode(fix(value))


# Whole bodies that are not even JSON objects (the top level is junk too).
def raw_bodies(objects: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[bytes]:
    return st.one_of(
        objects.map(encode_body),
        objects.map(encode_body),
        objects.map(encode_body),
        junk.map(encode_body),
        st.binary(max_size=40),
        objects.map(encode_body).map(lambda b: b[: len(b) // 2]),  # truncated JSON
        malformed_bodies(objects),
        odd_bodies(objects),
    )


# One field at a time: every value here, in every field of a valid body (see ``single_field_bodies``).
FIELD_VALUES: list[Any] = [
    *_INTS, *_FLOATS, *NUMBER_STRINGS, *SPECIAL_NUMBERS, None, True, False, "", "a", "x" * 3000,
    [], {}, [1, 2], ["a"], [""], [-1], [2**64], [[1]], [[]], [["a"]], [None],
    {"a": 1}, {"1": 1.7976931348623157e308}, {"1": "inf"}, {"-1": -100.0}, {"99999999999999999999": 1.0},
    {"type": "json", "value": {"properties": {}}}, {"type": "regex", "value": "("}, {"type": "json_object"},
    {"type": "json_schema", "json_schema": {"name": "x"}}, {"type": "text"}, {"json": "{}"}, {"json": "[1]"},
    {"regex": "a"}, {"choice": []}, {"grammar": ""}, {"include_usage": True, "continuous_usage_stats": True},
    [{"role": "user", "content": "hi"}], [{"role": "user", "content": [{"type": "text", "text": "a"}]}],
    [{"role": "user"}], [{"type": "image"}],
]


def single_field_bodies(base: dict[str, Any], paths: list[str]) -> list[tuple[str, Any, bytes]]:
    """``base`` with one field (a dotted path) set to each of FIELD_VALUES: (path, value, JSON)."""
    out = []
    for path in paths:
        *parents, last = path.split(".")
        for value in FIELD_VALUES:
            body = msgspec.json.decode(msgspec.json.encode(base))
            node = body
            for key in parents:
                child = node.get(key)
                node = node.setdefault(key, {}) if isinstance(child, dict) or child is None else {}
            node[last] = value
            out.append((path, value, encode_body(body)))
    return out


# --- raw bytes: mutations of valid bodies -----------------------------------------------------

INVALID_UTF8 = [b"\xff", b"\xfe\xff", b"\x80", b"\xc0\xaf", b"\xc3\x28", b"\xe2\x82", b"\xed\xa0\x80",
                b"\xf4\x90\x80\x80", b"\xf8\x88\x80\x80\x80"]
"""A stray continuation byte, an overlong "/", a truncated sequence, an encoded surrogate, a code
point past U+10FFFF, a five-byte form: each is invalid UTF-8 wherever it stands."""

# A string (skipped) or a number outside any string (group 1): where a number may be replaced.
_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|(-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)')
_FIRST_KEY = re.compile(rb'^\{"((?:[^"\\]|\\.)*)"\s*:')
_NOT_JSON_NUMBERS = [b"NaN", b"Infinity", b"-Infinity", b"+1", b"01", b"1.", b".5", b"0x10", b"1e", b"--1"]
_ODD_NUMBERS = [b"1e999", b"-1e999", b"1e-999", b"10" + b"0" * 29, b"-" + b"9" * 30, b"18446744073709551616",
                b"-9223372036854775809", b"-0", b"0.0000000000000000000000001", b"9" * 4000]


def deep(inner: bytes, levels: int, *, objects: bool = False) -> bytes:
    """``inner`` wrapped in ``levels`` arrays (or ``{"a": ...}`` objects)."""
    if objects:
        return b'{"a":' * levels + inner + b"}" * levels
    return b"[" * levels + inner + b"]" * levels


def _numbers(body: bytes) -> list[tuple[int, int]]:
    return [m.span(1) for m in _TOKENS.finditer(body) if m.group(1) is not None]


def _replace_number(body: bytes, which: int, new: bytes) -> bytes:
    spans = _numbers(body)
    if not spans:  # nothing to replace: append it as a new key's value instead
        return body[:-1] + b', "n": ' + new + b"}" if body.endswith(b"}") and len(body) > 2 else b"[" + new + b"]"
    a, b = spans[which % len(spans)]
    return body[:a] + new + body[b:]


def _splice_utf8(body: bytes, where: int, bad: bytes) -> bytes:
    """Invalid bytes just inside a string's opening quote (anywhere, if there is no string)."""
    quotes = [m.start() for m in re.finditer(rb'"', body)]
    at = quotes[where % len(quotes)] + 1 if quotes else where % (len(body) + 1)
    return body[:at] + bad + body[at:]


def _duplicate_key(body: bytes, value: bytes, last: bool) -> bytes:
    m = _FIRST_KEY.match(body)
    if m is None:
        return body
    pair = b'"' + m.group(1) + b'": ' + value
    return body[:-1] + b", " + pair + b"}" if last else b"{" + pair + b", " + body[1:]


def malformed_bodies(objects: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[bytes]:
    """Bodies no route may accept: every one must be answered with the route's 4xx."""
    encoded = objects.map(encode_body)
    return st.one_of(
        st.sampled_from([b"", b" ", b"\r\n\t ", b"\x00", codecs.BOM_UTF8]),
        # Truncated anywhere before the closing brace: an object is not complete until then.
        encoded.flatmap(lambda b: st.integers(0, len(b) - 1).map(lambda i: b[:i])),
        encoded.map(lambda b: codecs.BOM_UTF8 + b),
        encoded.map(lambda b: codecs.BOM_UTF16_LE + b.decode().encode("utf-16-le")),
        st.tuples(encoded, st.integers(0, 50), st.sampled_from(INVALID_UTF8)).map(lambda t: _splice_utf8(*t)),
        st.tuples(encoded, st.integers(0, 50), st.sampled_from(_NOT_JSON_NUMBERS)).map(lambda t: _replace_number(*t)),
        # Past the depth limit, around the whole body or one of its numbers, as arrays or objects.
        st.tuples(encoded, st.sampled_from([MAX_DEPTH + 1, 1000, 100_000]), st.booleans())
        .map(lambda t: deep(t[0], t[1], objects=t[2])),
        st.tuples(encoded, st.integers(0, 50), st.sampled_from([MAX_DEPTH, 1000]), st.booleans())
        .map(lambda t: _replace_number(t[0], t[1], deep(b"1", t[2], objects=t[3]))),
        st.sampled_from([b"[" * 100_000, b'{"a":' * 100_000, b'{"a":[' * 50_000]),
    )


def odd_bodies(objects: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[bytes]:
    """Bodies that may be valid JSON, at its edges: each must get an answer below 500."""
    encoded = objects.map(encode_body)
    return st.one_of(
        st.binary(max_size=64),
        st.tuples(encoded, st.integers(0, 50), st.sampled_from(_ODD_NUMBERS)).map(lambda t: _replace_number(*t)),
        st.tuples(encoded, st.sampled_from([b"null", b"0", b'"x"', b"[]", b"{}", b"-1", b"1e999"]), st.booleans())
        .map(lambda t: _duplicate_key(*t)),
        # Within the depth limit (for a body that is one object, MAX_DEPTH - 1 wrappers reach it).
        st.tuples(encoded, st.integers(0, 50), st.integers(1, MAX_DEPTH - 2), st.booleans())
        .map(lambda t: _replace_number(t[0], t[1], deep(b"1", t[2], objects=t[3]))),
        encoded.map(lambda b: b" \n" + b + b"\n "),
    )
