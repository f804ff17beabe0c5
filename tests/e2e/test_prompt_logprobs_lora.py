"""Prompt logprobs on a LoRA worker, in every dialect that asks for them, all at once: the worker's
engine survives (vLLM 0.32 alone dies of it: workers/lora_fixes.py) and every answer is right.

A stack of its own (one worker with LLMQ_MAX_LORAS=2, one API) serving the tiny model and two of
its random rank-8 adapters, registered over HTTP (loopback without keys is an operator) or, should
that be refused, straight into the registry with ``llmq-adapters``. The dialects' ways to prompt
logprobs: LMTP ``SCORE`` (beside a ``GENERATE`` on one socket), OpenAI completions ``echo`` with
``logprobs``, LMI ``decoder_input_details`` and ``prompt_logprobs``, TGI ``decoder_input_details``
and happy_vllm ``prompt_logprobs`` (happy_vllm names no model, so no adapter; it and LMI's
``prompt_logprobs`` compute the prompt's logprobs without answering with them). They go out
together with plain generations of each model, so the engine schedules them into shared steps.

On this CPU a row's logprobs do not depend on what shares its step (tests/engine/
test_lora_prompt_logprobs.py measured 0.0), so an answer in the crowd equals the same request alone.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
from redis import Redis

from shared.keys import Keys
from tests.conftest import REPO
from tests.support.faults import alive, children
from tests.support.real_processes import one_worker, ready_pids
from workers.tiny_model import build_tiny_adapter

# The stack loads its engine within the test's time (up to tests/e2e/conftest.py's READY_TIMEOUT_S on busy cores).
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

PROMPT = "The quick brown fox jumps over the lazy dog"
MODELS = ("base", "a1", "a2")
EXACT = 1e-4  # the same request alone and in the crowd: the same computation (see above)
# The decode path and the prompt-logprob path run different kernels; where they differ, by whole
# bf16 ulps of the logits (~0.016-0.03 here). A wrong adapter moves logprobs by 1 or more.
DECODE_TOLERANCE = 0.05


@dataclass
class LoraStack:
    url: str
    model: str
    log: Path
    redis: Redis
    keys: Keys

    def name(self, model: str) -> str:
        return self.model if model == "base" else model

    def worker(self) -> tuple[int, list[int]]:
        """The ready worker's pid and its children (the engine core)."""
        pids = ready_pids(self.redis, self.keys)
        tail = self.log.read_text()[-3000:]
        assert len(pids) == 1, f"ready workers: {pids} (an engine rebuilding is not ready)\n{tail}"
        (pid,) = pids
        return pid, children(pid)


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("plp-adapters")
    for name, seed in (("a1", 1), ("a2", 2)):
        build_tiny_adapter(root / name, seed=seed)
    return root


@pytest.fixture(scope="module")
def stack(redis_url: str, adapter_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoraStack]:
    from shared.config import load_settings

    logs = tmp_path_factory.mktemp("plp-logs")
    prefix = f"plp-{uuid.uuid4().hex[:6]}"
    env = {**os.environ, "LLMQ_REDIS_URL": redis_url, "LLMQ_PREFIX": prefix, "LLMQ_LOG_JSON": "true",
           "LLMQ_MAX_LORAS": "2", "LLMQ_MAX_LORA_RANK": "8", "LLMQ_ADAPTER_ROOTS": str(adapter_root),
           "LLMQ_MAX_NUM_SEQS": "16", "LLMQ_MAX_MODEL_LEN": "1024", "LLMQ_HEARTBEAT_S": "1"}
    env.pop("VLLM_PLUGINS", None)  # every installed vLLM plugin, llmq's fixes included
    with one_worker(env, logs) as url:
        lora = LoraStack(url, load_settings({}).model_name, logs / "worker.log", Redis.from_url(redis_url),
                         Keys(prefix))
        try:
            for name in ("a1", "a2"):
                register(lora, env, name, adapter_root / name)
            yield lora
        finally:
            lora.redis.close()


