"""A second kind of job on the same queue (issue 47): pooling jobs (embeddings) beside generations.
The API refuses a job its model does not make with the dialect's 400, by the kind each model's
workers report (shared/media.py ModelInfo); ``/v1/models`` says each model's kind; and a pooling job
runs through the queue as any job does (here on the scripted engine, which pools a scripted vector
per input): answered whole, or fired and polled, rendered in OpenAI's embeddings shape."""

from __future__ import annotations

import asyncio
import base64
import struct
import uuid

import msgspec
import pytest

from shared.keys import Keys
from shared.media import ModelInfo
from tests.support.scripted_stack import scripted_stack


@pytest.fixture(scope="module")
async def stack(redis_url):
    # "tiny" is the scripted worker's (it says nothing of its kind: a generator, LLMQ_MODEL's own).
    async with scripted_stack(redis_url, f"kinds-{uuid.uuid4().hex[:6]}", models="embedder,reranker") as s:
        await s.redis.hset(Keys(s.settings.prefix).model_info(), mapping={
            "embedder": msgspec.json.encode(ModelInfo(kind="embed")),
            "reranker": msgspec.json.encode(ModelInfo(kind="rerank"))})
        yield s


async def test_models_say_each_models_kind(stack):
    resp = await stack.client.get("/v1/models")
    assert {card["id"]: card["kind"] for card in resp.json()["data"]} == {
        "tiny": "generate", "embedder": "embed", "reranker": "rerank"}


