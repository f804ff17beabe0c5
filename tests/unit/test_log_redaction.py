"""Nothing secret in the logs, in-process: URLs and Settings are shown masked, tracebacks list no
frame locals (in JSON and on the console, for structlog's and stdlib loggers' records), an
exception that may quote a request is shown without its message, and the one log line that
holds a prompt (LLMQ_LOG_REQUESTS) is written at debug only."""

from __future__ import annotations

import json
import logging
import re
import sys
from types import SimpleNamespace

import pytest
import structlog

from api.auth import KeyGuard
from shared.config import load_settings, redact_url
from shared.logging import HIDDEN_MESSAGE, configure_logging
from shared.schemas import GenerationRequest

API_KEY, PASSWORD, WEBHOOK_SECRET, PROMPT = "sk-PLANTEDkey", "PLANTEDpw", "PLANTEDhook", "PLANTEDprompt"
SECRETS = (API_KEY, PASSWORD, WEBHOOK_SECRET)


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://127.0.0.1:6399/0", "redis://127.0.0.1:6399/0"),
    ("redis://:PLANTEDpw@h:6379/0", "redis://:***@h:6379/0"),
    ("redis://llmq:PLANTEDpw@h:6379/0", "redis://llmq:***@h:6379/0"),
    ("rediss://llmq:PLANTED%40pw@h:6380/0?ssl_ca_certs=/ca.pem", "rediss://llmq:***@h:6380/0?ssl_ca_certs=/ca.pem"),
    ("redis+cluster://:PLANTEDpw@n1:7000", "redis+cluster://:***@n1:7000"),
    ("rediss+cluster://llmq:PLANTEDpw@n1:7000", "rediss+cluster://llmq:***@n1:7000"),
    ("redis+sentinel://llmq:PLANTEDpw@s1:26379,s2:26379/mymaster/0",
     "redis+sentinel://llmq:***@s1:26379,s2:26379/mymaster/0"),
    ("rediss+sentinel://:PLANTEDpw@s1,s2/mymaster?sentinel_username=w&sentinel_password=PLANTEDpw&ssl_ca_certs=/ca",
     "rediss+sentinel://:***@s1,s2/mymaster?sentinel_username=w&sentinel_password=***&ssl_ca_certs=/ca"),
    ("redis+sentinel://s1,s2/mymaster?sentinel_password=PLANTEDpw", "redis+sentinel://s1,s2/mymaster?sentinel_password=***"),
    ("redis://:PLANTED@pw@h/0", "redis://:***@h/0"),  # a raw "@" in the password: the last one ends it
    ("redis://h/0?db=1&password=PLANTEDpw", "redis://h/0?db=1&password=***"),
    ("redis://:PLANTED/pw@h/0", "redis://***"),  # no clean URL: nothing of it is shown
    ("redis://llmq@h/0", "redis://llmq@h/0"),  # a user name is no secret
    ("PLANTEDpw@h:6379", "***"),
])
def test_urls_are_shown_with_their_passwords_masked(url, shown):
    assert redact_url(url) == shown


@pytest.fixture
def planted():
    return load_settings({"LLMQ_API_KEYS": f"other,{API_KEY}", "LLMQ_WEBHOOK_SECRET": WEBHOOK_SECRET,
                          "LLMQ_REDIS_URL": f"redis://llmq:{PASSWORD}@h:6379/0",
                          "LLMQ_ARQ_REDIS_URL": f"rediss://:{PASSWORD}@q:6380/0"})


def test_settings_repr_and_str_mask_every_secret(planted):
    for shown in (repr(planted), str(planted), f"{planted}", f"{planted!r}", repr([planted])):
        assert not any(s in shown for s in SECRETS), shown
    assert "redis_url='redis://llmq:***@h:6379/0'" in repr(planted)
    assert "arq_redis_url='rediss://:***@q:6380/0'" in repr(planted)
    assert "api_keys='***'" in repr(planted) and "webhook_secret='***'" in repr(planted)
    unset = repr(load_settings({}))
    assert "api_keys=''" in unset and "webhook_secret=''" in unset and "redis_url=None" in unset


