"""Placeholder: the triton dialect is being written (issue 3)."""

from __future__ import annotations

from api.dialects.jobs import error_body, render_result

__all__ = ["render_result", "error_body"]

NAME = "triton"
