"""Prompt logprobs on a LoRA engine (workers/lora_fixes.py), on real vLLM in-process.

vLLM 0.32 crashes a LoRA engine when a request asking for prompt logprobs shares an engine step
with other requests, and on the CPU backend computes a base-model row with the adapter in the
last LoRA slot. The fixes are vLLM general plugins; here they are loaded as vLLM loads them (the
entry points of the installed project). One engine without LoRA gives the reference, one with
LoRA (LLMQ_MAX_LORAS=2, rank 8, as workers/engine.py builds it) runs every scenario, and a
subprocess shows the same shared step crashing vLLM without the prompt-logprobs fix.

Two adapters of the tiny model: ``a1`` adapts the attention projections (as the tiny model's own
adapters do); ``a2`` adapts ``lm_head`` too, so the logits of its rows differ only if the logits
are computed with its LoRA mapping. ``a1`` is loaded first (slot 0), ``a2`` second: the last slot,
the one vLLM's PyTorch ops index with a base-model row's -1.

On this CPU every comparison below came out bit-identical (0.0): vLLM computes each row alike
whatever else shares its step, and a LoRA layer adds an exact 0 for a row without an adapter.

A CPU engine maps a request's prompt rows with its LoRA index once (vLLM's PyTorch ops broadcast
it); other platforms with one index per row. The engine here takes the first; a runner stand-in
checks the mappings both give (one per row also computed the same figures on this engine, before
the CPU one replaced it for its cost: workers/lora_fixes.py ``_broadcasts``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import subprocess
import sys
import types
import warnings
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")  # the engine tier: collected everywhere, run where a worker extra is installed

import torch
from safetensors.torch import load_file, save_file

from shared.config import load_settings
from tests.conftest import REPO
from workers import lora_fixes
from workers.environment import apply_engine_environment
from workers.tiny_model import build_tiny_adapter, ensure_tiny_model

# vLLM 0.32's shutdown leaves its zmq context to the collector, which may run in any later test.
pytestmark = [pytest.mark.engine, pytest.mark.filterwarnings("ignore:Unclosed context:ResourceWarning")]

K = 5  # top-k of each prompt position
PROMPTS = ["the quick brown fox jumps over the lazy dog", "lorem ipsum dolor sit amet, consectetur",
           "In a hole in the ground there lived a hobbit."]
EXACT = 1e-4
# The decode path and the prompt-logprob path are different kernels (paged attention over the KV
# cache vs prefill attention). Here they agree bit for bit; where they would not, their logits are
# bf16 and differ by whole ulps: ~0.016-0.03 at this model's logit sizes. 0.05 allows that and
# still fails a row computed with the wrong adapter, which moves logprobs by 1 or more here.
DECODE_TOLERANCE = 0.05
ENTRY_POINTS = {"llmq_lora_prompt_logprobs": "workers.lora_fixes:register_prompt_logprobs",
                "llmq_lora_no_adapter_rows": "workers.lora_fixes:register_no_adapter_rows"}

Position = dict[int, tuple[int, float]]  # token id -> (rank, logprob) at one prompt position
Table = list[Position]  # a prompt's positions after the first


# --- the plugins, without an engine --------------------------------------------------------------


def test_the_fixes_are_plugins_vllm_finds(monkeypatch):
    from importlib.metadata import entry_points

    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group

    assert tuple(ENTRY_POINTS) == lora_fixes.FIXES
    found = {e.name: e.value for e in entry_points(group=DEFAULT_PLUGINS_GROUP)}
    assert {name: found.get(name) for name in ENTRY_POINTS} == ENTRY_POINTS, (
        "reinstall the project (pip install -e . --no-deps) so its entry points are visible; a stale "
        "llmq.egg-info in the checkout hides them from processes started there")
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    loaded = load_plugins_by_group(DEFAULT_PLUGINS_GROUP)
    assert loaded["llmq_lora_prompt_logprobs"] is lora_fixes.register_prompt_logprobs
    assert loaded["llmq_lora_no_adapter_rows"] is lora_fixes.register_no_adapter_rows


def test_a_worker_can_tell_when_vllm_will_not_load_them(monkeypatch):
    assert lora_fixes.not_loaded({}) == []
    assert lora_fixes.not_loaded({"VLLM_PLUGINS": "llmq_lora_prompt_logprobs,llmq_lora_no_adapter_rows"}) == []
    assert lora_fixes.not_loaded({"VLLM_PLUGINS": "my_plugin,llmq_lora_no_adapter_rows"}) == [
        "llmq_lora_prompt_logprobs"]
    assert lora_fixes.not_loaded({"VLLM_PLUGINS": ""}) == list(lora_fixes.FIXES)
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [])  # metadata without them
    assert lora_fixes.not_loaded({}) == list(lora_fixes.FIXES)


def test_registering_twice_wraps_vllm_once():
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    for _ in range(2):
        lora_fixes.register_prompt_logprobs()
        lora_fixes.register_no_adapter_rows()
    method = GPUModelRunner._get_prompt_logprobs_dict
    assert getattr(method, lora_fixes.PATCHED) and not hasattr(method.__wrapped__, lora_fixes.PATCHED)
    assert CPUModelRunner._get_prompt_logprobs_dict is method, "the CPU runner inherits the fixed method"
    for name in ("bgmv_expand", "bgmv_expand_slice"):
        op = getattr(lora_ops, name)
        assert getattr(op, lora_fixes.PATCHED) and not hasattr(op.__wrapped__, lora_fixes.PATCHED)
        assert getattr(punica_cpu, name) is op, "the CPU punica wrapper calls the fixed op"
    update = punica_cpu.PunicaWrapperCPU.update_metadata
    assert getattr(update, lora_fixes.PATCHED) and not hasattr(update.__wrapped__, lora_fixes.PATCHED)


def test_a_vllm_whose_internals_differ_is_left_alone_with_a_warning(caplog):
    def _get_prompt_logprobs_dict(self, hidden_states, num_scheduled_tokens):
        return self.input_batch.prompt_logprobs_of(hidden_states)  # not what the fix relies on

    runner = type("GPUModelRunner", (), {"_get_prompt_logprobs_dict": _get_prompt_logprobs_dict,
                                         "_set_active_loras": lambda self, *a: None})
    ops = types.SimpleNamespace(bgmv_expand=lambda inputs, weights: None, bgmv_expand_slice=None)
    with caplog.at_level(logging.WARNING, logger=lora_fixes.__name__):
        lora_fixes._patch_runner(types.SimpleNamespace(GPUModelRunner=runner))
        sys.modules[lora_fixes._TORCH_OPS], saved = ops, sys.modules.get(lora_fixes._TORCH_OPS)
        try:
            lora_fixes._patch_cpu_ops(types.SimpleNamespace(bgmv_expand=ops.bgmv_expand))
        finally:
            sys.modules[lora_fixes._TORCH_OPS] = saved
    assert runner.__dict__["_get_prompt_logprobs_dict"] is _get_prompt_logprobs_dict
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "no longer uses num_prompt_logprobs" in warnings[0], warnings
    assert "bgmv_expand takes ['inputs', 'weights']" in warnings[1], warnings


def test_a_cpu_row_without_an_adapter_gets_no_delta():
    lora_fixes.register_no_adapter_rows()
    from vllm.lora.layers import LoRAMapping
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu  # the import that applies the fix, as in an engine

    assert punica_cpu.bgmv_expand is lora_ops.bgmv_expand
    torch.manual_seed(0)
    weights = torch.randn(2, 1, 6, 4)  # two slots, 6 outputs, rank 4
    rows = torch.randn(3, 4)
    indices = torch.tensor([0, -1, 1])  # slot 0, no adapter, slot 1 (the last)
    # The step's mapping, as vLLM sets it before its LoRA layers run: LoRA ids, 0 for no adapter.
    step = punica_cpu.PunicaWrapperCPU(64, 8, "cpu")
    step.update_metadata(LoRAMapping((1, 0, 2), (1, 0, 2), is_prefill=True), [1, 2], 3, 6)
    theirs, ours = torch.zeros(3, 6), torch.zeros(3, 6)
    lora_ops.bgmv_expand.__wrapped__(rows, weights, theirs, indices)
    lora_ops.bgmv_expand(rows, weights, ours, indices)
    assert torch.allclose(theirs[1], rows[1] @ weights[1, 0].T), "vLLM's op gives the row the last slot's delta"
    assert torch.equal(ours[1], torch.zeros(6)), "no adapter: no delta"
    assert torch.equal(ours[[0, 2]], theirs[[0, 2]]), "the adapters' rows are as vLLM computes them"
    one = torch.zeros(3, 6)
    lora_ops.bgmv_expand(rows, weights, one, torch.tensor([-1]))  # one index for all rows broadcasts
    assert torch.equal(one, torch.zeros(3, 6))
    # A step where every row has an adapter: the ops run as vLLM's, without looking at the indices.
    step.update_metadata(LoRAMapping((1, 2, 2), (1, 2, 2), is_prefill=True), [1, 2], 3, 6)
    assert not any(lora_fixes._no_adapter_rows.values())
    again = torch.zeros(3, 6)
    lora_ops.bgmv_expand(rows, weights, again, torch.tensor([0, 1, 1]))
    expected = torch.zeros(3, 6)
    lora_ops.bgmv_expand.__wrapped__(rows, weights, expected, torch.tensor([0, 1, 1]))
    assert torch.equal(again, expected)


class FakeRunner:
    """What the fix touches of vLLM's model runner, recording the LoRA mappings it is given."""

    def __init__(self, pending: dict[str, int], lora_ids: dict[str, int]) -> None:
        self.num_prompt_logprobs = pending
        self.lora_config = object()
        self.input_batch = types.SimpleNamespace(
            req_id_to_index={r: i for i, r in enumerate(lora_ids)}, request_lora_mapping=list(lora_ids.values()),
            lora_id_to_lora_request={i: f"lora-{i}" for i in set(lora_ids.values()) if i})
        step = types.SimpleNamespace(prompt_mapping=tuple(lora_ids.values()), index_mapping=(9,), type="LANGUAGE")
        self.lora_manager = types.SimpleNamespace(_adapter_manager=types.SimpleNamespace(_last_mapping=step))
        self.model = types.SimpleNamespace(compute_logits=lambda hidden: ("logits", hidden.shape[0]))
        self.mappings: list[tuple] = []

    def _set_active_loras(self, prompt_mapping, token_mapping, lora_requests, mapping_type=None) -> None:
        self.mappings.append((prompt_mapping, token_mapping, frozenset(lora_requests), mapping_type))


