from __future__ import annotations

import pytest

from shared.config import DEFAULT_MODEL, TINY_MODEL_DIR, SettingsError, load_settings
from shared.keys import Keys


def test_per_model_keys_share_one_cluster_hash_tag():
    keys = Keys("llmq")
    job_keys = [keys.queue("m"), keys.job("m", "j1"), keys.events("m", "j1"), keys.live("m", "j1"),
                keys.idempotency("m", "k"), keys.dead("m"), keys.workers("m")]
    assert job_keys[0] == "llmq:{m}:queue"
    assert keys.job("m", "j1") == "llmq:{m}:job:j1"
    assert keys.events("m", "j1") == "llmq:{m}:events:j1"
    assert keys.live("m", "j1") == "llmq:{m}:live:j1"
    assert all(k.startswith("llmq:{m}:") for k in job_keys)
    assert keys.worker("w1") == "llmq:worker:w1"


def test_prefix_isolates_runs():
    assert Keys("test-1").queue("m") != Keys("test-2").queue("m")


def test_settings_come_from_prefixed_environment():
    s = load_settings({"LLMQ_PORT": "9000", "LLMQ_PREFIX": "x", "LLMQ_MODEL": "/models/llama-3/",
                       "LLMQ_LOG_JSON": "false", "UNRELATED": "1"})
    assert (s.port, s.prefix, s.log_json) == (9000, "x", False)
    assert s.model_name == "llama-3" and s.model_path == "/models/llama-3/"


def test_settings_defaults():
    s = load_settings({})
    assert s.port == 8080 and s.prefix == "llmq" and s.model == DEFAULT_MODEL
    assert s.redis_dsn.startswith("redis://127.0.0.1:")
    # The tiny model is served by its name, loaded from its build's directory.
    assert s.model_name == DEFAULT_MODEL and s.model_path.endswith(f"/models/{TINY_MODEL_DIR}")


def test_lmi_option_output_formatter_is_honoured():
    assert load_settings({"OPTION_OUTPUT_FORMATTER": "SSE"}).lmi_output_formatter == "sse"


@pytest.mark.parametrize("env", [{"LLMQ_PORT": "eighty"}, {"LLMQ_LMI_OUTPUT_FORMATTER": "xml"}])
def test_bad_settings_fail_fast(env):
    with pytest.raises(SettingsError):
        load_settings(env)


def test_housekeeping_gives_arq_the_whole_redis_url():
    from workers.housekeeping import arq_redis_settings

    rs = arq_redis_settings("rediss://llmq:p%40ss@redis.internal:6380/2?ssl_ca_certs=/ca.pem"
                            "&ssl_check_hostname=true&ssl_cert_reqs=required")
    assert (rs.host, rs.port, rs.database, rs.ssl) == ("redis.internal", 6380, 2, True)
    assert (rs.username, rs.password) == ("llmq", "p@ss")
    assert (rs.ssl_ca_certs, rs.ssl_check_hostname, rs.ssl_cert_reqs) == ("/ca.pem", True, "required")
    plain = arq_redis_settings("redis://127.0.0.1:6399/0")
    assert (plain.ssl, plain.password, plain.ssl_ca_certs) == (False, None, None)


@pytest.mark.parametrize(("env", "allowed"), [
    ({}, False),  # the tiny model needs no allowance: its positions are extended instead (workers/engine.py)
    ({"LLMQ_ALLOW_LONG_CONTEXT": "true"}, True),
    ({"LLMQ_MODEL": "Qwen/Qwen2.5-0.5B-Instruct"}, False),  # a real model: only when asked
    ({"LLMQ_MODEL": "Qwen/Qwen2.5-0.5B-Instruct", "LLMQ_ALLOW_LONG_CONTEXT": "true"}, True),
])
def test_a_context_past_the_models_own_is_allowed_only_when_asked(env, allowed):
    from shared.config import apply_engine_environment

    engine_env: dict[str, str] = {}
    apply_engine_environment(load_settings({"LLMQ_MAX_MODEL_LEN": "65536", **env}), engine_env)
    assert engine_env.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN") == ("1" if allowed else None)
    operator = {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "0"}  # the operator's own value wins, as for every default
    apply_engine_environment(load_settings(env), operator)
    assert operator["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] == "0"
