"""The worker's engine logs at llmq's level, except that vLLM's info lines are llmq's debug details;
an operator's own VLLM_LOGGING_LEVEL or PYTHONWARNINGS wins."""

from __future__ import annotations

import pytest

from shared.config import load_settings
from workers.environment import apply_engine_environment


@pytest.mark.parametrize(("level", "vllm"), [("debug", "INFO"), ("info", "WARNING"), ("warning", "WARNING"),
                                             ("error", "ERROR")])
def test_vllm_info_lines_show_only_at_llmq_debug(level, vllm):
    env: dict[str, str] = {}
    apply_engine_environment(load_settings({"LLMQ_LOG_LEVEL": level}), env)
    assert env["VLLM_LOGGING_LEVEL"] == vllm
    assert env["PYTHONWARNINGS"] == "ignore::FutureWarning:vllm.triton_utils.dispatcher"


def test_the_operators_own_values_win():
    env = {"VLLM_LOGGING_LEVEL": "DEBUG", "PYTHONWARNINGS": "error"}
    apply_engine_environment(load_settings({}), env)
    assert env["VLLM_LOGGING_LEVEL"] == "DEBUG" and env["PYTHONWARNINGS"] == "error"