def vllm_shaped(self, hidden_states, num_scheduled_tokens):
    """vLLM's method as the fix sees it: per pending request, its prompt rows' logits through
    ``self.model.compute_logits``; requests whose prompt is done leave the dict (here: all but
    ``chunked``); the result names the finished ones."""
    done = {}
    for req_id in list(self.num_prompt_logprobs):
        rows = num_scheduled_tokens[req_id]
        done[req_id] = self.model.compute_logits(hidden_states[:rows])
        if req_id != "chunked":
            del self.num_prompt_logprobs[req_id]
    return done


@pytest.mark.parametrize("per_row", [False, True], ids=["one index (CPU)", "one per row"])
def test_each_request_computes_its_rows_with_its_own_lora_id(monkeypatch, per_row):
    monkeypatch.setattr(lora_fixes, "_broadcasts", lambda: not per_row)
    fixed = lora_fixes._wrap_runner(vllm_shaped)
    pending = {"base": 1, "adapted": 2, "chunked": 0}
    runner = FakeRunner(pending, {"base": 0, "adapted": 3, "chunked": 5, "decoding": 3})
    out = fixed(runner, torch.zeros(40, 8), {"base": 6, "adapted": 4, "chunked": 16, "decoding": 1})
    assert out == {"base": ("logits", 6), "adapted": ("logits", 4), "chunked": ("logits", 16)}
    assert runner.num_prompt_logprobs is pending and pending == {"chunked": 0}, "the finished ones left"
    active = frozenset({"lora-3", "lora-5"})
    expected = [((i,) * (n if per_row else 1),) * 2 + (active, None) for i, n in ((0, 6), (3, 4), (5, 16))]
    assert runner.mappings[:3] == expected
    assert runner.mappings[3] == ((0, 3, 5, 3), (9,), active, "LANGUAGE"), "the step's own mapping, back"
    assert "compute_logits" not in vars(runner.model) or runner.model.compute_logits(torch.zeros(2, 8)) == (
        "logits", 2), "the model's own compute_logits, back"


