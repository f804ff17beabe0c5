"""LoRA adapters on real vLLM: registered over HTTP, generating with the real SDKs, differing from
the base model and alike on both workers, a tenant key's private one (invisible to another key,
whatever tenant header it sends; removed by an operator), broken ones failing only their jobs, a
source swapped for a link out of the roots refused by the worker itself, and a SIGKILL mid-stream
continued exactly on a peer.

A small stack of its own (tests/support/crash_stack.py's: two workers, one API, a short
lease) with LLMQ_MAX_LORAS, two tenants' keys and an operator's, a tenant header, and
LLMQ_ADAPTER_ROOTS, serving the tiny model's random rank-8 adapters (workers/tiny_model.py). Greedy
output on CPU depends on the batch, so every comparison runs its requests one at a time.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
import torch
from safetensors.torch import load_file, save_file

from shared.adapters import REFUSED
from shared.tenants import key_hash
from tests.support.crash_stack import Small, compare_completions, small_stack
from workers.tiny_model import build_tiny_adapter

pytestmark = [pytest.mark.e2e]

PROMPT = "Once upon a time"
A, B, OP = "e2e-key-of-tenant-a", "e2e-key-of-tenant-b", "e2e-key-of-the-operator"


def auth(key: str, tenant: str | None = None) -> dict[str, str]:
    return {"authorization": f"Bearer {key}", **({"x-tenant": tenant} if tenant else {})}


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("adapter-roots").resolve()


@pytest.fixture(scope="module")
def lora(redis_url: str, tmp_path_factory: pytest.TempPathFactory, roots: Path) -> Iterator[Small]:
    with small_stack(redis_url, tmp_path_factory.mktemp("lora-logs"), f"lora-{uuid.uuid4().hex[:6]}",
                     LLMQ_MAX_LORAS="2", LLMQ_MAX_LORA_RANK="8", LLMQ_TENANT_HEADER="x-tenant",
                     LLMQ_API_KEYS=f"{A},{B}", LLMQ_OPERATOR_KEYS=OP, LLMQ_TENANT_ADAPTERS="private",
                     LLMQ_ADAPTER_ROOTS=str(roots), LLMQ_ADAPTER_HUB_ALLOW="nobody") as stack:
        yield stack


@pytest.fixture(scope="module")
def adapters(roots: Path) -> dict[str, Path]:
    """The operators' three, and tenant A's own (under its key's subdirectory of the root)."""
    built = {name: build_tiny_adapter(roots / "ops" / name, seed=seed) for name, seed in (("a1", 1), ("a2", 2),
                                                                                         ("a3", 3))}
    return {**built, "mine": build_tiny_adapter(roots / key_hash(A) / "mine", seed=3)}


def load(lora: Small, name: str, path: Path | str, key: str = OP, tenant: str | None = None,
         **more: object) -> httpx.Response:
    return httpx.post(f"{lora.url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path), **more},
                      headers=auth(key, tenant))


def register(lora: Small, name: str, path: Path | str, key: str = OP, tenant: str | None = None,
             **more: object) -> None:
    resp = load(lora, name, path, key, tenant, **more)
    assert resp.status_code == 200, resp.text


def greedy(client: openai.OpenAI, model: str) -> tuple[str, str]:
    """A greedy completion: its text and the worker that ran it (from its job record)."""
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0)
    return out.choices[0].text, out.id.removeprefix("cmpl-")


def worker_of(lora: Small, job_id: str) -> str:
    return lora.redis.hget(lora.keys.job(lora.model, job_id), "worker").decode()


def pids(lora: Small) -> dict[str, int]:
    """Each ready worker's id -> its pid."""
    found = {}
    for key in lora.redis.scan_iter(match=lora.keys.worker("*")):
        fields = lora.redis.hgetall(key)
        if fields.get(b"status") == b"ready":
            found[lora.keys.worker_id(key.decode())] = int(fields[b"pid"])
    return found


