"""Webhook destinations are restricted (SSRF): ``POST /v1/jobs`` refuses an internal destination
with 400, and the housekeeper checks again after its own DNS lookup and connects to the address it
checked, so a name that resolves elsewhere by delivery time (DNS rebinding) reaches nothing.

Real Redis, the real API on a port, the worker loop with a scripted engine, the real
``python -m workers.housekeeping`` process, real local receivers, and real name resolution
(``localhost`` through /etc/hosts; ``.invalid`` names never resolve, RFC 6761).
"""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest
import trustme

from shared.keys import Keys
from shared.webhooks import verify
from tests.support.background import housekeeping
from tests.support.scripted_stack import scripted_stack
from tests.support.waiting import eventually, job_status
from tests.support.webhook_receiver import SECRET, receiver

# Public, never contacted: no housekeeper runs while a job carries it.
PUBLIC_HOOK = "http://93.184.215.14/hook"
# Every address localhost may resolve to, so the name passes through its addresses alone.
LOOPBACK_CIDRS = "127.0.0.0/8,::1/128"


@pytest.mark.parametrize(("allow", "webhook", "why"), [
    ("", "http://127.0.0.1:9/hook", "127.0.0.1 is a loopback address"),
    ("", "http://[::ffff:127.0.0.1]:9/hook", "loopback"),
    ("", "http://2130706433:9/hook", "loopback"),
    ("", "http://public.example@127.0.0.1:9/hook", "loopback"),
    ("", "http://localhost:9/hook", "localhost is a local or cloud-metadata name"),
    ("", "http://10.0.0.1/hook", "private"),
    ("", "http://192.168.1.20:8080/hook", "private"),
    ("", "http://169.254.10.10/hook", "link-local"),
    ("", "http://[fe80::1]/hook", "link-local"),
    ("", "http://169.254.169.254/latest/meta-data/", "cloud metadata"),
    ("", "http://metadata.google.internal/computeMetadata/v1/", "local or cloud-metadata name"),
    ("", "http://0177.0.0.1/hook", "not a valid URL"),
    # localhost is not listed, so its addresses decide: a real lookup through /etc/hosts
    ("192.0.2.0/24", "http://localhost:9/hook", "localhost resolves to an address outside LLMQ_WEBHOOK_ALLOW"),
    ("192.0.2.0/24", PUBLIC_HOOK, "outside LLMQ_WEBHOOK_ALLOW"),
])
async def test_a_webhook_to_a_refused_destination_is_a_400(redis_url, prefix, allow, webhook, why):
    async with scripted_stack(redis_url, prefix, webhook_secret=SECRET, webhook_allow=allow) as s:
        resp = await s.client.post("/v1/jobs", json={"prompt": "hi", "webhook": webhook})
        assert resp.status_code == 400, resp.text
        error = msgspec.json.decode(resp.content)["error"]
        assert error["param"] == "webhook" and error["code"] == "invalid_request"
        assert why in error["message"], error
        if "localhost" in webhook:
            assert "127.0.0.1" not in error["message"] and "::1" not in error["message"]  # no lookup result leaks
        assert await s.redis.xlen(Keys(prefix).queue("tiny")) == 0
        assert await s.redis.keys(f"{prefix}*job:*") == []


@pytest.mark.parametrize(("allow", "webhook"), [
    ("", PUBLIC_HOOK),
    ("", "https://hooks.example.invalid/hook"),  # no address now: accepted, the delivery decides
    (LOOPBACK_CIDRS, "http://localhost:9/hook"),  # allowed by the addresses it really resolves to
    ("localhost", "http://LOCALHOST.:9/hook"),  # a listed name, any case, trailing dot
])
async def test_a_webhook_to_an_allowed_destination_is_queued(redis_url, prefix, allow, webhook):
    async with scripted_stack(redis_url, prefix, webhook_secret=SECRET, webhook_allow=allow) as s:
        resp = await s.client.post("/v1/jobs", json={"prompt": "hi", "sampling": {"max_tokens": 2}, "webhook": webhook})
        assert resp.status_code == 202, resp.text
        job_id = resp.json()["id"]
        assert await s.redis.hget(Keys(prefix).job("tiny", job_id), "webhook") == webhook.encode()


async def _webhook_status(redis, prefix: str, job_id: str, timeout_s: float = 30) -> bytes:
    return await eventually(lambda: redis.hget(Keys(prefix).job("tiny", job_id), "webhook_status"),
                            timeout_s=timeout_s, what=f"job {job_id}'s webhook outcome")