def register(lora: LoraStack, env: dict[str, str], name: str, path: Path) -> None:
    resp = httpx.post(f"{lora.url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)},
                      timeout=30)
    if resp.status_code == 200:
        return
    # Registration over HTTP is being reworked (keys, roots): the registry itself takes it as well.
    done = subprocess.run([sys.executable, "-m", "shared.adapters", "add", name, str(path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"HTTP: {resp.status_code} {resp.text}; llmq-adapters: {done.stderr}"


# --- one request per dialect: (what it sends, what it answers) -----------------------------------


async def completions(http: httpx.AsyncClient, lora: LoraStack, model: str, *, prompt_logprobs: bool) -> dict:
    body = {"model": lora.name(model), "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    if prompt_logprobs:
        body |= {"echo": True, "logprobs": 2}
    resp = await http.post(f"{lora.url}/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


async def lmi(http: httpx.AsyncClient, lora: LoraStack, model: str, parameters: dict) -> dict:
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 4, "do_sample": False, **parameters}}
    if model != "base":
        body["adapters"] = model
    resp = await http.post(f"{lora.url}/invocations", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


async def tgi(http: httpx.AsyncClient, lora: LoraStack, model: str) -> dict:
    parameters = {"max_new_tokens": 4, "details": True, "decoder_input_details": True}
    if model != "base":
        parameters["adapter_id"] = model
    resp = await http.post(f"{lora.url}/generate", json={"inputs": PROMPT, "parameters": parameters})
    assert resp.status_code == 200, resp.text
    return resp.json()


async def happy_vllm(http: httpx.AsyncClient, lora: LoraStack) -> dict:
    resp = await http.post(f"{lora.url}/v1/generate", json={"prompt": PROMPT, "max_tokens": 4, "prompt_logprobs": 1})
    assert resp.status_code == 200, resp.text
    return resp.json()


class Lmtp:
    """One LMTP socket: GENERATE and SCORE streams sent on it, their TOKEN payloads by stream."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse, model: str) -> None:
        self.ws, self.model, self.next_id = ws, model, 0
        self.streams: dict[int, asyncio.Queue] = {}

    async def read(self) -> None:
        async for message in self.ws:
            verb, _, payload = message.data.partition(" ")
            for item in json.loads(payload):
                self.streams[item["stream_id"]].put_nowait((verb, item))

    async def _run(self, verb: str, payload: dict) -> list[dict]:
        self.next_id += 1
        queue = self.streams[self.next_id] = asyncio.Queue()
        await self.ws.send_str(f"{verb} " + json.dumps({"stream_id": self.next_id, **payload}))
        tokens = []
        while True:
            kind, item = await queue.get()
            assert kind == "TOKEN" and "error" not in item, item
            tokens.append(item)
            if item["finish_reason"] is not None:
                return tokens

    async def generate(self, model: str, prompt: list[int], max_tokens: int) -> list[dict]:
        return await self._run("GENERATE", {"model": self.name(model), "prompt": prompt, "max_tokens": max_tokens,
                                            "temperature": 0.0})

    async def score(self, model: str, prompt: list[int], scored: list[int]) -> list[dict]:
        return await self._run("SCORE", {"model": self.name(model), "prompt": prompt, "scored": scored})

    def name(self, model: str) -> str:
        return self.model if model == "base" else model


def prompt_ids(lora: LoraStack) -> list[int]:
    from transformers import AutoTokenizer

    from shared.config import load_settings

    return AutoTokenizer.from_pretrained(load_settings({}).model_path)(PROMPT)["input_ids"]


def echoed_logprobs(answer: dict) -> list[float | None]:
    """The prompt's logprobs from an echoed completion: its first ``n`` token logprobs."""
    logprobs = answer["choices"][0]["logprobs"]
    return logprobs["token_logprobs"][: len(logprobs["tokens"]) - answer["usage"]["completion_tokens"]]


def prefill_logprobs(answer: dict, field: str) -> list[float | None]:
    """LMI's and TGI's ``details.prefill``: the prompt's tokens, each with its logprob under ``field``."""
    return [t[field] for t in answer["details"]["prefill"]]


def close(a: list[float | None], b: list[float | None], tolerance: float) -> bool:
    """Position by position within ``tolerance``; None (the first token's) only against None."""
    if len(a) != len(b):
        return False
    return all(x is y is None or (x is not None and y is not None and abs(x - y) <= tolerance)
               for x, y in zip(a, b, strict=True))


# --- the test ------------------------------------------------------------------------------------


async def test_every_dialects_prompt_logprobs_together_on_a_lora_worker(stack: LoraStack):
    before = stack.worker()
    ids = prompt_ids(stack)
    async with httpx.AsyncClient(timeout=180) as http, aiohttp.ClientSession() as session, \
            session.ws_connect(stack.url) as ws:
        lmtp = Lmtp(ws, stack.model)
        reader = asyncio.create_task(lmtp.read())
        try:
            # Alone first: each model's echoed prompt logprobs, and its greedy tokens over LMTP
            # (generated: prefill, then decode steps).
            alone = {m: await completions(http, stack, m, prompt_logprobs=True) for m in MODELS}
            generated = {m: await lmtp.generate(m, ids, 4) for m in MODELS}

            # Then everything at once: per model, every dialect's prompt logprobs (LMTP's SCORE of
            # the tokens it generated, on the socket that also runs a GENERATE) and plain generations.
            crowd: dict[str, Coroutine[Any, Any, Any]] = {}
            for m in MODELS:
                crowd[f"score {m}"] = lmtp.score(m, ids, [t["token"] for t in generated[m]])
                crowd[f"generate {m}"] = lmtp.generate(m, ids, 8)
                crowd[f"echo {m}"] = completions(http, stack, m, prompt_logprobs=True)
                crowd[f"plain {m}"] = completions(http, stack, m, prompt_logprobs=False)
                crowd[f"lmi details {m}"] = lmi(http, stack, m, {"details": True, "decoder_input_details": True})
                crowd[f"lmi prompt_logprobs {m}"] = lmi(http, stack, m, {"prompt_logprobs": 2})
                crowd[f"tgi {m}"] = tgi(http, stack, m)
            crowd["happy_vllm"] = happy_vllm(http, stack)
            crowd["echo base again"] = completions(http, stack, "base", prompt_logprobs=True)
            answers = dict(zip(crowd, await asyncio.wait_for(asyncio.gather(*crowd.values()), 300), strict=True))
        finally:
            reader.cancel()

    # The worker and its engine lived through it: same process, same engine core, no restart.
    assert stack.worker() == before and all(alive(p) for p in before[1])
    logged = stack.log.read_text()
    assert "engine_died" not in logged and "engine_rebuilding" not in logged, logged[-3000:]

    n = len(ids)
    for m in MODELS:
        echoed = echoed_logprobs(answers[f"echo {m}"])
        assert len(echoed) == n and echoed[0] is None and all(isinstance(x, float) for x in echoed[1:])
        assert close(echoed, echoed_logprobs(alone[m]), EXACT), (m, echoed, echoed_logprobs(alone[m]))
        # LMI's and TGI's prefill: the same positions as the echo, from the same computation.
        for key, field in ((f"lmi details {m}", "log_prob"), (f"tgi {m}", "logprob")):
            assert close(prefill_logprobs(answers[key], field), echoed, EXACT), (key, answers[key]["details"])
        assert answers[f"lmi prompt_logprobs {m}"]["generated_text"]
        # SCORE of the generated tokens = their logprobs when generated, on that model.
        scored = [t["logprob"] for t in answers[f"score {m}"]]
        decoded = [t["logprob"] for t in generated[m]]
        assert close(scored, decoded, DECODE_TOLERANCE), (m, scored, decoded)
        assert [t["token"] for t in answers[f"score {m}"]] == [t["token"] for t in generated[m]]
        assert len(answers[f"generate {m}"]) == 8 or answers[f"generate {m}"][-1]["finish_reason"] == "stop"
        assert answers[f"plain {m}"]["choices"][0]["text"] is not None
    assert close(echoed_logprobs(answers["echo base again"]), echoed_logprobs(alone["base"]), EXACT)
    assert answers["happy_vllm"]["responses"] and answers["happy_vllm"]["usages"][0]["prompt_tokens"] == n
    # Each adapter is applied to its rows: its prompt logprobs are not the base model's.
    base = echoed_logprobs(alone["base"])[1:]
    for m in ("a1", "a2"):
        moved = max(abs(x - y) for x, y in zip(echoed_logprobs(alone[m])[1:], base, strict=True))
        assert moved > 1.0, f"{m} barely moves the prompt's logprobs ({moved})"
