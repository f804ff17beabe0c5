"""Who the console's routes take a caller for (api/auth.py ``viewer``): an operator key sees every
job, another key its own; with no keys at all, a loopback caller is an operator and a caller from
anywhere else is refused, whatever it sends."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from api.auth import owner_of, viewer
from shared.errors import Forbidden

OPERATORS = frozenset({owner_of("op")})


def caller(host: str | None, key: str | None = None):
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return SimpleNamespace(client=SimpleNamespace(host=host, port=1234) if host else None, headers=headers)


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "127.8.9.10"])
def test_with_no_keys_a_loopback_caller_is_an_operator(host: str):
    who = viewer(caller(host), frozenset(), keys_on=False)
    assert who.operator and who.only is None


@pytest.mark.parametrize("host", ["10.0.0.7", "192.168.1.2", "2001:db8::1", "example.org"])
def test_with_no_keys_any_other_caller_is_refused(host: str):
    with pytest.raises(Forbidden, match="loopback"):
        viewer(caller(host, key="op"), frozenset(), keys_on=False)


def test_with_keys_an_operator_key_sees_everything_and_another_only_its_own():
    op = viewer(caller("10.0.0.7", "op"), OPERATORS, keys_on=True)
    assert op.operator and op.sees(owner_of("anyone"))
    tenant = viewer(caller("10.0.0.7", "tenant-key"), OPERATORS, keys_on=True)
    assert not tenant.operator and tenant.only == owner_of("tenant-key")
    assert tenant.sees(owner_of("tenant-key")) and not tenant.sees(owner_of("op"))


def test_the_console_turns_off_and_its_json_routes_stay():
    from api.app import create_app
    from shared.config import load_settings

    def paths(console: bool) -> set[str]:
        app = create_app(load_settings({}, redis_url="redis://127.0.0.1:1/0", console=console))
        return {route.path for route in app.routes}

    assert {"/console", "/console/static/{file:path}", "/v1/deployment"} <= paths(True)
    assert "/console" not in paths(False) and "/v1/deployment" in paths(False)
