"""The console's routes with no keys configured (api/routes/overview.py, docs/console.md): every
caller is an operator, and only loopback callers are callers at all. A request relayed by a proxy
(here: one that says so with ``X-Forwarded-For``) is not a loopback caller, whatever its socket."""

from __future__ import annotations

from tests.support.scripted_stack import ScriptedStack

REMOTE = {"x-forwarded-for": "203.0.113.7"}


async def test_a_jobs_record_obeys_the_rule_of_the_jobs_list(stack: ScriptedStack):
    resp = await stack.client.post("/v1/jobs", json={"prompt": "mine", "sampling": {"max_tokens": 2}})
    assert resp.status_code == 202, resp.text
    job_id = resp.json()["id"]
    local = await stack.client.get(f"/v1/jobs/{job_id}/record")
    assert local.status_code == 200 and local.json()["request"]["prompt"] == "mine"

    listed = await stack.client.get("/v1/jobs", headers=REMOTE)
    assert listed.status_code == 403 and listed.json()["error"]["code"] == "forbidden"
    # The record holds the prompt: the same 403, and before the job is looked up, so a job that
    # does not exist gets it too.
    for path in (f"/v1/jobs/{job_id}/record", "/v1/jobs/nope/record"):
        resp = await stack.client.get(path, headers=REMOTE)
        assert resp.status_code == 403, (path, resp.text)
        assert resp.json() == listed.json()
