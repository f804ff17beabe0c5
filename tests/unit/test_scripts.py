"""The Python–Lua contract, without Redis: each script in shared/lua names exactly the KEYS and
ARGV slots its layout in shared/scripts.py lists (same names, same order, same offsets in a
group), each packer fills exactly that layout, the libraries a script calls are the ones it
declares, the key suffixes Lua appends are the ones shared/keys.py builds, and the consumer
group's name travels in ARGV, never as a Lua literal."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

import pytest

from shared import scripts
from shared.keys import GROUP, LEVELS, Keys, shard_of
from shared.scripts import Call, Extra, Script
from shared.tenants import USAGE_FIELDS

MODEL, KEYS = "m", Keys("llmq")

_SLOT = re.compile(r"(?:tonumber\()?(KEYS|ARGV)\[(\w+)(?: \+ (\d+))?\]\)?")
_UNPACK = re.compile(r"unpack\((KEYS|ARGV), (\d+), (\d+)\)")
_NAMES = r"\w+(?:,\s*\w+)*"  # a statement may go on over lines
_NAMING = re.compile(rf"^[ \t]*local ({_NAMES}) = (.+)$", re.MULTILINE)
_NUMBERS = re.compile(rf"^({_NAMES}) = (tonumber\(\w+\)(?:,\s*tonumber\(\w+\))*)$", re.MULTILINE)


def _names(text: str) -> list[str]:
    return re.split(r",\s*", text.strip())


@dataclass
class Named:
    """The slots a script names: fixed ones by index, grouped ones by (base variable, offset);
    and its code without the statements that name them."""

    fixed: dict[str, dict[int, str]] = field(default_factory=lambda: {"KEYS": {}, "ARGV": {}})
    groups: dict[tuple[str, str], dict[int, str]] = field(default_factory=dict)
    rest: str = ""

    def ordered(self, array: str) -> tuple[str, ...]:
        by_index = self.fixed[array]
        assert sorted(by_index) == list(range(1, len(by_index) + 1)), f"{array} slots are not 1..n: {by_index}"
        return tuple(by_index[i] for i in sorted(by_index))

    def group_slots(self, array: str) -> Counter[tuple[str, ...]]:
        found: Counter[tuple[str, ...]] = Counter()
        for (arr, base), by_offset in self.groups.items():
            if arr == array:
                assert sorted(by_offset) == list(range(len(by_offset))), f"{base}'s offsets are not 0..w-1"
                found[tuple(by_offset[i] for i in sorted(by_offset))] += 1
        return found


def lua_code(file: str) -> str:
    """A Lua file without its comments."""
    return "\n".join(line.split("--", 1)[0] for line in scripts._read(file).splitlines())


def named(file: str) -> Named:
    """The statements of a script that name its slots: first, before any code, its fixed slots
    (``local a, b, c = unpack(ARGV, 1, 3)``, or one alone, ``local a = KEYS[1]``); then, anywhere,
    a group's slots by offset (``local job, log = KEYS[k], KEYS[k + 1]``). No slot is read
    anywhere else (what ``rest`` reads by ``unpack(ARGV, ...)``, a tail, is checked on its own);
    a fixed value used as a number is made one in place (``a, b = tonumber(a), tonumber(b)``)."""
    code, out = lua_code(file), Named()
    fixed_end, rest_at, rest = 0, 0, []
    for match in _NAMING.finditer(code):
        names, value = _names(match.group(1)), match.group(2).strip()
        if unpacked := _UNPACK.fullmatch(value):
            array, first, last = unpacked.group(1), int(unpacked.group(2)), int(unpacked.group(3))
            assert last - first + 1 == len(names), f"{file}: {len(names)} names for {value}"
            slots = [(array, str(first + i), None) for i in range(len(names))]
        else:
            values = [v.strip() for v in value.split(", ")]
            found = [_SLOT.fullmatch(v) for v in values]
            if not any(found):
                continue
            assert all(found) and len(names) == len(values), f"{file}: name each slot alone: {match.group(0)}"
            slots = [slot.groups() for slot in found]
        if fixed := slots[0][1].isdigit():
            assert not code[fixed_end:match.start()].strip(), f"{file}: names a slot after code: {match.group(0)}"
            fixed_end = match.end()
        for name, (array, index, offset) in zip(names, slots, strict=True):
            assert index.isdigit() == fixed, f"{file}: fixed and grouped slots together: {match.group(0)}"
            if fixed:
                assert offset is None
                assert int(index) not in out.fixed[array], f"{file}: {array}[{index}] named twice"
                out.fixed[array][int(index)] = name
            else:
                out.groups.setdefault((array, index), {})[int(offset or 0)] = name
        rest.append(code[rest_at:match.start()])
        rest_at = match.end()
    out.rest = "".join(rest) + code[rest_at:]
    assert not re.search(r"\b(?:KEYS|ARGV)\[|unpack\(KEYS\b", out.rest), f"{file} reads a slot it did not name first"
    values = {*out.fixed["KEYS"].values(), *out.fixed["ARGV"].values()}
    for match in _NUMBERS.finditer(out.rest):
        names = _names(match.group(1))
        assert _names(re.sub(r"tonumber\((\w+)\)", r"\1", match.group(2))) == names, f"{file}: {match.group(0)}"
        assert set(names) <= values, f"{file}: {match.group(0)} converts what is not a fixed slot"
    return out


@pytest.mark.parametrize("script", scripts.SCRIPTS, ids=lambda s: s.file)
def test_each_script_names_the_slots_of_its_layout_in_order(script: Script):
    got = named(script.file)
    # A library may name a group's slots for the scripts that call it (Pick.levels: the levels).
    libraries = [named(library.file) for library in scripts._libraries(script.uses)]
    assert got.ordered("KEYS") == script.keys
    assert got.ordered("ARGV") == script.argv
    for array, groups in (("KEYS", script.key_groups), ("ARGV", script.argv_groups)):
        slots = sum((n.group_slots(array) for n in libraries), got.group_slots(array))
        assert slots == Counter(g.slots for g in groups)
    for group in (*script.key_groups, *script.argv_groups):  # where each starts (and how wide it is)
        assert f"{group.name}_at" in script.argv


@pytest.mark.parametrize("library", scripts.LIBRARIES, ids=lambda s: s.file)
def test_a_library_names_no_fixed_slot(library: scripts.Library):
    """Each script has its own fixed layout; only a group (at an index the script passes) can
    mean the same slots in every script that calls the library."""
    assert named(library.file).fixed == {"KEYS": {}, "ARGV": {}}


@pytest.mark.parametrize("script", scripts.SCRIPTS, ids=lambda s: s.file)
def test_a_tail_starts_right_after_the_fixed_values(script: Script):
    starts = {int(n) for n in re.findall(r"unpack\(ARGV, (\d+)", named(script.file).rest)}
    assert starts == ({len(script.argv) + 1} if script.tail else set())


@pytest.mark.parametrize("unit", [*scripts.SCRIPTS, *scripts.LIBRARIES], ids=lambda s: s.file)
def test_each_script_calls_exactly_the_libraries_it_declares(unit):
    tables = {library.table for library in scripts.LIBRARIES}
    called = set(re.findall(r"\b(\w+)\.\w+\(", lua_code(unit.file))) & tables
    assert called - {getattr(unit, "table", None)} == {library.table for library in unit.uses}


@pytest.mark.parametrize("script", [s for s in scripts.SCRIPTS if s.uses], ids=lambda s: s.file)
def test_a_scripts_source_puts_each_library_before_whatever_calls_it(script: Script):
    source = scripts.source(script)
    at = {library: source.index(scripts._read(library.file)) for library in scripts.LIBRARIES
          if scripts._read(library.file) in source}
    mine = source.index(scripts._read(script.file))
    for library in script.uses:
        assert at[library] < mine
    for library, where in at.items():
        assert all(at[used] < where for used in library.uses)


# --- the packers fill their layouts -----------------------------------------------------------

def _layout_of(call: Call, counts: dict[str, int], *, tail: int = 0) -> None:
    """``call`` holds its script's fixed slots, then ``counts[name]`` items of each group, each
    starting where its ``_at`` says and as wide as its ``_width`` says (the values the script
    reads its groups by), then ``tail`` values."""
    script, keys, args = call
    assert len(keys) == len(script.keys) + sum(g.width * counts[g.name] for g in script.key_groups)
    assert len(args) == len(script.argv) + sum(g.width * counts[g.name] for g in script.argv_groups) + tail
    for groups, first in ((script.key_groups, len(script.keys) + 1), (script.argv_groups, len(script.argv) + 1)):
        for group in groups:
            assert args[script.slot(f"{group.name}_at") - 1] == first
            if f"{group.name}_width" in script.argv:
                assert args[script.slot(f"{group.name}_width") - 1] == group.width
            else:
                assert counts[group.name] <= 1, f"{group.name}: more than one item, and no width to stride by"
            first += group.width * counts[group.name]
    if "group" in script.argv:
        assert args[script.slot("group") - 1] == GROUP


def _sample(i: int) -> tuple[int, int, bytes, str, int]:
    return (1, i + 1, b'{"type":"tokens"}', f"j{i}", 0)


def _events(n: int, first: int = 0) -> list:
    """Events as the packer takes them: five values each, flat."""
    return [v for i in range(first, first + n) for v in _sample(i)]


@pytest.mark.parametrize("n", [0, 1, 3])
def test_the_packers_fill_exactly_their_layouts(n: int):
    jobs = [f"j{i}" for i in range(n)]
    pairs = {f"f{i}": i for i in range(n)}
    levels = {"levels": LEVELS}
    _layout_of(scripts.enqueue(KEYS, MODEL, "j", "t", idempotency=None, idempotency_ttl=1, max_depth=1, level=0,
                               weight=1.0, max_running=-1, max_queued=-1, tokens_per_minute=-1, now=1.0,
                               record=[v for p in pairs.items() for v in p]), {**levels, "idempotency": 0}, tail=2 * n)
    _layout_of(scripts.enqueue(KEYS, MODEL, "j", "t", idempotency="k", idempotency_ttl=1, max_depth=1, level=0,
                               weight=1.0, max_running=-1, max_queued=-1, tokens_per_minute=-1, now=1.0, record=[]),
               {**levels, "idempotency": 1})
    _layout_of(scripts.read(KEYS, MODEL, "w", n, now=1.0, max_failed=3), levels)
    _layout_of(scripts.claim_taken(KEYS, MODEL, "w", jobs, now=1.0, max_failed=3), {"jobs": n})
    candidates = [scripts.Candidate(j, b"1-0", 1, 0, 5, 7) for j in jobs]
    _layout_of(scripts.preempt(KEYS, MODEL, "w", candidates, now=1.0, max_failed=3, max_preemptions=3),
               {**levels, "job_keys": n, "jobs": n})
    _layout_of(scripts.renew(KEYS, MODEL, "w", [(j, b"1-0", 1, 0) for j in jobs], idle_ms=0, hand_back=False),
               {"job_keys": n, "jobs": n})
    _layout_of(scripts.expire(KEYS, MODEL, "j", now=1.0, grace_ms=0, at_once=False), {})
    shards = list(range(min(n, 2)))
    flush = scripts.flush(KEYS, MODEL, writer="w", result_ttl=1, shards=shards, events=_events(n),
                          endings=[(i, Extra(status="done")) for i in range(n) if i % 2],
                          prompts=[(i, b"[1,2]") for i in range(n) if not i % 2])
    _layout_of(flush, {"shards": len(shards), "shard_args": len(shards), "event_keys": n, "events": n,
                       "endings": n // 2, "prompts": (n + 1) // 2})
    tokens = [(1, Extra(first_token_at=1.0))] * n
    _layout_of(scripts.finish(KEYS, MODEL, result_ttl=1, now=1.0, day="d", day_ttl=1,
                              items=[(j, 1, extra) for j, (_, extra) in zip(jobs, tokens, strict=True)]),
               {"ending": 0, "levels": 0, "jobs": n, "items": n})
    _layout_of(scripts.finish(KEYS, MODEL, result_ttl=1, now=1.0, day="d", day_ttl=1,
                              items=[(j, 1, Extra(status="done")) for j in [*jobs, "x"]]),
               {"ending": 1, "levels": LEVELS, "jobs": n + 1, "items": n + 1})
    _layout_of(scripts.take(KEYS, MODEL, "w", shards, [(j, 1, "", 0) for j in jobs]),
               {"shards": len(shards), "shard_args": len(shards), "logs": n, "jobs": n})
    _layout_of(scripts.settle(KEYS, MODEL, shards, [(j, 0, True) for j in jobs]),
               {"shards": len(shards), "shard_args": len(shards), "logs": n, "jobs": n})
    _layout_of(scripts.set_if_exists("k", pairs), {}, tail=2 * n)
    _layout_of(scripts.batch_status("b", "done", 1, ["x"], pairs), {}, tail=2 * n)
    create = scripts.batch_create("b", "l", pairs, [b"line"] * n)
    _layout_of(create, {}, tail=3 * n)
    assert create.args[create.script.slot("lines_at") - 1] == len(create.script.argv) + 1 + 2 * n
    for call in (scripts.takeover("q", "d", "w", n), scripts.ack("q", b"1-0"), scripts.cancel("k"),
                 scripts.add_follower(KEYS, MODEL, "j", "c"), scripts.read_log("l", n),
                 scripts.follow(KEYS, MODEL, "j", "c"), scripts.release(KEYS, MODEL, "j", "w", 1),
                 scripts.file_rendered("f", b"", b"")):
        _layout_of(call, {})


def test_a_records_write_sends_the_keys_a_jobs_end_writes_only_with_a_terminal_event():
    """Items of a first token send no meter key, no usage day and no queue; the items that end a
    job send them all."""
    tokens = scripts.finish(KEYS, MODEL, result_ttl=1, now=1.0, day="2026-01-01", day_ttl=1,
                            items=[("j0", 1, Extra(first_token_at=1.0))])
    assert tokens.keys == [KEYS.job(MODEL, "j0")]
    assert not any("2026-01-01" in str(v) for v in tokens.args)
    ending = scripts.finish(KEYS, MODEL, result_ttl=1, now=1.0, day="2026-01-01", day_ttl=1,
                            items=[("j0", 1, Extra(status="failed", field="error", payload=b"{}"))])
    assert {KEYS.usage(MODEL, "2026-01-01"), KEYS.usage(MODEL), KEYS.tokens(MODEL), KEYS.fair_clock(MODEL),
            KEYS.webhooks(MODEL), KEYS.dead(MODEL), *KEYS.queues(MODEL), *KEYS.fairs(MODEL)} <= set(ending.keys)


def test_a_flush_names_only_token_shard_keys():
    """A flush writes nothing in the model's slot: every key it sends is under a token shard's tag."""
    events = [_sample(i) for i in range(4)]
    call = scripts.flush(KEYS, MODEL, writer="w", result_ttl=1, shards=[3], events=_events(4),
                         endings=[(3, Extra(status="done"))])
    assert call.keys == [KEYS.fence(MODEL, 3), *(KEYS.events(MODEL, e[3]) for e in events)]
    assert all(f"{{{MODEL}}}" not in key for key in call.keys)


def test_an_extra_is_the_finish_items_group_after_its_job_and_attempt():
    [items] = scripts.FINISH.argv_groups
    assert ("job_id", "attempt", *Extra._fields) == items.slots
    [_, _, endings, _] = scripts.FLUSH.argv_groups
    record_only = ("first_token_at", "compact")
    assert ("index", *(f for f in Extra._fields if f not in record_only)) == endings.slots


def test_every_packer_is_listed_with_its_script():
    files = {p.name for p in scripts.resources.files("shared").joinpath("lua").iterdir() if p.name.endswith(".lua")}
    assert files == {s.file for s in scripts.SCRIPTS} | {lib.file for lib in scripts.LIBRARIES}


# --- key names: what Lua builds is what shared/keys.py builds ---------------------------------

def test_the_prefixes_a_script_appends_an_id_to_build_the_same_keys_as_keys_py():
    read = scripts.read(KEYS, MODEL, "w", 1, now=1.0, max_failed=3)
    flush = scripts.flush(KEYS, MODEL, writer="w", result_ttl=1, shards=[5], events=[], endings=[])
    finish = scripts.finish(KEYS, MODEL, result_ttl=1, now=1.0, day="d", day_ttl=1, items=[])

    def value(call: Call, name: str) -> str:
        return call.args[call.script.slot(name) - 1]

    for prefix, build in ((value(read, "tenant_prefix"), KEYS.tenant), (value(read, "job_prefix"), KEYS.job),
                          (value(finish, "tenant_prefix"), KEYS.tenant)):
        assert prefix + "x1" == build(MODEL, "x1")
    job = next(j for j in (f"x{i}" for i in range(1000)) if shard_of(j) == 5)
    assert flush.args[flush.script.slot("shard_args_at") - 1] == len(flush.script.argv) + 1
    live_prefix, ending_prefix = flush.args[len(flush.script.argv):len(flush.script.argv) + 2]
    assert live_prefix + job == KEYS.live(MODEL, job) and ending_prefix + job == KEYS.ending(MODEL, job)


def _suffix_functions() -> dict[str, list[str]]:
    """Fair's key builders (tenants.lua): function name -> the suffixes it appends to ``tkey``."""
    code = lua_code("tenants.lua")
    return {name: re.findall(r"tkey \.\. '([^']*)'", body)
            for name, body in re.findall(r"function Fair\.(\w+)\(tkey[^)]*\)\n(.*?)\nend", code, re.DOTALL)
            if "tkey .. '" in body}


