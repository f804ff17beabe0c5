"""A finished job's event log in compact form, rebuilt byte for byte for a late reader.

While a job runs its events are a Redis stream, one entry per event (``EventWriter.flush``). Once it
has ended nothing is appended any more, and a reader only ever wants the same events again (a
resume from ``Last-Event-ID``, a late ``/events`` read). The per-token stream costs ~180 bytes
per token for an hour (``LLMQ_RESULT_TTL_S``), several times the job's result; so the worker that
ends the job replaces it, in the same script that writes the end (flush.lua), by one string
value made here.

The bulk of a job's events (token ids, text, logprobs) is already in its result: the result is
their concatenation per choice. So the compact form keeps only the *shape* of the events: each
event with its bulk values replaced by their lengths, deduplicated into templates (a 500-token
job has a handful of distinct event skeletons), plus the lengths as columns. :func:`expand`
cuts the result's lists back into those lengths. :func:`compact` rebuilds the events at once and
compares the bytes; anything the shape cannot reproduce exactly (an unusual event, a result
that is not the events' concatenation) is stored as the compressed events themselves. So the
rebuilt bytes always equal the original bytes, whatever the events were.

Pure functions over bytes: ``events`` is the msgspec JSON array of the job's events, which is
``[`` + the events' own bytes joined by ``,`` + ``]``; those bytes are what the live channel
and the stream carried.
"""

from __future__ import annotations

import zlib
from typing import Any

import msgspec

__all__ = ["compact", "expand", "needs_result", "SHAPE", "SHAPE_WITH_BASE", "PACKED", "PLAIN", "SHAPE_V0"]

SHAPE = b"D"
"""Rebuilt from the job's stored result (the record's ``result`` field) and the shape, deflated
with :data:`_DICTIONARY`. The forms that need the record (this and :data:`SHAPE_V0`):
shared/lua/read_log.lua fetches the result for their first byte."""
SHAPE_WITH_BASE = b"B"
"""Rebuilt from the shape and its own copy of the concatenated bulk (a job ended by an error
has no stored result)."""
PACKED = b"Z"
"""The events' bytes, deflated: the fallback, always exact."""
PLAIN = b"J"
"""The events' bytes as they are: for a log so small that deflate would not shrink it."""
SHAPE_V0 = b"S"
"""As :data:`SHAPE`, deflated without a dictionary: what workers wrote before it had one; still
read (a log lives LLMQ_RESULT_TTL_S), never written."""

# Deflate's preset dictionary for the shapes of jobs that ended with a result: the bytes most of
# them hold (the usual templates, the template order and lengths of a job of one token per event),
# which deflate then refers to instead of spelling out. It halves a 64-token job's log (~180 -> ~65 bytes), and a
# finished job keeps that log for LLMQ_RESULT_TTL_S. Logs written with it are inflated with it:
# never change these bytes; a better dictionary is a new kind.
_DICTIONARY = (
    b'"finish_reason":"stop","stop_reason":null,"logprobs":0,"top_logprobs":0,"token_texts":0,"prompt":0,'
    b'"index":1,"token_ids":0,"text":0}]},'
    b'{"type":"tokens","seq":0,"deltas":[{"token_ids":0}]},'
    b'{"token_ids":[' + b"1," * 64 + b'1],"text":[' + b"1," * 64 + b'1]}'
    b'],[' + b"0," * 64 + b'1],'
    b'[1,[{"type":"tokens","seq":0,"deltas":[{"token_ids":0,"text":0}]},'
    b'{"type":"done","seq":0,"deltas":[{"token_ids":0,"text":0,"finish_reason":"length"}],"usage":0,'
    b'"timings":{"queued_at":17'
)

# Event fields whose values the result concatenates, per choice, in event order.
_BULK = ("token_ids", "text", "token_texts", "logprobs", "top_logprobs")
_decode = msgspec.json.decode
_encode = msgspec.json.Encoder().encode


def _deflate(data: bytes, dictionary: bytes = b"") -> bytes:
    # Raw deflate: no zlib header or checksum to store. As in _inflate, zdict only when there is one.
    if not dictionary:
        c = zlib.compressobj(9, zlib.DEFLATED, -15)
    else:
        c = zlib.compressobj(9, zlib.DEFLATED, -15, zdict=dictionary)
    return c.compress(data) + c.flush()


def _inflate(data: bytes, dictionary: bytes = b"") -> bytes:
    if not dictionary:
        return zlib.decompress(data, -15)
    d = zlib.decompressobj(-15, zdict=dictionary)
    return d.decompress(data) + d.flush()


def needs_result(blob: bytes) -> bool:
    """Whether :func:`expand` needs the job's stored result for this compact log."""
    return blob[:1] in (SHAPE, SHAPE_V0)


def _fold(events: list[Any]) -> dict[str, Any]:
    """The bulk of ``events`` concatenated per choice, in the result's shape."""
    choices: dict[int, dict[str, Any]] = {}
    for event in events:
        for delta in event.get("deltas") or ():
            index = delta.get("index", 0)
            choice = choices.setdefault(index, {"index": index})
            for key in _BULK:
                value = delta.get(key)
                if isinstance(value, str):
                    choice.setdefault(key, []).append(value)  # joined below: no quadratic +=
                elif isinstance(value, list):
                    choice.setdefault(key, []).extend(value)
    for choice in choices.values():
        if "text" in choice:
            choice["text"] = "".join(choice["text"])
    prompts = [e["prompt"] for e in events if isinstance(e.get("prompt"), dict)]
    return {"choices": list(choices.values()), "prompt": prompts[-1] if prompts else None}


