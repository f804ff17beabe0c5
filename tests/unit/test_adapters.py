"""LoRA adapters: what registration checks of a source, and the tiny model's adapters."""

from __future__ import annotations

import json

import pytest

from shared.adapters import Adapter, check_source
from shared.errors import InvalidRequest
from shared.schemas import AdapterSpec, GenerationRequest
from workers.tiny_model import build_tiny_adapter, ensure_tiny_adapter


def refused(source: str, max_rank: int = 16) -> str:
    with pytest.raises(InvalidRequest) as info:
        check_source(source, max_rank)
    return info.value.message


def test_a_directory_here_is_read_and_its_rank_checked(tmp_path):
    adapter = build_tiny_adapter(tmp_path / "a", seed=1)
    assert check_source(str(adapter), 16) == 8
    assert check_source(str(adapter), 8) == 8
    assert refused(str(adapter), 4) == (f"The adapter at '{adapter}' has rank 8, above this deployment's limit of 4 "
                                        "(LLMQ_MAX_LORA_RANK)")
    (tmp_path / "empty").mkdir()
    empty = tmp_path / "empty"
    assert refused(str(empty)) == f"No LoRA adapter at '{empty}': it has no adapter_config.json"
    (tmp_path / "empty" / "adapter_config.json").write_text("{not json")
    assert "is not a LoRA config" in refused(str(tmp_path / "empty"))
    (tmp_path / "empty" / "adapter_config.json").write_text(json.dumps({"peft_type": "PREFIX_TUNING"}))
    assert "is not a LoRA adapter (peft_type 'PREFIX_TUNING'" in refused(str(tmp_path / "empty"))


def test_what_this_host_cannot_see_is_left_to_the_workers(tmp_path):
    assert check_source("org/some-lora", 16) is None  # a hub name: downloaded by the workers
    assert check_source(str(tmp_path / "mounted-on-the-workers-only"), 16) is None
    assert refused("") == "`lora_path` must name a directory or a hub repository"
    assert refused("a\x00b") == "`lora_path` must name a directory or a hub repository"


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


def test_an_adapter_is_visible_to_its_tenant_or_everyone():
    public = Adapter(name="a", base="m", source="/x")
    private = Adapter(name="b", base="m", source="/x", tenant="t1")
    assert public.visible_to("t1") and public.visible_to("t2")
    assert private.visible_to("t1") and not private.visible_to("t2")
    assert private.spec() == AdapterSpec(name="b", source="/x")


def test_answers_echo_the_adapters_name():
    base = GenerationRequest(model="m", prompt="x")
    assert base.served_name == "m"
    assert GenerationRequest(model="m", prompt="x", adapter=AdapterSpec(name="b", source="/x")).served_name == "b"