def test_the_tenant_key_suffixes_lua_appends_are_keys_py_s():
    tkey = KEYS.tenant(MODEL, "t")
    assert _suffix_functions() == {
        "waiting_list": [KEYS.tenant_waiting(MODEL, "t", 0).removeprefix(tkey),
                         KEYS.tenant_waiting(MODEL, "t", 2).removeprefix(tkey).removesuffix("2")],
        "running": [KEYS.tenant_running(MODEL, "t").removeprefix(tkey)],
        "tokens": [KEYS.tenant_tokens(MODEL, "t").removeprefix(tkey)],
    }


@pytest.mark.parametrize("file", sorted({s.file for s in scripts.SCRIPTS} | {lib.file for lib in scripts.LIBRARIES}))
def test_no_script_builds_a_key_by_a_suffix_outside_fair_s_key_builders(file: str):
    code = lua_code(file)
    if file == "tenants.lua":
        for body in re.findall(r"function Fair\.(?:waiting_list|running|tokens)\(.*?\nend", code, re.DOTALL):
            code = code.replace(body, "")
    suffixes = set(re.findall(r"\.\. '(:[^']*)'", code))
    # What remains are the usage hash's fields, '<tenant>:<field>' (shared/tenants.py reads them).
    assert suffixes <= {f":{name}" for name in USAGE_FIELDS}


@pytest.mark.parametrize("file", sorted({s.file for s in scripts.SCRIPTS} | {lib.file for lib in scripts.LIBRARIES}))
def test_the_consumer_group_is_never_a_lua_literal(file: str):
    code = lua_code(file)
    assert f"'{GROUP}'" not in code and f'"{GROUP}"' not in code
    if re.search(r"'(XACK|XREADGROUP|XCLAIM|XPENDING|XGROUP)'", code):
        if file in {lib.file for lib in scripts.LIBRARIES}:  # from its caller's ARGV, as a parameter
            assert re.search(r"function \w+\.\w+\([^)]*\bgroup\b", code)
        else:
            assert "group" in named(file).fixed["ARGV"].values()