def test_an_adapter_changes_the_answer_alike_on_every_worker(lora, adapters):
    lora.two_workers()
    for name in ("a1", "a2"):
        register(lora, name, adapters[name], load_inplace=True)
    workers = pids(lora)
    assert len(workers) == 2
    answers: dict[str, dict[str, str]] = {}  # model -> worker -> text
    with openai.OpenAI(base_url=f"{lora.url}/v1", api_key=A, max_retries=0, timeout=120) as client:
        listed = {m.id: m for m in client.models.list()}
        assert listed["a1"].model_extra["parent"] == lora.model
        # Each worker in turn runs every model, the other stopped (SIGSTOP), so both serve each one.
        for worker in workers:
            others = [p for w, p in workers.items() if w != worker]
            for p in others:
                os.kill(p, signal.SIGSTOP)
            try:
                for model in (lora.model, "a1", "a2"):
                    text, job_id = greedy(client, model)
                    assert worker_of(lora, job_id) == worker
                    answers.setdefault(model, {})[worker] = text
            finally:
                for p in others:
                    os.kill(p, signal.SIGCONT)
    for model, by_worker in answers.items():
        assert len(set(by_worker.values())) == 1, f"{model}: the workers disagree: {by_worker}"
    base, a1, a2 = (next(iter(answers[m].values())) for m in (lora.model, "a1", "a2"))
    assert len({base, a1, a2}) == 3, "each adapter changes the greedy answer"


def test_a_private_adapter_is_its_keys_and_the_operators_alone(lora, adapters):
    # Registered by tenant A's key, whatever tenant its header names: the owner is the key.
    register(lora, "mine", adapters["mine"], key=A, tenant="t2", private=True, load_inplace=True)
    ask = {"model": "mine", "max_tokens": 16, "messages": [{"role": "user", "content": PROMPT}]}
    with anthropic.Anthropic(base_url=lora.url, api_key=A, max_retries=0) as owner:
        message = owner.messages.create(**ask)
        assert message.model == "mine" and message.content
        assert owner.messages.count_tokens(model="mine", messages=ask["messages"]).input_tokens > 0
    # Another key sees nothing, even naming A's tenant in the header.
    with anthropic.Anthropic(base_url=lora.url, api_key=B, max_retries=0,
                             default_headers={"x-tenant": key_hash(A)}) as other:
        with pytest.raises(anthropic.NotFoundError):
            other.messages.create(**ask)
        with pytest.raises(anthropic.NotFoundError):
            other.messages.count_tokens(model="mine", messages=ask["messages"])
    with openai.OpenAI(base_url=f"{lora.url}/v1", api_key=B, max_retries=0,
                       default_headers={"x-tenant": key_hash(A)}) as client:
        assert "mine" not in {m.id for m in client.models.list()}
    resp = httpx.post(f"{lora.url}/v1/unload_lora_adapter", json={"lora_name": "mine"},
                      headers=auth(B, key_hash(A)))
    assert (resp.status_code, resp.json()["error"]["message"]) == (404, "The lora adapter 'mine' cannot be found.")
    with openai.OpenAI(base_url=f"{lora.url}/v1", api_key=OP, max_retries=0) as client:
        assert {m.id: m for m in client.models.list()}["mine"].model_extra["root"] == str(adapters["mine"])
    # An operator removes it over HTTP; then it is gone for its owner too.
    resp = httpx.post(f"{lora.url}/v1/unload_lora_adapter", json={"lora_name": "mine"}, headers=auth(OP))
    assert (resp.status_code, resp.text) == (200, "Success: LoRA adapter 'mine' removed successfully.")
    with anthropic.Anthropic(base_url=lora.url, api_key=A, max_retries=0) as owner:
        with pytest.raises(anthropic.NotFoundError):
            owner.messages.create(**ask)


