"""The tiny pooling models (workers/tiny_pooling.py) served by real vLLM as llmq's worker serves them
(workers/engine.py, workers/pooling.py, the engine loop's ``pool``): an embedder's vectors and a
cross-encoder's scores, checked against what vLLM's own ``LLM`` makes of the same inputs in
llmq-independent ways (unit length, equal inputs equal vectors, token ids as text, a Matryoshka
cut normalised again, the sigmoid of the raw score), and the requests a pooling worker refuses."""

from __future__ import annotations

import gc
import math
import os
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest

pytest.importorskip("vllm")  # the engine tier: collected everywhere, run where a worker extra is installed

from shared.config import EMBED_MODEL, RERANK_MODEL, load_settings
from shared.errors import InvalidRequest
from shared.schemas import GenerationRequest, Pooling
from workers.environment import apply_engine_environment
from workers.protocol import Step
from workers.tiny_pooling import build_tiny_embed, build_tiny_rerank, ensure_tiny_pooling

pytestmark = [pytest.mark.engine, pytest.mark.filterwarnings("ignore:Unclosed context:ResourceWarning")]


async def _engine(model: str):
    from workers.engine import VllmEngine

    # Asked for vLLM's AsyncLLM front: a pooling model is read by llmq's loop whatever this says.
    settings = load_settings({"LLMQ_MODEL": model, "LLMQ_MAX_MODEL_LEN": "64", "LLMQ_ENGINE_FRONT": "asyncllm"})
    ensure_tiny_pooling(model, Path(settings.model_path))
    with pytest.MonkeyPatch.context() as env:
        environ = dict(os.environ)
        apply_engine_environment(settings, environ)
        for name, value in environ.items():
            env.setenv(name, value)
        return VllmEngine.build(settings, settings.model_path)


def close(engine) -> None:
    """Shut the engine down, and its zmq context with it: vLLM 0.32 leaves the context to the
    collector, which may run at the session's end, past this module's warning filter."""
    context = engine.engine.engine_core.resources.ctx
    engine.shutdown()
    context.destroy(linger=0)
    gc.collect()


@pytest.fixture(scope="module")
async def embedder() -> AsyncIterator[object]:
    engine = await _engine(EMBED_MODEL)
    try:
        yield engine
    finally:
        close(engine)


@pytest.fixture(scope="module")
async def reranker() -> AsyncIterator[object]:
    engine = await _engine(RERANK_MODEL)
    try:
        yield engine
    finally:
        close(engine)


async def pooled(engine, pooling: Pooling, job_id: str = "j") -> Step:
    steps: list[Step] = []
    await engine.run(job_id, GenerationRequest(pooling=pooling), on_step=steps.append)
    (step,) = steps
    assert step.finished and step.deltas == [] and step.pooled is not None
    return step


def norm(row: list[float]) -> float:
    return math.sqrt(sum(x * x for x in row))


async def test_embeddings_are_unit_vectors_equal_for_equal_inputs_and_token_ids_read_as_their_text(embedder):
    step = await pooled(embedder, Pooling(task="embed", texts=["the cat", "a dog é", "the cat"]))
    rows = step.pooled.rows()
    assert [len(r) for r in rows] == [64, 64, 64] and step.pooled.width == 64
    assert all(abs(norm(r) - 1) < 1e-5 for r in rows)
    assert all(abs(a - b) <= 1e-5 for a, b in zip(rows[0], rows[2], strict=True))
    assert max(abs(a - b) for a, b in zip(rows[0], rows[1], strict=True)) > 1e-3
    ids = embedder.tokenizer("the cat")["input_ids"]
    assert step.prompt_tokens == 2 * len(ids) + len(embedder.tokenizer("a dog é")["input_ids"])
    by_ids = (await pooled(embedder, Pooling(task="embed", token_ids=[ids]))).pooled.rows()[0]
    assert all(abs(a - b) <= 1e-5 for a, b in zip(rows[0], by_ids, strict=True))