def test_without_lora_or_prompt_logprobs_vllms_method_runs_as_it_is():
    calls = []
    fixed = lora_fixes._wrap_runner(lambda self, hidden, scheduled: calls.append(dict(self.num_prompt_logprobs)))
    runner = FakeRunner({"a": 1, "b": 1}, {"a": 0, "b": 3})
    runner.lora_config = None
    fixed(runner, torch.zeros(4, 8), {"a": 2, "b": 2})
    runner.lora_config, runner.num_prompt_logprobs = object(), {}
    fixed(runner, torch.zeros(4, 8), {"a": 2, "b": 2})
    assert calls == [{"a": 1, "b": 1}, {}] and runner.mappings == [], "one call each, with everything, no mapping"


# --- engines -------------------------------------------------------------------------------------


def lm_head_adapter(path: Path, seed: int) -> Path:
    """The tiny model's adapter of ``seed`` with an ``lm_head`` LoRA added (rank 8, as its others)."""
    build_tiny_adapter(path, seed=seed)
    tensors = load_file(str(path / "adapter_model.safetensors"))
    config = json.loads((path / "adapter_config.json").read_text())
    rank, hidden = tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape
    vocab = json.loads((Path(load_settings({}).model_path) / "config.json").read_text())["vocab_size"]
    generator = torch.Generator().manual_seed(seed + 1000)
    tensors["base_model.model.lm_head.lora_A.weight"] = torch.randn(rank, hidden, generator=generator) * 0.3
    tensors["base_model.model.lm_head.lora_B.weight"] = torch.randn(vocab, rank, generator=generator) * 0.3
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config["target_modules"] = [*config["target_modules"], "lm_head"]
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    ensure_tiny_model(Path(load_settings({}).model_path))
    root = tmp_path_factory.mktemp("lora-adapters")
    return {"a1": build_tiny_adapter(root / "a1", seed=1), "a2": lm_head_adapter(root / "a2", seed=2)}