def _shape(events: list[Any], base: dict[str, Any]) -> list[Any]:
    """[first seq, templates, template per event, {bulk field: lengths in order}]. A template is
    an event whose bulk values, seq, and prompt / usage / pooled equal to the base's are placeholders:
    ints, where the values they stand for are lists, strings or objects, never ints (hence the
    exact ``type(v) is int`` checks: ``bool`` is an int subclass). Turns
    ``events`` (decoded for this call only) into the skeletons in place: no copies per token."""
    templates: dict[bytes, int] = {}
    skeletons: list[Any] = []
    order: list[int] = []
    lengths: dict[str, list[int]] = {key: [] for key in _BULK}
    prompt, usage, pooled = base.get("prompt"), base.get("usage"), base.get("pooled")
    first = events[0].get("seq", 0) if events else 0
    for skeleton in events:
        if "seq" in skeleton:
            skeleton["seq"] = 0
        deltas = skeleton.get("deltas")
        if isinstance(deltas, list):
            for delta in deltas:
                for key, value in delta.items():
                    if key in lengths and isinstance(value, (list, str)):
                        lengths[key].append(len(value))
                        delta[key] = 0  # same key, so the key order (and the bytes) survive
        if prompt is not None and skeleton.get("prompt") == prompt:
            skeleton["prompt"] = 0
        if usage is not None and skeleton.get("type") == "done" and skeleton.get("usage") == usage:
            skeleton["usage"] = 0
        # A pooling job's outputs: its result holds them, so its log does not again.
        if pooled is not None and skeleton.get("type") == "done" and skeleton.get("pooled") == pooled:
            skeleton["pooled"] = 0
        key = _encode(skeleton)
        t = templates.get(key)
        if t is None:
            t = templates[key] = len(skeletons)
            skeletons.append(skeleton)
        order.append(t)
    return [first, skeletons, order, {k: v for k, v in lengths.items() if v}]


def _plan(skeleton: Any) -> list[tuple[int, str, int]]:
    """Where a template's bulk placeholders are: (delta position, field, choice index), in the
    order :func:`_shape` took their lengths (worked out once per template, not per event)."""
    plan = []
    deltas = skeleton.get("deltas")
    if isinstance(deltas, list):
        for position, delta in enumerate(deltas):
            for key, value in delta.items():
                if type(value) is int and key in _BULK:
                    plan.append((position, key, delta.get("index", 0)))
    return plan


def _rebuild(shape: list[Any], base: dict[str, Any]) -> list[Any]:
    first, skeletons, order, lengths = shape
    choices = {c.get("index", 0): c for c in base.get("choices") or ()}
    columns = {key: iter(values) for key, values in lengths.items()}
    plans = [_plan(skeleton) for skeleton in skeletons]
    sources: dict[tuple[int, str], Any] = {}
    at: dict[tuple[int, str], int] = {}
    for plan in plans:
        for _, key, index in plan:
            source = choices.get(index, {}).get(key)
            if source is None:  # the result omits an empty value (omit_defaults)
                source = "" if key == "text" else []
            sources[index, key] = source
            at[index, key] = 0
    prompt, usage = base.get("prompt"), base.get("usage")
    events = []
    for i, t in enumerate(order):
        skeleton = skeletons[t]
        event = dict(skeleton)
        if "seq" in event:
            event["seq"] = first + i
        plan = plans[t]
        if plan:
            deltas = event["deltas"] = [dict(d) for d in skeleton["deltas"]]
            for position, key, index in plan:
                n = next(columns[key])
                where = index, key
                start = at[where]
                deltas[position][key] = sources[where][start:start + n]
                at[where] = start + n
        if type(event.get("prompt")) is int:
            event["prompt"] = prompt
        if type(event.get("usage")) is int and event.get("type") == "done":
            event["usage"] = usage
        if type(event.get("pooled")) is int and event.get("type") == "done":
            event["pooled"] = base.get("pooled")
        events.append(event)
    return events


def compact(events: bytes, result: bytes | None = None) -> bytes:
    """The compact form of a job's whole event log. ``events``: the JSON array of every event
    of the job, in order; ``result``: the job's stored result JSON if it has one (a job that
    ended with ``done``), which the compact form then refers to rather than repeats."""
    plain = PLAIN + events
    try:
        decoded = _decode(events)
        base = _decode(result) if result is not None else _fold(decoded)
        shape = _shape(decoded, base)
        body = _encode(shape if result is not None else [shape, base])
        blob = SHAPE + _deflate(body, _DICTIONARY) if result is not None else SHAPE_WITH_BASE + _deflate(body)
        if expand(blob, result) == events:
            return min(blob, plain, key=len)  # deflating the events too would not beat the shape
    except (msgspec.DecodeError, AttributeError, TypeError, KeyError, StopIteration, IndexError):
        pass  # not events the shape describes: one of the exact forms
    return min(plain, PACKED + _deflate(events), key=len)


def expand(blob: bytes, result: bytes | None = None) -> bytes:
    """The JSON array of the job's events that :func:`compact` was given, byte for byte.
    ``result`` is the job's stored result (needed when :func:`needs_result` says so)."""
    kind, body = blob[:1], blob[1:]
    if kind == PLAIN:
        return body
    if kind == PACKED:
        return _inflate(body)
    if kind in (SHAPE, SHAPE_V0):
        if result is None:
            raise ValueError("this compact log is rebuilt from the job's result, and it has none")
        shape = _decode(_inflate(body, _DICTIONARY if kind == SHAPE else b""))
        return _encode(_rebuild(shape, _decode(result)))
    if kind == SHAPE_WITH_BASE:
        shape, base = _decode(_inflate(body))
        return _encode(_rebuild(shape, base))
    raise ValueError(f"not a compact event log (kind {kind!r})")
