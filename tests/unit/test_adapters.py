"""LoRA adapters: where a source may come from (roots, a key's subdirectory, links, the hub), what
registration reads of it, names, caps, who sees and owns an entry, the worker's second check, and
the tiny model's adapters. Over HTTP on real Redis: tests/integration/test_adapters.py."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import msgspec
import pytest

from api.auth import Viewer
from shared.adapters import REFUSED, Adapter, Sources, check_name, read_rank, room_for
from shared.config import load_settings
from shared.errors import InvalidRequest
from shared.schemas import AdapterSpec, GenerationRequest
from shared.tenants import key_hash
from workers.tiny_model import build_tiny_adapter, ensure_tiny_adapter

OWNER = key_hash("key-of-a")


def fake_adapter(path: Path, rank: int = 8, **config: object) -> Path:
    """What registration reads of an adapter: its config (and a weights file beside it)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, **config}))
    (path / "adapter_model.safetensors").write_bytes(b"")
    return path


@pytest.fixture
def roots(tmp_path: Path) -> Path:
    return (tmp_path / "roots").resolve()


@pytest.fixture
def sources(roots: Path) -> Sources:
    (roots / "a").mkdir(parents=True)
    return Sources((roots / "a",), hub=("good-org", "other/one-repo"))


def refused(sources: Sources, source: str, owner: str | None = None) -> str:
    """What registration answers ``source`` (placed, then its config read)."""
    with pytest.raises(InvalidRequest) as info:
        sources.checked(source, 16, owner=owner)
    assert info.value.param == "lora_path"
    return info.value.message


def test_a_directory_under_a_root_is_kept_as_its_resolved_path(sources, roots):
    adapter = fake_adapter(roots / "a" / "sql")
    assert sources.place(str(adapter)) == str(adapter)
    # Written another way, it is the same directory: resolved, so the workers get one path.
    assert sources.place(f"{roots}/a/sql/../sql/") == str(adapter)
    os.symlink(adapter, roots / "a" / "alias")
    assert sources.place(str(roots / "a" / "alias")) == str(adapter)  # a link within the root: its target
    assert sources.checked(str(adapter), 16) == (str(adapter), 8)


def test_every_refused_source_gets_the_same_words(sources, roots, tmp_path):
    """No oracle: whatever is wrong (outside the roots, missing, a file, unreadable, no config, a
    link out, a hub name not listed), the answer names nothing of the file system."""
    outside = fake_adapter(tmp_path / "outside")
    fake_adapter(roots / "ab" / "sql")  # a sibling whose name starts with the root's
    inside = roots / "a"
    os.symlink(outside, inside / "link-out")  # a link out of the root
    linked_file = fake_adapter(inside / "leaky")
    os.symlink("/etc/passwd", linked_file / "adapter_model.safetensors.bak")  # a file in it linking out
    (inside / "no-config").mkdir()
    (inside / "a-file").write_text("{}")
    os.symlink(inside / "loop", inside / "loop")
    (inside / "piped").mkdir()
    os.mkfifo(inside / "piped" / "adapter_config.json")  # read as a file, it would block forever
    for source in ["/etc", "/root", "/etc/passwd", "/no/such/path", str(outside), str(roots / "ab" / "sql"),
                   str(roots), f"{inside}/../ab/sql", str(inside / "link-out"), str(linked_file),
                   str(inside / "no-config"), str(inside / "a-file"), str(inside / "loop"), str(inside / "missing"),
                   str(inside / "piped"),
                   "~nobody-here/x", "./relative", "a\x00b", "/" + "x" * 5000, "evil-org/lora",
                   "good-org/../x", "good-org/a--b", "http://169.254.169.254/latest", "lonely-name", "other/repo"]:
        assert refused(sources, source) == REFUSED, source


