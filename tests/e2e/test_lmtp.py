"""LMTP end to end with LMQL itself (lmql 0.7.3): its WebSocket client class, then real LMQL
queries (constrained, distribution scoring, beam search) against the real vLLM worker.

Nothing is downloaded: LMQL's tokenizer is the tiny model's own directory.
"""

from __future__ import annotations

import asyncio
import json
import math
from urllib.parse import urlparse

import aiohttp
import httpx
import lmql
import pytest
from lmql.models.lmtp.errors import LMTPStreamError
from lmql.models.lmtp.lmtp_client import LMTPWebSocketClient
from redis.asyncio import Redis
from transformers import AutoTokenizer

from shared.codec import job_from_hash
from shared.config import load_settings
from shared.keys import Keys

pytestmark = pytest.mark.e2e

TINY_DIR = load_settings({}).model_path
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TINY_DIR)


def endpoint(stack) -> str:
    return urlparse(stack.url).netloc


async def drive(stack, work):
    """Run ``work(client)`` on LMQL's own client class over one socket, as LMTPDcModel does."""
    async with aiohttp.ClientSession() as session, session.ws_connect(stack.url) as ws:
        client = LMTPWebSocketClient(stack.model, ws)
        client.connect()
        try:
            return await asyncio.wait_for(work(client), 120)
        finally:
            client.handler.cancel()


async def collect(stream) -> list[dict]:
    return [t async for t in stream]


async def test_lmql_client_generate_equals_openai_completion_and_job_view(stack, tokenizer):
    ids = tokenizer(PROMPT)["input_ids"]
    tokens = await drive(stack, lambda c: collect(c.generate(ids, max_tokens=12, temperature=0.0)))
    assert 1 <= len(tokens) <= 12
    assert [t["finish_reason"] for t in tokens[:-1]] == [None] * (len(tokens) - 1)
    assert tokens[-1]["finish_reason"] == ("length" if len(tokens) == 12 else "stop")
    for t in tokens:  # top-1 plus the sampled token; greedy: they are the same token
        assert t["top_logprobs"] == {str(t["token"]): t["logprob"]}
    async with httpx.AsyncClient(timeout=60) as http:
        body = {"model": stack.model, "prompt": ids, "max_tokens": 12, "temperature": 0, "logprobs": 0}
        resp = await http.post(f"{stack.url}/v1/completions", json=body)
    choice = resp.json()["choices"][0]
    assert tokenizer.decode([t["token"] for t in tokens], skip_special_tokens=True) == choice["text"]
    assert [t["logprob"] for t in tokens] == pytest.approx(choice["logprobs"]["token_logprobs"], abs=1e-4)
    # The same job through GET /v1/jobs/{id}: LMTP's payloads without the stream id.
    record = await find_job(
        stack,
        lambda r: (
            r.request.dialect == "lmtp" and r.request.prompt_token_ids == ids and r.request.sampling.max_tokens == 12
        ),
    )
    async with httpx.AsyncClient(timeout=60) as http:
        view = (await http.get(f"{stack.url}/v1/jobs/{record.id}")).json()
    assert view["status"] == "done" and view["dialect"] == "lmtp"
    assert view["result"] == [{k: t[k] for k in ("token", "logprob", "finish_reason")} for t in tokens]


async def test_lmql_client_score_matches_generation_logprobs(stack, tokenizer):
    ids = tokenizer(PROMPT)["input_ids"]

    async def work(client):
        generated = await collect(client.generate(ids, max_tokens=6, temperature=0.0))
        scored = await collect(client.score(ids, [t["token"] for t in generated]))
        return generated, scored

    generated, scored = await drive(stack, work)
    assert [s["token"] for s in scored] == [g["token"] for g in generated]
    assert [s["finish_reason"] for s in scored] == [None] * (len(scored) - 1) + ["stop"]
    assert all("top_logprobs" not in s for s in scored)
    # One model, two code paths (sampling logprobs vs prompt logprobs): the same numbers.
    assert [s["logprob"] for s in scored] == pytest.approx([g["logprob"] for g in generated], abs=1e-3)


async def test_lmql_client_model_info_and_unknown_model_error(stack):
    info = await drive(stack, lambda c: c.request("MODEL_INFO", {"model": stack.model}))
    assert info["model_info"]["model"] == stack.model
    assert info["model_info"]["ready_workers"] >= 1

    async def unknown(client):
        client.model_identifier = "no-such-model"
        with pytest.raises(LMTPStreamError, match="no-such-model"):
            await collect(client.generate([1, 2, 3], max_tokens=2))

    await drive(stack, unknown)


async def test_lmql_client_masks_are_honoured(stack, tokenizer):
    ids = tokenizer(PROMPT)["input_ids"]
    allowed = tokenizer.convert_tokens_to_ids(list("xyz"))

    async def work(client):
        free = await collect(client.generate(ids, max_tokens=1))
        # LMQL's allow mask: +100 on the allowed set
        only = await collect(client.generate(ids, max_tokens=8, logit_bias={t: 100 for t in allowed}, top_logprobs=3))
        # LMQL's deny mask: -100 on the banned set (here: the greedy choice and EOS)
        banned = [free[0]["token"], tokenizer.eos_token_id]
        other = await collect(client.generate(ids, max_tokens=4, logit_bias={t: -100 for t in banned}))
        # vLLM reports logprobs from before the bias: the masked pick scores as it would unmasked
        scored = await collect(client.score(ids, [only[0]["token"]]))
        return only, banned, other, scored

    only, banned, other, scored = await drive(stack, work)
    assert scored[0]["logprob"] == pytest.approx(only[0]["logprob"], abs=1e-4)
    assert len(only) == 8 and all(t["token"] in allowed for t in only)
    for t in only:  # no masked token among the alternatives, and the sampled token ranks first
        assert {int(k) for k in t["top_logprobs"]} <= set(allowed)
        assert max(t["top_logprobs"].values()) == t["logprob"]
    assert len(other) == 4 and not {t["token"] for t in other} & set(banned)


