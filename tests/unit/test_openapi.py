"""The OpenAPI document (api/openapi.py) against the app itself: every HTTP route the app
registers is in it and nothing else is; it loads as OpenAPI 3.1; every documented example is
valid against its own schema; with API keys on, exactly the non-open operations need one."""

from __future__ import annotations

import jsonschema
import msgspec
import pytest
import schemathesis
from litestar import get, post
from litestar.routes import HTTPRoute

from api.app import create_app
from api.openapi import OPERATIONS, document, openapi_path
from api.operations import documented, operation_of
from shared.config import load_settings

UNDOCUMENTED_METHODS = {"OPTIONS", "HEAD"}  # Litestar's automatic answers


def registered_operations(api_keys: str = "") -> set[tuple[str, str]]:
    app = create_app(load_settings({}, redis_url="redis://127.0.0.1:1/0", api_keys=api_keys))
    return {
        (method.lower(), openapi_path(route.path))
        for route in app.routes
        if isinstance(route, HTTPRoute)  # the LMTP WebSocket cannot be described in OpenAPI
        for method in route.methods - UNDOCUMENTED_METHODS
    }


def documented_operations(doc: dict) -> set[tuple[str, str]]:
    return {(method, path) for path, item in doc["paths"].items() for method in item}


def test_every_registered_http_route_is_documented_and_nothing_else():
    registered = registered_operations()
    documented = documented_operations(document())
    assert registered - documented == set(), "routes missing from api/openapi.py's HTTP_ROUTES"
    assert documented - registered == set(), "documented operations the app does not register"
    assert len(OPERATIONS) == len(documented)  # no operation listed twice


def test_a_declaration_takes_its_method_and_path_from_its_route():
    @documented("Make a thing", "things", body="job", errors=(400,))
    @post("/v9/things/{thing_id:str}/make", status_code=200)
    async def make() -> None: ...

    op = operation_of(make)
    assert (op.method, op.path, op.summary, op.tag, op.body, op.errors) == \
        ("post", "/v9/things/{thing_id}/make", "Make a thing", "things", "job", (400,))


def test_a_route_with_no_declaration_is_named():
    @get("/v9/things")
    async def things() -> None: ...

    with pytest.raises(LookupError, match="things declares no operation"):
        operation_of(things)


def test_openapi_path():
    assert openapi_path("/v2/models/{model:str}/versions/{version:str}/ready") == \
        "/v2/models/{model}/versions/{version}/ready"
    assert openapi_path("/v1/jobs/{job_id:str}") == "/v1/jobs/{job_id}"
    assert openapi_path("/") == "/"


def test_document_loads_as_openapi_3_1_and_round_trips_as_json():
    doc = document()
    assert doc["openapi"] == "3.1.0"
    assert msgspec.json.decode(msgspec.json.encode(doc)) == doc
    schema = schemathesis.openapi.from_dict(doc)
    results = list(schema.get_all_operations())
    assert all(r.ok() is not None for r in results)
    assert len(results) == len(OPERATIONS)


def test_every_example_is_valid_against_its_body_schema():
    doc = document()
    checked = 0
    for path, item in doc["paths"].items():
        for method, op in item.items():
            media = op.get("requestBody", {}).get("content", {}).get("application/json")
            if media is None:
                continue
            assert media.get("examples"), f"{method} {path} has a body but no example"
            pointer = "/".join(["#", "paths", path.replace("~", "~0").replace("/", "~1"), method, "requestBody",
                                "content", "application~1json", "schema"])
            # The document as root, so the body schema's #/components/... references resolve.
            validator = jsonschema.Draft202012Validator({**doc, "$ref": pointer})
            for example in media["examples"].values():
                errors = list(validator.iter_errors(example["value"]))
                assert not errors, (method, path, example["value"], [e.message for e in errors])
                checked += 1
    assert checked >= 15


def test_invocations_branches_are_exclusive():
    """LMI dispatches on keys; the oneOf says the same, so each example matches exactly one branch."""
    doc = document()
    body = doc["paths"]["/invocations"]["post"]["requestBody"]["content"]["application/json"]
    branches = body["schema"]["oneOf"]
    for example in body["examples"].values():
        matches = [jsonschema.Draft202012Validator({**doc, **b}).is_valid(example["value"]) for b in branches]
        assert matches.count(True) == 1, (example, matches)


def test_api_keys_mark_exactly_the_non_open_operations():
    assert "securitySchemes" not in document()["components"]
    doc = document(keys_on=True)
    assert set(doc["components"]["securitySchemes"]) == {"bearer", "apiKey"}
    open_ops = {("get", p) for p in ("/ping", "/health", "/liveness", "/readiness", "/v2/health/live",
                                      "/v2/health/ready", "/v2/models/{model}/ready", "/livez", "/readyz",
                                      "/v2/models/{model}/versions/{version}/ready", "/openapi.json", "/metrics",
                                      "/console", "/console/static/{file}")}
    for path, item in doc["paths"].items():
        for method, op in item.items():
            if (method, path) in open_ops:
                assert "security" not in op and "401" not in op["responses"], (method, path)
            else:
                assert op["security"] and "401" in op["responses"], (method, path)
