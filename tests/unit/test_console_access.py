"""Who the API takes a caller for (api/auth.py). With keys: an operator key sees every job,
another key its own. With no keys at all, a loopback caller is an operator and any other is
refused, whatever it sends; a loopback caller is the socket's own 127.0.0.1 or ::1 with no proxy's
header. And with no keys, what a page of another site makes a browser send is refused
(:class:`~api.auth.KeylessGuard`); tests/integration/test_keyless.py sends it to a real process."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from api.auth import HEALTH_PATHS, KeyGuard, KeylessGuard, owner_of, refuse_open_bind, viewer
from shared.config import load_settings
from shared.errors import Forbidden, Unauthorized

OPERATORS = frozenset({owner_of("op")})
ALLOWED = load_settings({}, allowed_hosts="llmq.test, Other.Example ").allowed_host_names
JOBS = {"/v1/jobs"}


def caller(host: str | None, key: str | None = None, **headers: str):
    if key:
        headers["authorization"] = f"Bearer {key}"
    return SimpleNamespace(client=SimpleNamespace(host=host, port=1234) if host else None, headers=headers)


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_with_no_keys_a_loopback_caller_is_an_operator(host: str):
    who = viewer(caller(host), frozenset(), keys_on=False)
    assert who.operator and who.only is None


# 127.0.0.6: an Istio sidecar's inbound address; None: no peer (a Unix socket); "localhost": never a peer.
@pytest.mark.parametrize("host", ["10.0.0.7", "192.168.1.2", "2001:db8::1", "example.org", "127.8.9.10", "127.0.0.6",
                                  "::ffff:127.0.0.1", "localhost", None])
def test_with_no_keys_any_other_caller_is_refused(host: str | None):
    with pytest.raises(Forbidden, match="loopback"):
        viewer(caller(host, key="op"), frozenset(), keys_on=False)


@pytest.mark.parametrize("header", ["forwarded", "x-forwarded-for", "x-real-ip"])
def test_with_no_keys_a_request_a_proxy_relayed_is_remote(header: str):
    with pytest.raises(Forbidden, match="proxy"):
        viewer(caller("127.0.0.1", **{header: "127.0.0.1"}), frozenset(), keys_on=False)


def test_with_keys_an_operator_key_sees_everything_and_another_only_its_own():
    op = viewer(caller("10.0.0.7", "op"), OPERATORS, keys_on=True)
    assert op.operator and op.sees(owner_of("anyone"))
    tenant = viewer(caller("10.0.0.7", "tenant-key"), OPERATORS, keys_on=True)
    assert not tenant.operator and tenant.only == owner_of("tenant-key")
    assert tenant.sees(owner_of("tenant-key")) and not tenant.sees(owner_of("op"))


# --- the keyless guard ----------------------------------------------------------------------

@pytest.mark.parametrize("host", ["localhost", "localhost:8080", "LocalHost:1", "127.0.0.1", "127.0.0.1:8080", "[::1]",
                                  "[::1]:8080", "llmq.test", "llmq.test:443", "other.example"])
def test_the_keyless_guard_serves_this_machines_names_and_the_allowed_hosts(host: str):
    assert KeylessGuard(ALLOWED).refusal({"host": host}, "GET", JOBS) is None


@pytest.mark.parametrize("host", ["", "evil.example", "localhost.evil.example", "localhost.", "127.0.0.2", "[::1]x",
                                  "[::1", "::1", "[::ffff:127.0.0.1]", "0.0.0.0", "llmq.test.evil.example"])
def test_the_keyless_guard_refuses_any_other_host_but_on_the_health_probes(host: str):
    guard = KeylessGuard(ALLOWED)
    refused = guard.refusal({"host": host}, "GET", JOBS)
    assert isinstance(refused, Forbidden) and refused.status == 403 and "LLMQ_ALLOWED_HOSTS" in refused.message
    assert guard.refusal({}, "GET", JOBS) is not None  # no Host at all
    for path in HEALTH_PATHS:
        assert guard.refusal({"host": host}, "GET", {path}) is None


@pytest.mark.parametrize("origin", ["http://localhost", "http://localhost:3000", "HTTPS://127.0.0.1:8080",
                                    "http://[::1]:8080", "https://llmq.test"])
def test_a_change_from_this_machines_page_passes(origin: str):
    guard = KeylessGuard(ALLOWED)
    for method in ("POST", "PUT", "PATCH", "DELETE", None):  # None: a WebSocket upgrade
        assert guard.refusal({"host": "localhost:8080", "origin": origin, "sec-fetch-site": "same-origin"},
                             method, JOBS) is None
    assert guard.refusal({"host": "localhost:8080"}, "POST", JOBS) is None  # curl, an SDK: no Origin


@pytest.mark.parametrize("headers", [{"origin": "http://evil.example"}, {"origin": "null"}, {"origin": ""},
                                     {"origin": "http://localhost.evil.example"}, {"origin": "file://"},
                                     {"origin": "ftp://localhost"}, {"origin": "localhost"},
                                     {"origin": "http://localhost@evil.example"},
                                     {"origin": "http://[::1].evil.example"},
                                     {"sec-fetch-site": "cross-site"},
                                     {"origin": "http://localhost", "sec-fetch-site": "cross-site"}])
def test_a_change_from_another_site_is_refused_and_a_read_is_not(headers: dict[str, str]):
    guard = KeylessGuard(ALLOWED)
    sent = {"host": "127.0.0.1:8080", **headers}
    for method in ("POST", "PUT", "PATCH", "DELETE", None):
        refused = guard.refusal(sent, method, JOBS)
        assert isinstance(refused, Forbidden) and "another site" in refused.message, method
    for method in ("GET", "HEAD", "OPTIONS"):
        assert guard.refusal(sent, method, JOBS) is None


def test_the_key_guard_asks_for_a_key_everywhere_but_the_open_paths():
    guard = KeyGuard(("k1", "k2"))
    assert isinstance(guard.refusal({}, "POST", JOBS), Unauthorized)
    assert isinstance(guard.refusal({"authorization": "Bearer nope"}, None, {"/"}), Unauthorized)  # the upgrade
    assert guard.refusal({"x-api-key": "k2"}, "POST", JOBS) is None
    assert guard.refusal({}, "GET", {"/livez"}) is None and guard.refusal({}, "OPTIONS", JOBS) is None
    # The Host and Origin rules are the keyless mode's: a key is what a hostile page cannot send.
    assert guard.refusal({"host": "evil.example", "origin": "null", "authorization": "Bearer k1"}, "POST", JOBS) is None


# --- start-up ---------------------------------------------------------------------------------

@pytest.mark.parametrize("settings", [dict(host="0.0.0.0"), dict(host="::"), dict(host="10.0.0.7"),
                                      dict(host="llmq.example"), dict(host=""), dict(host="0.0.0.0", api_keys=" , ")])
def test_with_no_keys_the_web_refuses_an_address_that_is_not_loopback(settings: dict):
    with pytest.raises(SystemExit) as refused:
        refuse_open_bind(load_settings({}, **settings))
    assert refused.value.code == 3


@pytest.mark.parametrize("settings", [dict(host="127.0.0.1"), dict(host="::1"), dict(host="localhost"),
                                      dict(host="127.0.0.2"), dict(host="0.0.0.0", allow_open=True),
                                      dict(host="0.0.0.0", api_keys="k"), dict(host="0.0.0.0", operator_keys="k")])
def test_loopback_keys_or_allow_open_start(settings: dict):
    refuse_open_bind(load_settings({}, **settings))


def test_uvicorn_takes_the_client_from_the_socket_in_both_ways_of_serving():
    # python -m api (uvicorn.run) and each supervised child (uvicorn.Config) take these options.
    from api.__main__ import _uvicorn_options

    assert _uvicorn_options(load_settings({}))["proxy_headers"] is False


def test_the_console_turns_off_and_its_json_routes_stay():
    from api.app import create_app

    def paths(console: bool) -> set[str]:
        app = create_app(load_settings({}, redis_url="redis://127.0.0.1:1/0", console=console))
        return {route.path for route in app.routes}

    assert {"/console", "/console/static/{file:path}", "/v1/deployment"} <= paths(True)
    assert "/console" not in paths(False) and "/v1/deployment" in paths(False)


def test_an_allowed_host_named_with_a_port_is_served_on_any_port():
    guard = KeylessGuard(load_settings({"LLMQ_ALLOWED_HOSTS": "LLMQ.test:8080, [::2]:9"}).allowed_host_names)
    for host in ("llmq.test", "llmq.test:8080", "llmq.test:1", "[::2]", "[::2]:8080"):
        assert guard.refusal({"host": host}, "GET", JOBS) is None, host
    assert guard.refusal({"host": "llmq.test.evil"}, "GET", JOBS) is not None