def as_list(result) -> list:
    """LMQL returns a list of results or a bare one, depending on the decoder and the query."""
    return result if isinstance(result, list) else [result]


@pytest.fixture(scope="module")
def lmql_model(stack):
    return lmql.model(stack.model, endpoint=endpoint(stack), tokenizer=TINY_DIR)


async def test_lmql_query_choice_constraint(lmql_model):
    result = await lmql.run('"Is the sky blue? Answer: [ANSWER]" where ANSWER in ["yes", "no"]', model=lmql_model)
    assert result.variables["ANSWER"] in ("yes", "no")
    assert result.prompt == "Is the sky blue? Answer: " + result.variables["ANSWER"]


async def test_lmql_query_int_stops_at_and_token_length(lmql_model, tokenizer):
    result = await lmql.run('"Count: [N]" where INT(N)', model=lmql_model)
    assert isinstance(result.variables["N"], int)
    result = await lmql.run('"Story: [LINE]" where STOPS_AT(LINE, ".") and len(TOKENS(LINE)) < 6', model=lmql_model)
    line = result.variables["LINE"]
    assert "." not in line[:-1]  # generation stopped at the first "."
    # At most 5 tokens. Re-tokenising the text is no count (a token may be half a UTF-8
    # character, printed as U+FFFD), so bound the length by the longest token instead.
    longest = max(len(tokenizer.decode([i])) for i in range(len(tokenizer)))
    assert len(line) <= 5 * longest
    result = await lmql.run('"Say: [WORD]" where not "e" in WORD and len(TOKENS(WORD)) < 5', model=lmql_model)
    assert "e" not in result.variables["WORD"]


async def test_lmql_distribution_scores_over_lmtp(lmql_model):
    """``distribution`` scores every value with SCORE; the probabilities must be a distribution.
    (W is there because LMQL 0.7.3 skips the distribution step when nothing is generated.)"""
    query = '"Say: [W] Pick: [C]" where len(TOKENS(W)) < 3 distribution C in ["red", "green", "blue"]'
    [result] = as_list(await lmql.run(query, model=lmql_model))
    dist = dict(result.variables["P(C)"])
    assert set(dist) == {"red", "green", "blue"}
    assert math.isclose(sum(dist.values()), 1.0, abs_tol=1e-4)
    assert result.variables["C"] == max(dist, key=dist.get)
    assert result.prompt.endswith(" Pick: " + result.variables["C"])


async def test_lmql_beam_search_respects_the_constraint(lmql_model):
    """Beam search asks for top_logprobs=n under the mask and turns them into beams. vLLM's
    logprobs are from before the bias, so masked tokens must be dropped from them: without that,
    this query returned A = '\ufffd' and ' given', and the INT query crashed in LMQL."""
    results = as_list(await lmql.run('beam(n=2) "Answer: [A]" where A in ["yes", "no", "maybe"]', model=lmql_model))
    assert results and all(r.variables["A"] in ("yes", "no", "maybe") for r in results)
    results = as_list(await lmql.run('beam(n=2) "Count: [N]" where INT(N)', model=lmql_model))
    assert results and all(isinstance(r.variables["N"], int) for r in results)
    results = as_list(
        await lmql.run('beam(n=3) "Word: [A]" where len(TOKENS(A)) < 4 and not "e" in A', model=lmql_model)
    )
    assert results and all("e" not in r.variables["A"] for r in results)


async def find_job(stack, match):
    """The newest job record that ``match`` accepts (the test knows its prompt, not its id)."""
    redis = Redis.from_url(stack.redis_url)
    try:
        found = None
        async for key in redis.scan_iter(match=Keys(stack.prefix).job(stack.model, "*")):
            record = job_from_hash(await redis.hgetall(key))
            if match(record) and (found is None or record.queued_at > found.queued_at):
                found = record
        return found
    finally:
        await redis.aclose()


async def test_closing_the_socket_cancels_the_running_job(stack, tokenizer):
    ids = tokenizer("cancel me when the socket closes")["input_ids"]
    no_eos = {str(tokenizer.eos_token_id): -100}  # keep it generating until it is cancelled
    async with aiohttp.ClientSession() as session, session.ws_connect(stack.url) as ws:
        payload = {"model": stack.model, "prompt": ids, "stream_id": 1, "max_tokens": 1000, "logit_bias": no_eos}
        await ws.send_str("GENERATE " + json.dumps(payload))
        first = json.loads((await asyncio.wait_for(ws.receive_str(), 60)).partition(" ")[2])[0]
        assert first["stream_id"] == 1 and first["finish_reason"] is None
    record = None
    for _ in range(300):
        record = await find_job(stack, lambda r: r.request.prompt_token_ids == ids)
        if record is not None and record.status in ("cancelled", "done", "failed"):
            break
        await asyncio.sleep(0.1)
    assert record is not None and record.status == "cancelled", record
    assert record.error is not None and record.error.code == "cancelled"