def test_read_errors_inside_a_root_name_no_path(sources, roots):
    too_big = fake_adapter(roots / "a" / "big", rank=16)
    assert sources.place(str(too_big)) == str(too_big)
    with pytest.raises(InvalidRequest) as info:
        sources.checked(str(too_big), 8)
    assert info.value.message == "The adapter has rank 16, above this deployment's limit of 8 (LLMQ_MAX_LORA_RANK)"
    prefix = fake_adapter(roots / "a" / "prefix", peft_type="PREFIX_TUNING")
    with pytest.raises(InvalidRequest) as info:
        read_rank(str(prefix), 16)
    assert info.value.message == "The adapter is not a LoRA adapter (peft_type 'PREFIX_TUNING', r 8)"
    (prefix / "adapter_config.json").write_text("{not json")
    with pytest.raises(InvalidRequest) as info:
        read_rank(str(prefix), 16)
    assert info.value.message == "The adapter's adapter_config.json is not a LoRA config"
    (prefix / "adapter_config.json").write_bytes(b" " * (1 << 20) + b"{}")  # read no further than 1 MiB
    with pytest.raises(InvalidRequest) as info:
        read_rank(str(prefix), 16)
    assert info.value.message == "The adapter's adapter_config.json is not a LoRA config"
    with pytest.raises(InvalidRequest) as info:
        sources.checked(str(roots / "a"), 16)  # the root itself: a directory, but no adapter in it
    assert info.value.message == REFUSED


def test_a_tenants_key_names_files_under_its_own_subdirectory_only(sources, roots):
    mine = fake_adapter(roots / "a" / OWNER / "sql")
    theirs = fake_adapter(roots / "a" / key_hash("key-of-b") / "sql")
    shared = fake_adapter(roots / "a" / "operators-sql")
    assert sources.place(str(mine), owner=OWNER) == str(mine)
    for source in (str(theirs), str(shared), f"{roots}/a/{OWNER}/../operators-sql"):
        assert refused(sources, source, owner=OWNER) == REFUSED
    os.symlink(theirs, roots / "a" / OWNER / "borrowed")  # a link from its own into another's
    assert refused(sources, str(roots / "a" / OWNER / "borrowed"), owner=OWNER) == REFUSED
    assert refused(sources, str(mine), owner="../a") == REFUSED  # only a key's hash names a subdirectory
    assert sources.place(str(theirs)) == str(theirs)  # an operator's registration: any root


def test_hub_sources_are_the_listed_organisations_and_repositories(sources, tmp_path, monkeypatch):
    assert sources.place("good-org/any-lora") == "good-org/any-lora"
    assert sources.place("Good-Org/Any-Lora") == "Good-Org/Any-Lora"  # the hub ignores case
    assert sources.place("other/one-repo") == "other/one-repo"
    assert refused(sources, "other/another-repo") == REFUSED
    assert refused(Sources(sources.roots), "good-org/any-lora") == REFUSED  # none listed: no hub at all
    # vLLM loads a relative path that exists where it runs, not the hub's repository.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "good-org" / "local").mkdir(parents=True)
    assert refused(sources, "good-org/local") == REFUSED


def test_a_worker_loads_only_a_source_still_placed_as_registered(sources, roots, tmp_path):
    adapter = fake_adapter(roots / "a" / "sql")
    assert sources.holds(str(adapter)) and sources.holds("good-org/x")
    # Swapped for a link since its registration: the path now resolves elsewhere.
    adapter.rename(roots / "a" / "moved")
    os.symlink(roots / "a" / "moved", adapter)
    assert not sources.holds(str(adapter))
    assert not sources.holds(str(fake_adapter(tmp_path / "elsewhere")))  # a job from before the roots
    assert not sources.holds("evil-org/x") and not sources.holds("relative/../x")


def test_the_default_root_is_the_model_cache_where_make_run_builds_its_adapters(tmp_path):
    settings = load_settings({}, cache_dir=str(tmp_path))
    for path in settings.tiny_adapter_dirs.values():
        fake_adapter(path)
        assert Sources.of(settings).place(str(path)) == str(path.resolve())


def test_an_engine_refuses_a_source_outside_the_roots_before_add_lora(sources, roots, tmp_path):
    from workers.adapters import EngineAdapters

    class Engine:
        loaded: list[str] = []

        async def add_lora(self, lora) -> bool:
            self.loaded.append(lora.lora_path)
            return True

        async def list_loras(self) -> set[int]:
            return {1}

    engine = Engine()
    adapters = EngineAdapters(engine, 2, sources)  # type: ignore[arg-type]
    outside = str(fake_adapter(tmp_path / "outside"))
    with pytest.raises(InvalidRequest) as info:
        asyncio.run(adapters.request(AdapterSpec(name="x", source=outside)))
    assert info.value.message == ("The LoRA adapter 'x' could not be loaded: its source is not one this deployment "
                                  "allows (LLMQ_ADAPTER_ROOTS, LLMQ_ADAPTER_HUB_ALLOW)")
    inside = str(fake_adapter(roots / "a" / "ok"))
    asyncio.run(adapters.request(AdapterSpec(name="ok", source=inside)))
    assert engine.loaded == [inside]


