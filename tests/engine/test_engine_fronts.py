"""The worker's two engine fronts (workers/engine.py): vLLM's ``AsyncLLM`` and llmq's own loop over
vLLM's engine-core client (workers/engine_loop.py) must hand a job the same steps. Two engines of
the tiny model, built as a worker builds them, one per front, run each request alone; what each
job read is compared byte for byte. Run on every vLLM upgrade: the loop uses vLLM's internal
classes, which move between releases.

Steps are compared folded per choice (every field, as the job's result and a client's joined
stream read them): a front merges a step its job has not read yet into the next (vLLM's collector
does; so does the loop), so where steps part depends on the box's load, not on the front. The
stream interval's boundaries are checked apart."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
import structlog

pytest.importorskip("vllm")  # the engine tier: collected everywhere, run where a worker extra is installed

from shared.config import load_settings
from shared.events import TokenDelta
from shared.schemas import ChatMessage, ChatOptions, GenerationRequest, OutputOptions, SamplingParams, Tool, ToolUse
from workers.environment import apply_engine_environment
from workers.protocol import Part, Published, Step
from workers.tiny_model import ensure_tiny_model

# vLLM 0.32's shutdown leaves its zmq context to the collector, which may run in any later test.
pytestmark = [pytest.mark.engine, pytest.mark.filterwarnings("ignore:Unclosed context:ResourceWarning")]

PROMPT = [1, 245, 92, 311, 48, 203, 77, 130, 9]
WEATHER = Tool(name="get_weather", description="w",
               parameters={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})


async def _built(**settings: str) -> dict[str, object]:
    """One engine per front, built as a worker builds it from these settings."""
    from workers.engine import VllmEngine

    built = {}
    with pytest.MonkeyPatch.context() as env:
        for front in ("asyncllm", "loop"):
            loaded = load_settings({"LLMQ_ENGINE_FRONT": front, "LLMQ_MAX_MODEL_LEN": "1024", **settings})
            environ = dict(os.environ)
            apply_engine_environment(loaded, environ)
            for name, value in environ.items():
                env.setenv(name, value)
            built[front] = VllmEngine.build(loaded, loaded.model_path)
    return built


@pytest.fixture(scope="module")
async def fronts() -> AsyncIterator[dict[str, object]]:
    ensure_tiny_model(Path(load_settings({}).model_path))
    built = await _built(LLMQ_TOOL_PARSER="hermes", LLMQ_REASONING_PARSER="qwen3")
    try:
        yield built
    finally:
        for engine in built.values():
            engine.shutdown()


def request(max_tokens: int = 40, **sampling: object) -> GenerationRequest:
    """Greedy unless told: an unseeded sample draws from the engine's one generator, so a run
    would depend on every request before it."""
    return GenerationRequest(prompt_token_ids=PROMPT,
                             sampling=SamplingParams(max_tokens=max_tokens, **{"temperature": 0.0, **sampling}))


async def run(engine, job_id: str, req: GenerationRequest, parts: list[Part] | None = None,
              images: dict[str, object] | None = None) -> list[Step]:
    return [step async for step in engine.stream(job_id, req, parts, images=images)]


def folded(steps: list[Step]) -> bytes:
    """Every field a job reads, per choice joined across steps, and the first step's prompt fields."""
    choices: dict[int, dict[str, object]] = {}
    for step in steps:
        for d in step.deltas:
            c = choices.setdefault(d.index, {"token_ids": [], "text": "", "token_texts": [], "logprobs": [],
                                             "top_logprobs": [], "reasoning": "", "tool_calls": [], "ends": []})
            c["token_ids"] += d.token_ids
            c["text"] += d.text
            c["token_texts"] += d.token_texts or []
            c["logprobs"] += d.logprobs or []
            c["top_logprobs"] += d.top_logprobs or []
            c["reasoning"] += d.reasoning
            c["tool_calls"] += d.tool_calls
            if d.finish_reason is not None:
                c["ends"].append([d.finish_reason, d.stop_reason])
    first = steps[0]
    return msgspec.json.encode({"choices": dict(sorted(choices.items())), "finished": [s.finished for s in steps][-1],
                                "prompt": first.prompt, "prompt_token_ids": first.prompt_token_ids,
                                "prompt_tokens": first.prompt_tokens, "cached": first.cached_tokens})