@pytest.mark.parametrize(("allow", "outcome"), [
    ("", b"failed"),  # refused by name
    ("192.0.2.0/24", b"failed"),  # refused by the addresses the housekeeper's own lookup returns
    ("localhost", b"delivered"),  # controls: the same receiver, allowed by name...
    (LOOPBACK_CIDRS, b"delivered"),  # ...and by its resolved addresses
])
async def test_delivery_checks_the_destination_again_after_its_own_lookup(redis_url, prefix, tmp_path, allow,
                                                                          outcome):
    """DNS rebinding: the job was accepted for a name that resolved publicly at submit; by delivery
    it resolves to loopback (here: its record now names localhost)."""
    async with receiver() as rx, scripted_stack(redis_url, prefix, webhook_secret=SECRET) as s:
        job_id = (await s.client.post("/v1/jobs", json={
            "prompt": "hi", "sampling": {"max_tokens": 3}, "webhook": PUBLIC_HOOK})).json()["id"]
        await job_status(s.client, job_id)
        port = rx.url.rsplit(":", 1)[1]
        await s.redis.hset(Keys(prefix).job("tiny", job_id), "webhook", f"http://localhost:{port}/hook/rebound")
        assert await s.redis.xlen(Keys(prefix).webhooks("tiny")) == 1  # waiting for the housekeeper

        with housekeeping(redis_url, prefix, tmp_path, webhook_secret=SECRET, webhook_allow=allow):
            assert await _webhook_status(s.redis, prefix, job_id) == outcome
            if outcome == b"failed":
                await asyncio.sleep(1.5)  # a retry would have come after 1 s
                assert rx.hits["rebound"] == []
                record = await s.redis.hgetall(Keys(prefix).job("tiny", job_id))
                assert record[b"webhook_status"] == b"failed" and record[b"webhook_attempts"] == b"1"
                lines = [json.loads(x) for x in (tmp_path / f"housekeeping-{prefix}.log").read_text().splitlines()
                         if x.startswith("{")]
                [refused] = [x for x in lines if x.get("event") == "webhook_refused"]
                assert refused["job_id"] == job_id and refused["level"] == "warning"
                assert "localhost" in refused["reason"] and "/hook/rebound" not in json.dumps(refused)
            else:
                [(_, headers, body)] = await rx.hits_of("rebound", 1)
                assert headers["host"] == f"localhost:{port}" and verify(SECRET, body, headers)


async def test_a_redirect_is_not_followed(redis_url, prefix, tmp_path):
    async with receiver() as rx, scripted_stack(redis_url, prefix, webhook_secret=SECRET,
                                                webhook_allow="127.0.0.1/32") as s:
        rx.redirects["moved"] = f"{rx.url}/hook/elsewhere"
        with housekeeping(redis_url, prefix, tmp_path, webhook_secret=SECRET, webhook_allow="127.0.0.1/32"):
            job_id = (await s.client.post("/v1/jobs", json={
                "prompt": "hi", "sampling": {"max_tokens": 3}, "webhook": f"{rx.url}/hook/moved"})).json()["id"]
            assert await _webhook_status(s.redis, prefix, job_id) == b"failed"  # a 3xx is a final answer
            await asyncio.sleep(1.5)
            assert len(rx.hits["moved"]) == 1 and rx.hits["elsewhere"] == []


@pytest.mark.parametrize(("identity", "outcome"), [("localhost", b"delivered"), ("other.example", b"failed")])
async def test_a_pinned_https_delivery_checks_the_certificate_for_the_host_name(
        redis_url, prefix, tmp_path, monkeypatch, identity, outcome):
    """The connection goes to the checked address, yet TLS still names the URL's host: a
    certificate for ``localhost`` alone (no IP address in it) is accepted, one for another name is not."""
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    ca.issue_cert(identity).private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "receiver.pem"))
    monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "ca.pem"))  # the housekeeper's trust store
    async with receiver(tmp_path / "receiver.pem", name="localhost") as rx, \
            scripted_stack(redis_url, prefix, webhook_secret=SECRET, webhook_allow="localhost") as s:
        with housekeeping(redis_url, prefix, tmp_path, webhook_secret=SECRET, webhook_allow="localhost",
                          webhook_max_tries="1"):
            job_id = (await s.client.post("/v1/jobs", json={
                "prompt": "hi", "sampling": {"max_tokens": 3}, "webhook": f"{rx.url}/hook/tls"})).json()["id"]
            assert await _webhook_status(s.redis, prefix, job_id) == outcome
            if outcome == b"delivered":
                [(_, headers, body)] = rx.hits["tls"]
                assert verify(SECRET, body, headers)
            else:
                assert rx.hits["tls"] == []  # refused during the handshake: nothing was sent
