"""Webhook signatures: how llmq signs a delivery and how a receiver checks one.

A delivery is ``POST <webhook URL>`` with the finished job as ``GET /v1/jobs/{id}`` shows it, and
three headers:

- ``X-LLMQ-Webhook-Id``: the job id, the same on every retry, so a receiver can drop repeats;
- ``X-LLMQ-Timestamp``: Unix seconds when this attempt was signed;
- ``X-LLMQ-Signature``: ``sha256=`` + hex HMAC-SHA256, keyed with ``LLMQ_WEBHOOK_SECRET``, of
  ``<timestamp>.<body>``.

The MAC covers the body and the timestamp together (Stripe's scheme): signing the body alone
would let anyone who saw one delivery replay it forever, as the timestamp header could not be
trusted. A receiver recomputes the MAC over the raw body it received, compares in constant time
and refuses a timestamp outside its tolerance (:func:`verify` does all three).
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Mapping

__all__ = ["ID_HEADER", "TIMESTAMP_HEADER", "SIGNATURE_HEADER", "sign", "headers", "verify"]

ID_HEADER = "X-LLMQ-Webhook-Id"
TIMESTAMP_HEADER = "X-LLMQ-Timestamp"
SIGNATURE_HEADER = "X-LLMQ-Signature"
# How far a receiver's clock may be from the signer's before a delivery counts as a replay.
TOLERANCE_S = 300


def sign(secret: str, timestamp: int, body: bytes) -> str:
    mac = hmac.new(secret.encode(), str(timestamp).encode() + b"." + body, hashlib.sha256)
    return "sha256=" + mac.hexdigest()


def headers(secret: str, job_id: str, body: bytes, now: float | None = None) -> dict[str, str]:
    """The headers of one delivery attempt of ``body``."""
    timestamp = int(time.time() if now is None else now)
    return {"Content-Type": "application/json", ID_HEADER: job_id, TIMESTAMP_HEADER: str(timestamp),
            SIGNATURE_HEADER: sign(secret, timestamp, body)}


def verify(secret: str, body: bytes, received: Mapping[str, str], *, tolerance_s: float = TOLERANCE_S,
           now: float | None = None) -> bool:
    """Whether ``body`` with the ``received`` headers (any case) is a fresh delivery signed with
    ``secret``."""
    lower = {k.lower(): v for k, v in received.items()}
    try:
        timestamp = int(lower[TIMESTAMP_HEADER.lower()])
        signature = lower[SIGNATURE_HEADER.lower()]
    except (KeyError, ValueError):
        return False
    if abs((time.time() if now is None else now) - timestamp) > tolerance_s:
        return False
    return hmac.compare_digest(signature, sign(secret, timestamp, body))