class Engine:
    """The engine a worker builds (workers/engine.py), driven through vLLM's AsyncLLM directly."""

    def __init__(self, llm, adapter_dirs: dict[str, Path]) -> None:
        from vllm.lora.request import LoRARequest

        self.llm = llm
        self.tokenizer = llm.get_tokenizer()
        self.loras = {None: None, **{name: LoRARequest(name, i, str(path))
                                     for i, (name, path) in enumerate(sorted(adapter_dirs.items()), 1)}}
        self.count = 0

    def ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    async def run(self, ids: list[int], params, adapter: str | None = None):
        from vllm.inputs import TokensPrompt

        self.count += 1
        final = None
        async for out in self.llm.generate(TokensPrompt(prompt_token_ids=ids), params, request_id=f"r{self.count}",
                                           lora_request=self.loras[adapter]):
            final = out
        return final

    async def score(self, ids: list[int], adapter: str | None = None) -> Table:
        from vllm import SamplingParams

        out = await self.run(ids, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=K), adapter)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
        return [{t: (lp.rank, lp.logprob) for t, lp in position.items()} for position in out.prompt_logprobs[1:]]

    async def shared(self, work: list, background: list[str | None]) -> list:
        """``work`` (coroutines) submitted together while ``background`` generations decode: vLLM
        schedules them into steps shared with each other and with the generations."""
        from vllm import SamplingParams

        decoding = [asyncio.Event() for _ in background]

        async def generate(i: int, adapter: str | None) -> None:
            self.count += 1
            async for _ in self.llm.generate(f"background {i}", SamplingParams(max_tokens=400, ignore_eos=True),
                                             request_id=f"bg{self.count}", lora_request=self.loras[adapter]):
                decoding[i].set()

        tasks = [asyncio.create_task(generate(i, a)) for i, a in enumerate(background)]
        try:
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in decoding)), 120)
            return await asyncio.wait_for(asyncio.gather(*work), 120)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


