"""Placeholder: the happy_vllm routes are being written (issue 3)."""

from __future__ import annotations

ROUTES: list = []