async def test_a_matryoshka_cut_is_the_vectors_first_components_normalised_again(embedder):
    whole = (await pooled(embedder, Pooling(task="embed", texts=["a sentence"]))).pooled.rows()[0]
    cut = (await pooled(embedder, Pooling(task="embed", texts=["a sentence"], dimensions=16))).pooled.rows()[0]
    assert len(cut) == 16 and abs(norm(cut) - 1) < 1e-5
    first = norm(whole[:16])
    assert all(abs(c - w / first) < 1e-4 for c, w in zip(cut, whole[:16], strict=True))
    raw = (await pooled(embedder, Pooling(task="embed", texts=["a sentence"], activation=False))).pooled.rows()[0]
    assert abs(norm(raw) - 1) > 1e-3  # not normalised
    assert all(abs(w - r / norm(raw)) < 1e-4 for w, r in zip(whole, raw, strict=True))


async def test_what_a_pooling_worker_refuses_is_the_requests_400(embedder):
    with pytest.raises(InvalidRequest, match="dimensions"):
        await pooled(embedder, Pooling(task="embed", texts=["x"], dimensions=20))  # not one of 16, 32, 64
    with pytest.raises(InvalidRequest, match="input 1 has .* tokens, more than the model's context of 64"):
        await pooled(embedder, Pooling(task="embed", texts=["short", "long " * 80]))
    cut = await pooled(embedder, Pooling(task="embed", texts=["long " * 80], truncate=True))
    assert cut.prompt_tokens == 64
    with pytest.raises(InvalidRequest, match="this model makes embeddings: it does not generate text"):
        await embedder.run("g", GenerationRequest(prompt="hello"), on_step=lambda step: None)
    with pytest.raises(InvalidRequest, match="this model makes embeddings: it does not generate text"):
        await pooled(embedder, Pooling(task="score", texts=["d"], queries=["q"]))


async def test_scores_are_the_sigmoid_of_the_cross_encoders_logit_per_pair(reranker):
    docs = ["paris is the capital", "bananas are yellow", "x"]
    asked = Pooling(task="score", texts=docs, queries=["capital?"])
    scores = [r[0] for r in (await pooled(reranker, asked)).pooled.rows()]
    raw = [r[0] for r in (await pooled(reranker, msgspec.structs.replace(asked, activation=False))).pooled.rows()]
    assert all(0 < s < 1 for s in scores) and len(set(scores)) == 3
    assert all(abs(s - 1 / (1 + math.exp(-r))) < 1e-5 for s, r in zip(scores, raw, strict=True))
    # One query per document scores the same pairs.
    pairs = await pooled(reranker, Pooling(task="score", texts=docs, queries=["capital?"] * 3))
    assert [r[0] for r in pairs.pooled.rows()] == pytest.approx(scores, abs=1e-6)


def test_a_pairs_document_is_of_token_type_1_from_where_it_starts(tmp_path: Path):
    from transformers import AutoTokenizer

    from workers.pooling import pooling_inputs

    tokenizer = AutoTokenizer.from_pretrained(build_tiny_rerank(tmp_path / "rerank"))
    [(prompt, params)] = pooling_inputs(tokenizer, Pooling(task="score", texts=["doc text"], queries=["q"]), 64)
    query = tokenizer("q")["input_ids"]  # <s> q </s>
    assert prompt["prompt_token_ids"][:len(query)] == query
    assert params.task == "classify" and params.extra_kwargs == {"compressed_token_type_ids": len(query)}


def test_the_builds_are_byte_identical(tmp_path: Path):
    for build in (build_tiny_embed, build_tiny_rerank):
        one, two = build(tmp_path / f"{build.__name__}-1"), build(tmp_path / f"{build.__name__}-2")
        assert sorted(p.name for p in one.iterdir()) == sorted(p.name for p in two.iterdir())
        assert all((one / p.name).read_bytes() == (two / p.name).read_bytes() for p in one.iterdir())
