"""Embeddings on real vLLM (issue 47): two workers serve ``tiny-embed`` (a random-weight Llama built
offline, vLLM's pooling runner) behind one API, and the openai SDK asks as it asks: base64 by
default, floats when told, a list of inputs, token ids, a Matryoshka ``dimensions``; fired and
polled; and the 400s of a request the model cannot serve."""

from __future__ import annotations

import json
import math
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from shared.config import EMBED_MODEL, load_settings
from tests.support.background import housekeeping
from tests.support.crash_stack import Small, small_stack

pytestmark = [pytest.mark.e2e]

MODEL = EMBED_MODEL


@pytest.fixture(scope="module")
def small(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Small]:
    logs = tmp_path_factory.mktemp("embed-logs")
    with small_stack(redis_url, logs, f"emb-{uuid.uuid4().hex[:6]}", LLMQ_MODEL=MODEL,
                     LLMQ_MAX_MODEL_LEN="128") as stack:
        stack.model = MODEL
        yield stack


@pytest.fixture(scope="module")
def oai(small: Small) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{small.url}/v1", api_key="x", max_retries=0, timeout=120) as client:
        yield client


def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(Path(load_settings({**os.environ, "LLMQ_MODEL": MODEL}).model_path))


def test_the_sdks_base64_and_floats_are_the_same_float32_bits(oai: openai.OpenAI, small: Small):
    inputs = ["the cat sat", "a dog é", "the cat sat"]
    # The SDK asks for base64 when not told, and decodes it with numpy: what its user sees.
    default = oai.embeddings.create(model=MODEL, input=inputs)
    raw = httpx.post(f"{small.url}/v1/embeddings", json={"model": MODEL, "input": inputs}, timeout=60).json()
    as_floats = oai.embeddings.create(model=MODEL, input=inputs, encoding_format="float")
    assert [d.index for d in default.data] == [0, 1, 2] and default.model == MODEL
    for d, f, r in zip(default.data, as_floats.data, raw["data"], strict=True):
        assert len(d.embedding) == 64
        assert np.array(d.embedding, dtype="<f4").tobytes() == np.array(f.embedding, dtype="<f4").tobytes()
        assert np.array(r["embedding"], dtype="<f4").tobytes() == np.array(f.embedding, dtype="<f4").tobytes()
        assert abs(math.sqrt(sum(x * x for x in f.embedding)) - 1) < 1e-5
    one, other, same = (np.array(d.embedding) for d in as_floats.data)
    assert np.max(np.abs(one - same)) <= 1e-5 and np.max(np.abs(one - other)) > 1e-3
    ids = tokenizer()(inputs)["input_ids"]
    assert default.usage.prompt_tokens == default.usage.total_tokens == sum(len(i) for i in ids)


def test_token_ids_embed_as_their_text_and_dimensions_cut_a_matryoshka_vector(oai: openai.OpenAI):
    text = "a sentence to embed"
    ids = tokenizer()(text)["input_ids"]
    by_text = np.array(oai.embeddings.create(model=MODEL, input=text, encoding_format="float").data[0].embedding)
    by_ids = oai.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    assert np.max(np.abs(by_text - np.array(by_ids.data[0].embedding))) <= 1e-5
    both = oai.embeddings.create(model=MODEL, input=[ids, ids[:3]], encoding_format="float")
    assert len(both.data) == 2 and both.usage.prompt_tokens == len(ids) + 3
    cut = np.array(oai.embeddings.create(model=MODEL, input=text, dimensions=16).data[0].embedding)
    assert cut.shape == (16,) and abs(np.linalg.norm(cut) - 1) < 1e-5
    assert np.max(np.abs(cut - by_text[:16] / np.linalg.norm(by_text[:16]))) < 1e-4


def test_an_embeddings_job_fired_and_polled(small: Small):
    with httpx.Client(base_url=small.url, timeout=60) as client:
        fired = client.post("/v1/embeddings", json={"model": MODEL, "input": ["x", "y"], "encoding_format": "float"},
                            headers={"Prefer": "respond-async"})
        assert fired.status_code == 202, fired.text
        deadline = time.monotonic() + 60
        while (view := client.get(fired.headers["location"]).json())["status"] != "done":
            assert time.monotonic() < deadline and view["status"] in ("queued", "running"), view
            time.sleep(0.1)
    assert [len(d["embedding"]) for d in view["result"]["data"]] == [64, 64]


def test_what_the_model_cannot_serve_is_openais_400(oai: openai.OpenAI):
    with pytest.raises(openai.BadRequestError, match="makes embeddings: it does not generate text"):
        oai.completions.create(model=MODEL, prompt="hello", max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        oai.embeddings.create(model=MODEL, input="x", dimensions=20)  # not one of its 16, 32, 64
    with pytest.raises(openai.BadRequestError, match="more than the model's context of 128"):
        oai.embeddings.create(model=MODEL, input="long " * 200)
    with pytest.raises(openai.BadRequestError, match="'input' must not be empty"):
        oai.embeddings.create(model=MODEL, input=[])


def _jsonl(lines: list[dict]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def test_a_thousand_line_batch_answers_every_line_once_through_a_worker_killed_mid_way(
        small: Small, oai: openai.OpenAI, tmp_path: Path):
    """Last in this module: it leaves one worker."""
    lines = [{"custom_id": f"l{i}", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": MODEL, "input": [f"line {i}", "the same text"], "encoding_format": "float"}}
             for i in range(1000)]
    with housekeeping(small.env["LLMQ_REDIS_URL"], small.prefix, tmp_path, served_model_name=MODEL, batch_rate="200"):
        upload = oai.files.create(file=("index.jsonl", _jsonl(lines)), purpose="batch")
        batch = oai.batches.create(input_file_id=upload.id, endpoint="/v1/embeddings", completion_window="24h")
        deadline = time.monotonic() + 600
        while (seen := oai.batches.retrieve(batch.id)).request_counts.completed < 200:
            assert time.monotonic() < deadline and seen.status == "in_progress", seen
            time.sleep(0.2)
        [victim, *_] = sorted(small.ready_pids())
        os.kill(victim, signal.SIGKILL)
        while (done := oai.batches.retrieve(batch.id)).status not in ("completed", "failed"):
            assert time.monotonic() < deadline, done
            time.sleep(0.5)
    assert done.status == "completed" and done.request_counts.completed == 1000, done
    assert done.request_counts.failed == 0 and not done.error_file_id
    output = [json.loads(line) for line in oai.files.content(done.output_file_id).text.splitlines()]
    assert sorted(line["custom_id"] for line in output) == sorted(f"l{i}" for i in range(1000))  # each once
    same = np.array([line["response"]["body"]["data"][1]["embedding"] for line in output])
    assert np.max(np.abs(same - same[0])) <= 1e-5  # "the same text" alike on either worker, before and after the kill
    assert all(line["response"]["status_code"] == 200 and len(line["response"]["body"]["data"]) == 2
               for line in output)