def test_other_holders_of_secrets_mask_them_too(planted):
    from workers.housekeeping.arq_settings import arq_redis_settings

    assert API_KEY not in repr(KeyGuard((API_KEY,)))
    shown = repr(arq_redis_settings(planted.redis_dsn))
    assert PASSWORD not in shown and "password='***'" in shown and "host='h'" in shown


@pytest.fixture
def logs(capsys):
    """configure_logging into the captured stderr; structlog and the root logger restored after."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level

    def read(json_mode: bool, **kwargs) -> None:
        configure_logging("info", json_mode, **kwargs)

    yield read
    structlog.reset_defaults()
    root.handlers[:], root.level = handlers, level


def _fail(settings, body: dict) -> None:
    """A frame whose locals hold the Settings and a request body, as a route's do."""
    request = GenerationRequest(prompt=body["prompt"])
    raise RuntimeError(f"could not run {request.prompt}")


def _log_failures(settings, **kw) -> None:
    log = structlog.get_logger()
    try:
        _fail(settings, {"prompt": PROMPT, "api_key": API_KEY})
    except RuntimeError:
        log.exception("forced", **kw)
        log.exception("forced_quoting", may_quote_request=True, **kw)
        logging.getLogger("uvicorn.error").error("Exception in ASGI application\n", exc_info=True)
        logging.getLogger("arq.worker").exception("cron failed")
    log.info("settings_in_a_field", settings=settings)


@pytest.mark.parametrize("json_mode", [True, False], ids=["json", "console"])
def test_tracebacks_show_frames_but_no_locals_and_hide_request_quoting_messages(logs, capsys, planted, json_mode):
    logs(json_mode)
    _log_failures(planted)
    err = capsys.readouterr().err
    assert not any(s in err for s in SECRETS), err
    # Only the two lines that do not say they may quote a request show the message.
    assert err.count(PROMPT) == 2 and err.count(HIDDEN_MESSAGE) == 2, err
    # Each traceback reaches the frame that raised: "in _fail" (console), "name":"_fail" (JSON).
    assert len(re.findall(r'in _fail\n|"name":"_fail"', err)) == 4
    if json_mode:
        lines = [json.loads(line) for line in err.splitlines()]
        assert [x["event"] for x in lines] == ["forced", "forced_quoting", "Exception in ASGI application\n",
                                               "cron failed", "settings_in_a_field"]
        assert all("locals" not in f for x in lines[:4] for s in x["exception"] for f in s["frames"])
        assert "api_keys='***'" in lines[4]["settings"]


def test_log_requests_shows_the_messages_a_request_may_quote(logs, capsys, planted):
    logs(True, log_requests=True)
    _log_failures(planted)
    err = capsys.readouterr().err
    assert err.count(PROMPT) == 4 and HIDDEN_MESSAGE not in err
    assert not any(s in err for s in SECRETS)


def test_structlog_default_tracebacks_leak_what_ours_keep_out(capsys, planted):
    """The control: the set-up this replaced (dict_tracebacks, whose frames carry their locals)
    logs every planted value; the test above would catch a return to it."""
    structlog.configure(processors=[structlog.processors.dict_tracebacks, structlog.processors.JSONRenderer()],
                        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr))
    try:
        try:
            _fail(planted, {"prompt": PROMPT, "api_key": API_KEY})
        except RuntimeError:
            structlog.get_logger().exception("forced")
    finally:
        structlog.reset_defaults()
    err = capsys.readouterr().err
    assert PROMPT in err and API_KEY in err


@pytest.mark.parametrize("log_requests", [False, True])
def test_a_jobs_request_is_logged_at_debug_only_with_log_requests(capsys, monkeypatch, log_requests):
    from api import submit
    from api.context import RequestContext

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        configure_logging("debug", True)
        monkeypatch.setattr(submit, "log", structlog.get_logger())  # the module's may be cached
        svc = SimpleNamespace(settings=load_settings({}, log_requests=log_requests))
        ctx = RequestContext(dialect="jobs")
        record = submit._record(svc, ctx, GenerationRequest(model="m", prompt=PROMPT))
    finally:
        structlog.reset_defaults()
        root.handlers[:], root.level = handlers, level
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    if not log_requests:
        assert lines == []
        return
    [line] = lines
    assert (line["event"], line["level"], line["job_id"]) == ("job_request", "debug", record.id)
    assert line["request"]["prompt"] == PROMPT
