"""The published ``/openapi.json``, byte for byte, against golden files (issue 42).

The document is assembled from declarations beside each route (api/openapi.py); moving those
declarations must not move a byte of what clients and generators download. The golden files
were captured from the live app at the issue's base commit; a deliberate change to the document
rewrites them (``LLMQ_REWRITE_GOLDEN=1``) and shows the difference in review.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from tests.support.scripted_stack import scripted_settings, serve_api

FIXTURES = Path(__file__).parent.parent / "fixtures"


@pytest.mark.parametrize(("api_keys", "golden"), [("", "openapi.json"), ("key-one", "openapi-keys.json")],
                         ids=["no-keys", "keys"])
async def test_the_served_document_is_the_golden_file(redis_url, prefix, api_keys, golden):
    """With API keys on, the document marks the operations that need one: a second document."""
    async with serve_api(scripted_settings(redis_url, prefix, api_keys=api_keys)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            resp = await client.get("/openapi.json")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("application/json")
    path = FIXTURES / golden
    if os.environ.get("LLMQ_REWRITE_GOLDEN") == "1":
        path.write_bytes(resp.content)
    assert resp.content == path.read_bytes()
