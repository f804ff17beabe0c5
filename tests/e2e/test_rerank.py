"""Rerank and score on real vLLM (issue 47): two workers serve ``tiny-rerank`` (a random BERT
cross-encoder built offline, vLLM's pooling runner) behind one API, called as Cohere's, Jina's, vLLM's
and TEI's clients call them, over httpx: the scores vLLM's cross-encoder gives, sorted, cut, with
or without their documents, in each shape."""

from __future__ import annotations

import math
import uuid
from collections.abc import Iterator

import httpx
import pytest

from shared.config import RERANK_MODEL
from tests.support.crash_stack import Small, small_stack

pytestmark = [pytest.mark.e2e]

MODEL = RERANK_MODEL
DOCS = ["paris is the capital of france", "bananas are yellow", "the capital city", "x"]


@pytest.fixture(scope="module")
def small(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Small]:
    logs = tmp_path_factory.mktemp("rerank-logs")
    with small_stack(redis_url, logs, f"rr-{uuid.uuid4().hex[:6]}", LLMQ_MODEL=MODEL,
                     LLMQ_MAX_MODEL_LEN="128") as stack:
        stack.model = MODEL
        yield stack


@pytest.fixture(scope="module")
def client(small: Small) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=small.url, timeout=120) as c:
        yield c


def test_every_shape_ranks_the_same_scores(client: httpx.Client):
    score = client.post("/score", json={"text_1": "capital?", "text_2": DOCS}).json()
    scores = [d["score"] for d in score["data"]]
    assert [d["index"] for d in score["data"]] == [0, 1, 2, 3] and all(0 < s < 1 for s in scores)
    assert min(abs(a - b) for a in scores for b in scores if a != b) > 1e-3  # a ranking no noise reorders
    order = sorted(range(len(DOCS)), key=lambda i: -scores[i])
    cohere = client.post("/v2/rerank", json={"model": MODEL, "query": "capital?", "documents": DOCS, "top_n": 2,
                                             "return_documents": False}).json()
    # A score may move in its last float32 bits with the batch it ran in: compared within 1e-5.
    assert [r["index"] for r in cohere["results"]] == order[:2]
    assert [r["relevance_score"] for r in cohere["results"]] == pytest.approx([scores[i] for i in order[:2]], abs=1e-5)
    assert all("document" not in r for r in cohere["results"])
    jina = client.post("/v1/rerank", json={"query": "capital?", "documents": [{"text": d} for d in DOCS]}).json()
    assert [(r["index"], r["document"]["text"]) for r in jina["results"]] == [(i, DOCS[i]) for i in order]
    assert jina["usage"]["total_tokens"] == score["usage"]["total_tokens"] > 4 * 3
    tei = client.post("/rerank", json={"query": "capital?", "texts": DOCS, "return_text": True}).json()
    assert [(r["index"], r["text"]) for r in tei] == [(i, DOCS[i]) for i in order]
    assert [r["score"] for r in tei] == pytest.approx([scores[i] for i in order], abs=1e-5)
    raw = client.post("/rerank", json={"query": "capital?", "texts": DOCS, "raw_scores": True}).json()
    assert all(abs(1 / (1 + math.exp(-r["score"])) - scores[r["index"]]) < 1e-5 for r in raw)


def test_pairwise_scores_equal_the_one_query_scores(client: httpx.Client):
    one = client.post("/score", json={"queries": "capital?", "documents": DOCS[:2]}).json()
    pairwise = client.post("/score", json={"data_1": ["capital?", "capital?"], "data_2": DOCS[:2]}).json()
    assert [d["score"] for d in pairwise["data"]] == pytest.approx([d["score"] for d in one["data"]], abs=1e-6)


def test_what_a_reranker_refuses(client: httpx.Client):
    embed = client.post("/embed", json={"inputs": "x"})
    assert embed.status_code == 404 and embed.json()["error_type"] == "model_not_found"  # no embedder here
    named = client.post("/embed", json={"inputs": "x", "model": MODEL})
    assert named.status_code == 424 and named.json()["error_type"] == "backend"
    long = client.post("/rerank", json={"query": "q", "texts": ["word " * 300]})
    assert long.status_code == 422 and "more than the model's context of 128" in long.json()["error"]
    cut = client.post("/rerank", json={"query": "q", "texts": ["word " * 300], "truncate": True})
    assert cut.status_code == 200 and len(cut.json()) == 1
    neither = client.post("/rerank", json={"query": "q", "items": ["a"]})
    assert neither.status_code == 422 and neither.json()["error_type"] == "validation"