@pytest.fixture(scope="module")
def engine_of(adapter_dirs):
    """``async with engine_of(max_loras)``: one engine at a time, shut down after its scenarios."""

    @contextlib.asynccontextmanager
    async def build(max_loras: int) -> AsyncIterator[Engine]:
        from vllm import SamplingParams

        from workers.engine import VllmEngine

        settings = load_settings({"LLMQ_MAX_LORAS": str(max_loras), "LLMQ_MAX_LORA_RANK": "8",
                                  "LLMQ_ENGINE_FRONT": "asyncllm"})  # driven through AsyncLLM itself
        with pytest.MonkeyPatch.context() as env:
            env.delenv("VLLM_PLUGINS", raising=False)  # every installed plugin, ours included, as in a worker
            environ = dict(os.environ)
            apply_engine_environment(settings, environ)
            for name, value in environ.items():
                env.setenv(name, value)
            engine = VllmEngine.build(settings, settings.model_path)
            runner = Engine(engine.engine.llm, adapter_dirs)  # vLLM's AsyncLLM itself (the default front)
            try:
                await runner.run(runner.ids("warm up"), SamplingParams(max_tokens=2))
                yield runner
            finally:
                runner.llm = runner.tokenizer = None  # the engine's last references go with shutdown()
                with warnings.catch_warnings():
                    # vLLM 0.32's shutdown leaves its zmq context to the collector, which warns.
                    warnings.filterwarnings("ignore", "Unclosed context", ResourceWarning)
                    engine.shutdown()

    return build


@pytest.fixture(scope="module")
async def reference(engine_of) -> dict[str, Table]:
    """Each prompt's prompt logprobs on an engine without LoRA, alone; and in a shared step."""
    async with engine_of(0) as eng:
        alone = {p: await eng.score(eng.ids(p)) for p in PROMPTS}
        together = await eng.shared([eng.score(eng.ids(p)) for p in PROMPTS], [None] * 3)
    return {"alone": alone, "shared": dict(zip(PROMPTS, together, strict=True))}


@pytest.fixture(scope="module")
async def lora(engine_of) -> dict:
    """Every scenario on one LoRA engine, in an order that fixes the slot layout; the results."""
    r: dict = {}
    async with engine_of(2) as eng:
        ids = {p: eng.ids(p) for p in PROMPTS}
        r["base alone, no adapter loaded"] = {p: await eng.score(ids[p]) for p in PROMPTS}
        for name in ("a1", "a2"):  # a1 into slot 0, then a2 into slot 1, the last
            r[f"{name} alone"] = {p: await eng.score(ids[p], name) for p in PROMPTS}
        r["base alone, a2 in the last slot"] = {p: await eng.score(ids[p]) for p in PROMPTS}
        jobs = [(p, a) for a in (None, "a1", "a2") for p in PROMPTS]
        together = await eng.shared([eng.score(ids[p], a) for p, a in jobs], [None, "a1", "a2"])
        for (p, a), table in zip(jobs, together, strict=True):
            r.setdefault(f"{a or 'base'} shared", {})[p] = table
        r["decode"] = await _decode_vs_prompt(eng, ids)
        r["storm"] = await _storm(eng, ids)
        r["after"] = await eng.score(ids[PROMPTS[0]])
    return r


