"""What the integration modules share: the scripted stack a module's tests run against.

A module says how its stack is built with the ``stack`` marker, in the arguments of
:func:`tests.support.scripted_stack.scripted_stack`: ``pytestmark = pytest.mark.stack(engine,
prefix=..., **settings)`` (no marker: a ``ScriptedEngine`` and the default settings). Its tests
then take ``stack``, one :class:`~tests.support.scripted_stack.ScriptedStack` for the whole
module. A test that needs a stack of its own settings builds it with ``scripted_stack`` itself.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest

from tests.support.scripted_stack import ScriptedStack, scripted_stack


@pytest.fixture(scope="module")
async def stack(request: pytest.FixtureRequest, redis_url: str) -> AsyncIterator[ScriptedStack]:
    """The module's stack, as its ``stack`` marker says; keys under the marker's ``prefix``, or a
    fresh one named after the module."""
    marker = request.node.get_closest_marker("stack")
    args, kwargs = (marker.args, dict(marker.kwargs)) if marker is not None else ((), {})
    module = request.module.__name__.rpartition(".")[2].removeprefix("test_")
    prefix = kwargs.pop("prefix", None) or f"{module}-{uuid.uuid4().hex[:6]}"
    async with scripted_stack(redis_url, prefix, *args, **kwargs) as s:
        yield s