def test_names_are_a_short_plain_charset_and_never_a_base_models():
    for name in ("sql", "org/sql-v1.2_b", "a" * 128, "."):
        check_name(name, ("tiny",))
    for name in ("a" * 129, "", "has space", "tab\t", "é", "a:b", "a\x00"):
        with pytest.raises(InvalidRequest) as info:
            check_name(name, ("tiny",))
        assert info.value.message == "'lora_name' must be 1-128 characters of A-Z, a-z, 0-9, '.', '_', '/' or '-'"
    with pytest.raises(InvalidRequest) as info:
        check_name("tiny", ("tiny",))
    assert info.value.message == "The lora adapter 'tiny' conflicts with a served base model."


def test_caps_per_owner_and_in_all():
    entries = {f"n{i}": Adapter(name=f"n{i}", base="m", source="/x", owner=OWNER if i < 2 else None)
               for i in range(4)}
    room_for(entries, OWNER, per_owner=3, total=5)
    room_for(entries, OWNER, per_owner=None, total=5)  # an operator: the total alone
    with pytest.raises(InvalidRequest, match=r"LLMQ_ADAPTERS_PER_OWNER"):
        room_for(entries, OWNER, per_owner=2, total=5)
    room_for(entries, key_hash("another"), per_owner=2, total=5)  # another key's count is its own
    with pytest.raises(InvalidRequest, match=r"LLMQ_ADAPTERS_MAX"):
        room_for(entries, None, per_owner=None, total=4)


A, B = Viewer(operator=False, owner=OWNER), Viewer(operator=False, owner=key_hash("key-of-b"))
OPERATOR = Viewer(operator=True, owner=key_hash("key-of-op"))


def test_a_private_adapter_is_its_owners_and_the_operators():
    public = Adapter(name="p", base="m", source="/x", owner=OWNER)
    private = Adapter(name="q", base="m", source="/x", owner=OWNER, private=True)
    operators = Adapter(name="r", base="m", source="/x")  # llmq-adapters', or a keyless deployment's
    assert all(public.visible_to(w) for w in (A, B, OPERATOR))
    assert [private.visible_to(w) for w in (A, B, OPERATOR)] == [True, False, True]
    assert [public.owned_by(w) for w in (A, B, OPERATOR)] == [True, False, True]
    assert [operators.owned_by(w) for w in (A, B, OPERATOR)] == [False, False, True]
    assert private.spec() == AdapterSpec(name="q", source="/x")


def test_an_entry_from_before_owners_private_to_a_tenant_is_the_operators_alone():
    """Its tenant came from a header any client could send: it grants nothing now."""
    old = msgspec.json.decode(b'{"name":"old","base":"m","source":"/x","rank":8,"tenant":"' + OWNER.encode() +
                              b'","created":1}', type=Adapter)
    assert old.hidden and old.owner is None
    assert [old.visible_to(w) for w in (A, B, OPERATOR)] == [False, False, True]
    assert not old.owned_by(A)
    public_old = msgspec.json.decode(b'{"name":"pub","base":"m","source":"/x"}', type=Adapter)
    assert public_old.visible_to(A) and not public_old.owned_by(A) and public_old.owned_by(OPERATOR)


def test_tiny_adapters_are_reproducible_and_distinct(tmp_path):
    a = build_tiny_adapter(tmp_path / "a", seed=1)
    again = ensure_tiny_adapter(tmp_path / "again", seed=1)
    other = build_tiny_adapter(tmp_path / "b", seed=2)
    weights = "adapter_model.safetensors"
    assert (a / weights).read_bytes() == (again / weights).read_bytes()
    assert (a / weights).read_bytes() != (other / weights).read_bytes()
    config = json.loads((a / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["peft_type"] == "LORA"
    assert config["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert ensure_tiny_adapter(a, seed=99) == a  # kept once built
    assert (a / weights).read_bytes() == (again / weights).read_bytes()
    assert Sources((tmp_path.resolve(),)).checked(str(a), 8) == (str(a.resolve()), 8)


def test_answers_echo_the_adapters_name():
    base = GenerationRequest(model="m", prompt="x")
    assert base.served_name == "m"
    assert GenerationRequest(model="m", prompt="x", adapter=AdapterSpec(name="b", source="/x")).served_name == "b"