async def _decode_vs_prompt(eng: Engine, ids: dict[str, list[int]]) -> dict[str, list[tuple[float, float]]]:
    """Per model: the logprob of each greedy token when generated after its prompt (prefill, then
    decode steps), and the same token's prompt logprob at the end of prompt + tokens, all of the
    second kind scored together beside generations."""
    from vllm import SamplingParams

    models = (None, "a1", "a2")
    runs = [(p, a) for a in models for p in PROMPTS]
    greedy = SamplingParams(max_tokens=3, temperature=0.0, logprobs=K)
    outs = await asyncio.gather(*(eng.run(ids[p], greedy, a) for p, a in runs))
    extended = [ids[p] + list(o.outputs[0].token_ids) for (p, _), o in zip(runs, outs, strict=True)]
    tables = await eng.shared([eng.score(e, a) for e, (_, a) in zip(extended, runs, strict=True)], [None, "a1"])
    pairs: dict[str, list[tuple[float, float]]] = {}
    for (_, a), out, table, full in zip(runs, outs, tables, extended, strict=True):
        tokens = list(out.outputs[0].token_ids)
        decoded = [position[t].logprob for position, t in zip(out.outputs[0].logprobs, tokens, strict=True)]
        scored = [position[t][1] for position, t in zip(table[-len(tokens):], full[-len(tokens):], strict=True)]
        pairs.setdefault(a or "base", []).extend(zip(decoded, scored, strict=True))
    return pairs