def test_broken_adapters_fail_their_jobs_and_the_workers_keep_serving(lora, adapters, roots):
    lora.two_workers()
    # A larger base model's adapter: the right files, the wrong shapes (hidden size 256, not 128).
    # (vLLM takes a smaller one's without a word, as part of the layers: not a failure to test.)
    alien = build_tiny_adapter(roots / "ops" / "alien", seed=4)
    generator = torch.Generator().manual_seed(4)
    weights = {k: torch.randn(*((8, 256) if k.endswith("lora_A.weight") else (256, 8)), generator=generator)
               for k in load_file(alien / "adapter_model.safetensors")}
    save_file(weights, str(alien / "adapter_model.safetensors"))
    register(lora, "alien", alien, load_inplace=True)
    register(lora, "hub", "nobody/no-such-lora", load_inplace=True)  # listed, but no network here: its download fails
    # Swapped for a link out of the roots after its registration: the worker itself refuses it.
    swapped = roots / "ops" / "swapped"
    shutil.copytree(adapters["a1"], swapped)
    register(lora, "swapped", swapped, load_inplace=True)
    outside = build_tiny_adapter(roots.parent / f"{roots.name}-outside", seed=5)
    shutil.rmtree(swapped)
    os.symlink(outside, swapped)
    # A directory the API cannot resolve under a root is refused at registration, naming nothing.
    resp = load(lora, "gone", roots / "ops" / "only-on-the-workers", load_inplace=True)
    assert (resp.status_code, resp.json()["error"]["message"]) == (400, REFUSED)
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 8}}
    with httpx.Client(timeout=120, headers=auth(A)) as client:
        for name in ("alien", "hub", "swapped"):
            # LMI answers a job that failed after it was accepted with its 424.
            resp = client.post(f"{lora.url}/invocations", json={**body, "adapters": name})
            assert resp.status_code == 424, (name, resp.text)
            assert resp.json()["error"].startswith(f"The LoRA adapter '{name}' could not be loaded: "), resp.text
        assert resp.json()["error"] == ("The LoRA adapter 'swapped' could not be loaded: its source is not one this "
                                        "deployment allows (LLMQ_ADAPTER_ROOTS, LLMQ_ADAPTER_HUB_ALLOW)")
    with openai.OpenAI(base_url=f"{lora.url}/v1", api_key=A, max_retries=0, timeout=120) as sdk:
        with pytest.raises(openai.BadRequestError, match="The LoRA adapter 'hub' could not be loaded"):
            sdk.completions.create(model="hub", prompt=PROMPT, max_tokens=4)
    with httpx.Client(timeout=120, headers=auth(A)) as client:
        # The same workers still serve the base model and a good adapter, streaming too.
        assert client.post(f"{lora.url}/invocations", json=body).status_code == 200
        register(lora, "a1", adapters["a1"], load_inplace=True)
        resp = client.post(f"{lora.url}/invocations", json={**body, "adapters": "a1", "stream": True})
        assert resp.status_code == 200 and len(resp.text.splitlines()) == 8
    assert all(p.poll() is None for p, log in lora.procs if log.name.startswith("worker"))


def test_sigkill_mid_stream_of_an_adapter_job_continues_exactly_on_a_peer(lora, adapters, figures, monkeypatch):
    register(lora, "a2", adapters["a2"], load_inplace=True)
    body = {"model": "a2", "prompt": PROMPT, "max_tokens": 160, "temperature": 0, "ignore_eos": True}
    # compare_completions (tests/support/crash_stack.py) sends no key: its clients send tenant A's.
    # Only around it: the SDKs check their clients against httpx.Client itself.
    with monkeypatch.context() as patched:
        patched.setattr(httpx, "Client", functools.partial(httpx.Client, headers=auth(A)))
        want, got = compare_completions(lora, body, figures)
    assert len(got.tokens[0]) == 160
    # The successor ran the job with the adapter: its tokens are the adapter's, not the base model's.
    with openai.OpenAI(base_url=f"{lora.url}/v1", api_key=A, max_retries=0, timeout=120) as client:
        base = client.completions.create(model=lora.model, prompt=PROMPT, max_tokens=160, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert base.choices[0].text != got.text[0]


def test_the_engine_holds_at_most_max_loras_and_evicts_the_least_recently_used(lora, adapters):
    """Three adapters through workers that hold two: every answer stays each adapter's own."""
    for name in ("a1", "a2", "a3"):
        register(lora, name, adapters[name], load_inplace=True)
    lora.two_workers()
    with openai.OpenAI(base_url=f"{lora.url}/v1", api_key=A, max_retries=0, timeout=120) as client:
        first = {name: greedy(client, name)[0] for name in ("a1", "a2", "a3")}
        again = {name: greedy(client, name)[0] for name in ("a3", "a1", "a2")}
    assert first == again and len(set(first.values())) == 3