async def same(fronts, req: GenerationRequest, parts: list[Part] | None = None, tag: str = "",
               images: dict[str, object] | None = None) -> list[Step]:
    found = {name: await run(engine, f"fronts-{name}-{tag}", req, parts, images) for name, engine in fronts.items()}
    old, new = folded(found["asyncllm"]), folded(found["loop"])
    assert new == old
    assert all(s.finished == (i == len(steps) - 1) for steps in found.values() for i, s in enumerate(steps))
    return found["loop"]


async def test_plain_greedy(fronts):
    steps = await same(fronts, request(ignore_eos=True), tag="plain")
    assert sum(len(d.token_ids) for s in steps for d in s.deltas) == 40


async def test_a_stop_string_across_tokens_held_back_trimmed_and_included(fronts):
    plain = await same(fronts, request(ignore_eos=True), tag="stop0")
    pieces = [d.text for s in plain for d in s.deltas]
    at = len("".join(pieces[:12]))  # a token boundary well inside the text
    text = "".join(pieces)
    stop = text[at - 2:at + 3]
    assert len(stop) == 5 and stop not in text[:at - 2]
    for include in (False, True):
        steps = await same(fronts, request(ignore_eos=True, stop=[stop], include_stop_str_in_output=include),
                           tag=f"stop{int(include)}")
        [last] = steps[-1].deltas
        assert (last.finish_reason, last.stop_reason) == ("stop", stop)
        got = "".join(d.text for s in steps for d in s.deltas)
        assert got == (text[:at + 3] if include else text[:at - 2])


async def test_top_logprobs_and_echo_with_prompt_logprobs(fronts):
    steps = await same(fronts, request(logprobs=3), tag="top")
    assert all(d.top_logprobs and len(d.top_logprobs) == len(d.token_ids) for s in steps for d in s.deltas)
    req = GenerationRequest(prompt_token_ids=PROMPT, sampling=SamplingParams(max_tokens=8, prompt_logprobs=2,
                                                                             temperature=0.0),
                            output=OutputOptions(echo=True, prompt_tokens=True))
    steps = await same(fronts, req, tag="echo")
    info = steps[0].prompt
    assert info is not None and info.logprobs is not None and info.logprobs[0] is None
    assert len(info.token_texts or []) == len(PROMPT)


async def test_seeded_n2(fronts):
    steps = await same(fronts, request(n=2, seed=7, temperature=1.0), tag="n2")
    assert {d.index for s in steps for d in s.deltas} == {0, 1}


async def test_a_chat_with_hermes_tools_and_qwen3_reasoning(fronts):
    req = GenerationRequest(messages=[ChatMessage(role="user", content="Weather in Paris?")],
                            sampling=SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.0),
                            chat=ChatOptions(), tools=ToolUse(tools=[WEATHER]))
    await same(fronts, req, tag="tools")


async def test_a_forced_replay_continuation(fronts):
    req = request(ignore_eos=True, seed=3, temperature=1.0)
    plain = await same(fronts, req, tag="replay0")
    ids = [t for s in plain for d in s.deltas for t in d.token_ids]
    text, count = "", 0  # what the client held: the text of the steps that brought the first tokens
    for d in (d for s in plain for d in s.deltas):
        if count < 10:  # a step boundary (a loaded box may have merged two steps into one)
            text, count = text + d.text, count + len(d.token_ids)
    held = Published(token_ids=ids[:count], text=text)
    steps = await same(fronts, req, [Part(index=0, request=req, replay=tuple(ids[:count]), held=held)],
                       tag="replay1")
    assert [t for s in steps for d in s.deltas for t in d.token_ids] == ids[count:]