async def _storm(eng: Engine, ids: dict[str, list[int]]) -> list:
    """48 requests at once: prompt logprobs and plain generations, of the base model and both adapters."""
    from vllm import SamplingParams

    work = []
    for i in range(48):
        prompt, adapter = ids[PROMPTS[i % 3]], (None, "a1", "a2")[i // 3 % 3]
        asked = {"prompt_logprobs": i % 4} if i % 2 else {}
        work.append(eng.run(prompt, SamplingParams(max_tokens=8, ignore_eos=True, **asked), adapter))
    return await asyncio.gather(*work, return_exceptions=True)


def largest_difference(a: Table, b: Table) -> float:
    """The largest logprob difference of a token both tables hold; fails if a position's top-k differs."""
    worst = 0.0
    for i, (pa, pb) in enumerate(zip(a, b, strict=True)):
        top_a, top_b = ({t for t, (rank, _) in p.items() if rank <= K} for p in (pa, pb))
        assert top_a == top_b, f"position {i + 1}: top-{K} {sorted(top_a)} != {sorted(top_b)}"
        worst = max(worst, *(abs(pa[t][1] - pb[t][1]) for t in pa.keys() & pb.keys()))
    return worst


def test_prompt_logprobs_beside_other_requests_keep_a_lora_engine_alive(lora):
    storm = lora["storm"]
    failed = [out for out in storm if isinstance(out, BaseException)]
    assert not failed, failed[0]
    for i, out in enumerate(storm):
        assert len(out.outputs[0].token_ids) == 8
        if i % 2:
            assert len(out.prompt_logprobs) == len(out.prompt_token_ids) and out.prompt_logprobs[0] is None
        else:
            assert out.prompt_logprobs is None
    assert lora["after"] == lora["base alone, no adapter loaded"][PROMPTS[0]], "the engine still serves, alike"


def test_base_model_prompt_logprobs_equal_an_engine_without_lora(lora, reference):
    noise = max(largest_difference(reference["shared"][p], reference["alone"][p]) for p in PROMPTS)
    assert noise <= EXACT, f"without LoRA a shared step moves a logprob by {noise}: compare like with like"
    worst = {}
    for case in ("base alone, no adapter loaded", "base alone, a2 in the last slot", "base shared"):
        worst[case] = max(largest_difference(lora[case][p], reference["alone"][p]) for p in PROMPTS)
    print(f"largest difference from the engine without LoRA: {worst}")  # shown with -rP
    assert max(worst.values()) <= EXACT, worst


def test_each_adapter_scores_with_its_own_weights_in_a_shared_step(lora, reference):
    for name in ("a1", "a2"):
        for p in PROMPTS:
            assert largest_difference(lora[f"{name} shared"][p], lora[f"{name} alone"][p]) <= EXACT, (name, p)
            moved = max(abs(a[t][1] - b[t][1]) for a, b in zip(lora[f"{name} alone"][p], reference["alone"][p],
                                                                strict=True) for t in a.keys() & b.keys())
            assert moved > 1.0, f"{name} barely changes the logprobs of {p!r} ({moved}): is it applied?"
    first = PROMPTS[0]
    assert lora["a1 alone"][first] != lora["a2 alone"][first]


def test_an_adapters_prompt_logprob_is_its_generated_tokens_logprob(lora):
    worst = {model: max(abs(d - s) for d, s in pairs) for model, pairs in lora["decode"].items()}
    print(f"largest difference from the generated tokens' logprobs: {worst}")  # shown with -rP
    assert set(worst) == {"base", "a1", "a2"}
    assert max(worst.values()) <= DECODE_TOLERANCE, worst
    base = [d for d, _ in lora["decode"]["base"]]
    for name in ("a1", "a2"):
        assert [d for d, _ in lora["decode"][name]] != base, f"{name} generates as the base model does"


# --- the same shared step without the fix, in a process of its own -------------------------------


def test_without_the_prompt_logprobs_fix_the_shared_step_kills_vllm(adapter_dirs, tmp_path):
    """The control: the scenario above really puts prompt logprobs in a shared step, which vLLM
    0.32 alone does not survive. Run apart, as plugins load once per process (and a forked
    engine core inherits them)."""
    env = {**os.environ, "VLLM_PLUGINS": "llmq_lora_no_adapter_rows", "LLMQ_TEST_ADAPTERS": json.dumps(
        {k: str(v) for k, v in adapter_dirs.items()})}
    proc = subprocess.run([sys.executable, "-m", "tests.engine.test_lora_prompt_logprobs"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    verdict = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    if verdict == "survived":
        pytest.fail("vLLM survived prompt logprobs in a shared LoRA step without the fix: if it is fixed "
                    "upstream, workers/lora_fixes.py's prompt-logprobs fix can go")
    logged = proc.stdout + proc.stderr  # vLLM logs to stdout
    assert verdict == "EngineDeadError", logged[-5000:]
    assert "einsum(): subscript b has size" in logged, logged[-5000:]
    assert "_get_prompt_logprobs_dict" in logged and "add_lora_logits" in logged


async def _control() -> str:
    from vllm import SamplingParams
    from vllm.v1.engine.exceptions import EngineDeadError

    from workers.engine import VllmEngine

    settings = load_settings({"LLMQ_MAX_LORAS": "2", "LLMQ_MAX_LORA_RANK": "8", "LLMQ_ENGINE_FRONT": "asyncllm"})
    apply_engine_environment(settings, os.environ)
    dirs = {k: Path(v) for k, v in json.loads(os.environ["LLMQ_TEST_ADAPTERS"]).items()}
    engine = VllmEngine.build(settings, settings.model_path)
    try:
        eng = Engine(engine.engine.llm, dirs)
        await eng.run(eng.ids("warm up"), SamplingParams(max_tokens=2))
        try:
            await eng.shared([eng.score(eng.ids(p), a) for a in (None, "a1") for p in PROMPTS], [None, "a1"])
        except EngineDeadError:
            return "EngineDeadError"
        return "survived"
    finally:
        engine.shutdown()


if __name__ == "__main__":  # the control's process (vLLM's spawned processes re-import __main__ guarded)
    print(asyncio.run(_control()), flush=True)