@pytest.mark.parametrize(("path", "body", "does"), [
    ("/v1/embeddings", {"model": "tiny", "input": "x"},
     "generates text: it does not make embeddings or score (query, document) pairs"),
    ("/v1/embeddings", {"model": "reranker", "input": "x"},
     "scores (query, document) pairs: it does not generate text or make embeddings"),
    ("/v1/completions", {"model": "embedder", "prompt": "x"},
     "makes embeddings: it does not generate text or score (query, document) pairs"),
    ("/v1/chat/completions", {"model": "embedder", "messages": [{"role": "user", "content": "x"}]},
     "makes embeddings: it does not generate text or score (query, document) pairs"),
])
async def test_a_job_of_the_wrong_kind_is_the_dialects_400_and_nothing_is_queued(stack, path, body, does):
    keys = Keys(stack.settings.prefix)
    before = {m: await stack.redis.xlen(keys.queue(m)) for m in ("tiny", "embedder", "reranker")}
    resp = await stack.client.post(path, json=body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["message"] == f"this model {does}"
    assert (error["type"], error["param"], error["code"]) == ("BadRequestError", "model", 400)
    assert {m: await stack.redis.xlen(keys.queue(m)) for m in before} == before


async def test_an_embeddings_job_of_a_model_with_no_worker_yet_is_queued(stack):
    resp = await stack.client.post("/v1/embeddings", json={"model": "embedder", "input": ["a"]},
                                   headers={"Prefer": "respond-async"})
    assert resp.status_code == 202, resp.text


def floats(item: dict) -> list[float]:
    return list(item["embedding"]) if isinstance(item["embedding"], list) else \
        list(struct.unpack(f"<{len(base64.b64decode(item['embedding'])) // 4}f", base64.b64decode(item["embedding"])))


async def test_a_pooling_job_runs_through_the_queue_answered_whole_or_polled(redis_url):
    # The scripted worker here pools: its model is an embedder.
    async with scripted_stack(redis_url, f"pool-{uuid.uuid4().hex[:6]}", model_kind="embed",
                              info=ModelInfo(kind="embed")) as s:
        body = {"model": "tiny", "input": ["abc", "de"], "dimensions": 3}
        whole = await s.client.post("/v1/embeddings", json=body)
        assert whole.status_code == 200, whole.text
        answer = whole.json()
        assert answer["object"] == "list" and answer["model"] == "tiny"
        assert [floats(d) for d in answer["data"]] == [[3.0, 1.0, 1.0], [2.0, 1.0, 1.0]]
        assert answer["usage"] == {"prompt_tokens": 5, "total_tokens": 5, "completion_tokens": 0}
        fired = await s.client.post("/v1/embeddings", json={**body, "encoding_format": "base64"},
                                    headers={"Prefer": "respond-async"})
        assert fired.status_code == 202, fired.text
        url = fired.headers["location"]
        for _ in range(200):
            polled = await s.client.get(url)
            if polled.status_code == 200 and polled.json().get("status") == "done":
                break
            await asyncio.sleep(0.05)
        done = polled.json()
        assert [floats(d) for d in done["result"]["data"]] == [[3.0, 1.0, 1.0], [2.0, 1.0, 1.0]]
        assert all(isinstance(d["embedding"], str) for d in done["result"]["data"])
        completion = await s.client.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
        assert completion.status_code == 400 and "makes embeddings" in completion.json()["error"]["message"]


@pytest.fixture(scope="module")
async def ranker(redis_url):
    """A scripted reranker: its worker scores a document by its length (over 8: exact in float32)."""
    async with scripted_stack(redis_url, f"rank-{uuid.uuid4().hex[:6]}", model_kind="rerank",
                              info=ModelInfo(kind="rerank")) as s:
        yield s


DOCS = ["a", "abcd", "ab", "abc"]


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
async def test_vllms_rerank_sorts_best_first_cut_to_top_n(ranker, path):
    resp = await ranker.client.post(path, json={"query": "q", "documents": [*DOCS[:3], {"text": DOCS[3]}],
                                                "top_n": 3})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["id"].startswith("rerank-") and body["model"] == "tiny"
    assert [(r["index"], r["document"]["text"], r["relevance_score"]) for r in body["results"]] == [
        (1, "abcd", 0.5), (3, "abc", 0.375), (2, "ab", 0.25)]
    hidden = (await ranker.client.post(path, json={"query": "q", "documents": DOCS, "return_documents": False})).json()
    assert [list(r) for r in hidden["results"]] == [["index", "relevance_score"]] * 4


async def test_teis_rerank_and_its_errors(ranker):
    resp = await ranker.client.post("/rerank", json={"query": "q", "texts": DOCS, "return_text": True})
    assert resp.status_code == 200, resp.text
    assert resp.json() == [{"index": 1, "text": "abcd", "score": 0.5}, {"index": 3, "text": "abc", "score": 0.375},
                           {"index": 2, "text": "ab", "score": 0.25}, {"index": 0, "text": "a", "score": 0.125}]
    bare = (await ranker.client.post("/rerank", json={"query": "q", "texts": ["ab"]})).json()
    assert bare == [{"index": 0, "score": 0.25}]
    neither = await ranker.client.post("/rerank", json={"query": "q"})
    assert neither.status_code == 422 and neither.json()["error_type"] == "validation"
    assert "`texts`" in neither.json()["error"]
    empty = await ranker.client.post("/rerank", json={"query": "q", "texts": []})
    assert (empty.status_code, empty.json()) == (422, {"error": "`texts` cannot be empty", "error_type": "validation"})
    embed = await ranker.client.post("/embed", json={"inputs": "x", "model": "tiny"})
    assert embed.status_code == 424 and embed.json()["error_type"] == "backend"
    assert embed.json()["error"].startswith("this model scores (query, document) pairs")
    vllm_refused = await ranker.client.post("/rerank", json={"query": "q", "documents": []})
    assert vllm_refused.status_code == 400 and vllm_refused.json()["error"]["param"] == "documents"


@pytest.mark.parametrize(("body", "scores"), [
    ({"text_1": "q", "text_2": ["ab", "abc"]}, [0.25, 0.375]),
    ({"queries": ["q1", "q2"], "documents": ["a", "abcd"]}, [0.125, 0.5]),
    ({"queries": "q", "items": "abc"}, [0.375]),
    ({"data_1": ["q"], "data_2": ["ab"]}, [0.25]),
])
async def test_vllms_score_takes_its_pairs_under_any_of_its_names(ranker, body, scores):
    resp = await ranker.client.post("/score", json=body)
    assert resp.status_code == 200, resp.text
    answer = resp.json()
    assert answer["object"] == "list" and answer["id"].startswith("score-")
    assert [(d["index"], d["object"], d["score"]) for d in answer["data"]] == [
        (i, "score", s) for i, s in enumerate(scores)]


async def test_vllms_score_refuses_sides_that_do_not_pair(ranker):
    uneven = await ranker.client.post("/v1/score", json={"text_1": ["a", "b"], "text_2": ["c", "d", "e"]})
    assert uneven.status_code == 400 and "one text or as many as the second" in uneven.json()["error"]["message"]
    unnamed = await ranker.client.post("/score", json={"left": "a", "right": "b"})
    assert unnamed.status_code == 400 and unnamed.json()["error"]["param"] == "text_1"


async def test_teis_embed_goes_to_the_model_of_its_kind(redis_url):
    async with scripted_stack(redis_url, f"tei-{uuid.uuid4().hex[:6]}", model_kind="embed",
                              info=ModelInfo(kind="embed")) as s:
        resp = await s.client.post("/embed", json={"inputs": ["abc", "d"], "normalize": False})
        assert resp.status_code == 200, resp.text
        assert resp.json() == [[3.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]]
        one = await s.client.post("/embed", json={"inputs": "ab", "dimensions": 2})
        assert one.json() == [[2.0, 1.0]]
        rerank = await s.client.post("/rerank", json={"query": "q", "texts": ["a"]})
        assert rerank.status_code == 404 and rerank.json()["error_type"] == "model_not_found"
