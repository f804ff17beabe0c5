from __future__ import annotations

from collections import Counter

import pytest
from redis.crc import key_slot

from shared.config import DEFAULT_MODEL, TINY_MODEL_DIR, SettingsError, load_settings
from shared.keys import SHARDS, Keys, model_tag, new_job_id, shard_of, shard_tag


def test_a_models_queue_keys_share_one_cluster_hash_tag():
    keys = Keys("llmq")
    model_keys = [keys.queue("m"), keys.job("m", "j1"), keys.idempotency("m", "k"), keys.dead("m"), keys.workers("m"),
                  keys.fair("m")]
    assert model_keys[0] == "llmq:{m}:queue"
    assert keys.job("m", "j1") == "llmq:{m}:job:j1"
    assert all(k.startswith("llmq:{m}:") for k in model_keys)
    assert keys.worker("w1") == "llmq:worker:w1"


def test_a_jobs_token_keys_share_its_shards_hash_tag_found_from_its_id_alone():
    keys = Keys("llmq")
    shard = shard_of("j1")
    tag = "{" + shard_tag("m", shard) + "}"
    assert tag.startswith("{m/") and tag != "{m}"
    token_keys = [keys.events("m", "j1"), keys.live("m", "j1"), keys.ending("m", "j1"), keys.fence("m", shard),
                  keys.relay("m", "api-1", "j1")]
    assert token_keys[0] == f"llmq:{tag}:events:j1"
    assert all(k.startswith(f"llmq:{tag}:") for k in token_keys)
    assert shard_of("j1") == shard_of("j1") and 0 <= shard < SHARDS


def test_a_models_shard_tags_spread_evenly_over_masters_holding_equal_slot_ranges():
    """The token shards' slots are evenly spaced, so every master of an evenly split Cluster of 1,
    2, 3, 4 or 6 masters holds the same number of a model's shards, whatever the model's name."""
    for model in ("m", "tiny-llama", "meta-llama/Llama-3.1-8B-Instruct"):
        slots = [key_slot(shard_tag(model, s).encode()) for s in range(SHARDS)]
        assert len(set(slots)) == SHARDS
        for masters in (1, 2, 3, 4, 6):
            # redis-cli --cluster create's split: master i holds slots [i*16384/n, (i+1)*16384/n).
            held = Counter(slot * masters // 16384 for slot in slots)
            assert sorted(held.values()) == [SHARDS // masters] * masters, (model, masters, held)


def test_a_processs_new_jobs_take_the_shards_in_turn():
    """Evenly by count, not by chance: any SHARDS ids in a row cover every shard once."""
    ids = [new_job_id("m") for _ in range(5 * SHARDS + 7)]
    for start in (0, 7, 3 * SHARDS):
        assert sorted(shard_of(i) for i in ids[start:start + SHARDS]) == list(range(SHARDS))
    assert all(i.startswith(model_tag("m")) and len(i) == 32 for i in ids) and len(set(ids)) == len(ids)


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
    from workers.housekeeping.arq_settings import arq_redis_settings

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
    from workers.environment import apply_engine_environment

    engine_env: dict[str, str] = {}
    apply_engine_environment(load_settings({"LLMQ_MAX_MODEL_LEN": "65536", **env}), engine_env)
    assert engine_env.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN") == ("1" if allowed else None)
    operator = {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "0"}  # the operator's own value wins, as for every default
    apply_engine_environment(load_settings(env), operator)
    assert operator["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] == "0"