async def test_stream_interval_4(fronts):
    engines = fronts.values()
    for engine in engines:  # both fronts read the interval from the engine's config, set once at build
        _set_interval(engine, 4)
    try:
        found = {name: await run(engine, f"interval-{name}", request(max_tokens=23, ignore_eos=True))
                 for name, engine in fronts.items()}
    finally:
        for engine in engines:
            _set_interval(engine, 1)
    assert folded(found["loop"]) == folded(found["asyncllm"])
    for steps in found.values():
        sizes = [len(d.token_ids) for s in steps for d in s.deltas]
        # The first token at once, then 4 at a time, the rest with the end (a step its job had not
        # read yet joins the next: still whole multiples of 4 after the first).
        assert sizes[0] % 4 == 1 and all(n % 4 == 0 for n in sizes[1:-1]) and sum(sizes) == 23, sizes


def _set_interval(engine, interval: int) -> None:
    front = engine.engine
    if hasattr(front, "llm"):
        front.llm.output_processor.stream_interval = interval
    else:
        front.interval = interval


async def test_an_abort_ends_the_job_with_abort_after_a_prefix_of_the_plain_run(fronts):
    plain = await same(fronts, request(max_tokens=400, ignore_eos=True), tag="abort0")
    whole = [t for s in plain for d in s.deltas for t in d.token_ids]
    for name, engine in fronts.items():
        job = f"abort-{name}"
        got: list[TokenDelta] = []
        async for step in engine.stream(job, request(max_tokens=400, ignore_eos=True)):
            got += step.deltas
            if len(got) == 3:
                await engine.abort(job)
        ids = [t for d in got for t in d.token_ids]
        assert got[-1].finish_reason == "abort" and ids == whole[:len(ids)] and len(ids) < 400, name


async def test_an_image_prompt_on_tiny_vision():
    import hashlib
    import io

    from PIL import Image as PILImage

    from shared.config import VISION_MODEL
    from shared.schemas import Image, Text
    from workers.tiny_vision import ensure_tiny_vision

    ensure_tiny_vision(Path(load_settings({"LLMQ_MODEL": VISION_MODEL}).model_path))
    built = await _built(LLMQ_MODEL=VISION_MODEL, LLMQ_MAX_MODEL_LEN="2048")
    try:
        picture = PILImage.new("RGB", (64, 48), (200, 30, 90))
        data = io.BytesIO()
        picture.save(data, format="PNG")
        sha = hashlib.sha256(data.getvalue()).hexdigest()
        parts = [Text(text="What is in this picture? "), Image(sha256=sha, format="png", width=64, height=48)]
        req = GenerationRequest(messages=[ChatMessage(role="user", parts=parts)],
                                sampling=SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0))
        steps = await same(built, req, tag="image", images={sha: PILImage.open(io.BytesIO(data.getvalue()))})
        assert steps[0].prompt_tokens == len(steps[0].prompt_token_ids or []) > 20, "the image's tokens in the prompt"
    finally:
        for engine in built.values():
            engine.shutdown()


async def test_the_batch_form_hands_the_same_steps_over_in_the_callers_context(fronts):
    """``VllmEngine.run`` (what the worker runs jobs with): on the loop front each step comes from
    the engine's loop task, yet in the job's context (its log lines name the job), and the steps
    are those of the iterator form."""
    req = request(ignore_eos=True)
    for name, engine in fronts.items():
        handed: list[Step] = []
        seen: set[object] = set()

        def take(step: Step, handed=handed, seen=seen) -> None:
            handed.append(step)
            seen.add(structlog.contextvars.get_contextvars().get("job_id"))

        with structlog.contextvars.bound_contextvars(job_id=f"batch-{name}"):
            await engine.run(f"batch-{name}", req, on_step=take)
        assert seen == {f"batch-{name}"}, name
        assert folded(handed) == folded(await run(engine, f"iter-{name}", req)), name
