"""``service_tier`` (OpenAI's and Anthropic's field) onto llmq's priority levels, one mapping for
every dialect that has the field. Lower runs earlier (``GenerationRequest.priority``; levels 0..2)."""

from __future__ import annotations

from shared.errors import InvalidRequest

__all__ = ["priority_of_tier", "reported_tier", "TIERS"]

TIERS = {"flex": 2, "priority": -1}
"""Tiers that set a priority: ``flex`` is the lowest level (2); ``priority`` is queued on the
highest level (0, as ``shared.queue.level_of`` clamps it) and, being below the default 0, runs
ahead of default requests in the engine's priority scheduler too."""
_DEFAULT = frozenset({"default", "auto"})


def priority_of_tier(tier: str | None) -> int | None:
    """The request priority a tier asks for; None (default, auto, or no tier) leaves it unset, so
    the ``X-LLMQ-Priority`` header or the default applies. Any other tier is refused."""
    if tier is None or tier in _DEFAULT:
        return None
    if tier in TIERS:
        return TIERS[tier]
    raise InvalidRequest(
        f"service_tier must be one of 'auto', 'default', 'flex' or 'priority', got {tier!r}", param="service_tier")


def reported_tier(tier: str | None) -> str | None:
    """The tier a response reports for the one a request named: ``auto`` runs as ``default``
    (as OpenAI reports it); None when the request named none."""
    if tier is None:
        return None
    priority_of_tier(tier)  # an unknown tier is refused here too
    return "default" if tier in _DEFAULT else tier
