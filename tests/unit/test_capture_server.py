"""The capture server's canned replies (tests/support/capture_server.py) parse with the
``anthropic`` and ``openai`` SDKs' own stream accumulators, streamed and not; it records what
came, without credentials; its failure plan and proxy refusal work. The agent CLIs it serves
are exercised in tests/e2e/test_agent_clis_capture.py."""

from __future__ import annotations

import http.client
import json

import anthropic
import openai

from tests.support.capture_server import CaptureServer


def test_anthropic_messages_stream_and_json_parse_with_the_sdk() -> None:
    with CaptureServer(reply="hello there") as srv:
        client = anthropic.Anthropic(base_url=srv.url, api_key="secret", max_retries=0)
        kwargs = dict(model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
        with client.messages.stream(**kwargs) as stream:
            final = stream.get_final_message()
        assert [b.text for b in final.content] == ["hello there"] and final.stop_reason == "end_turn"
        assert client.messages.create(**kwargs).content[0].text == "hello there"
        assert client.messages.count_tokens(model="m", messages=kwargs["messages"]).input_tokens > 0
        first = srv.first("POST", "/v1/messages")
    assert first.auth and "secret" not in json.dumps(first.as_dict())  # which header came, never its value
    assert first.body["stream"] is True and first.body["messages"] == kwargs["messages"]


def test_openai_responses_stream_and_json_parse_with_the_sdk() -> None:
    with CaptureServer(reply="hello there") as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="secret", max_retries=0)
        with client.responses.stream(model="m", input="hi") as stream:
            deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
            final = stream.get_final_response()
        assert deltas == ["hello there"] and final.output_text == "hello there" and final.id.startswith("resp_")
        assert final.usage.output_tokens == 1
        assert client.responses.create(model="m", input="hi").output_text == "hello there"
    assert [r.auth for r in srv.captured()] == [["authorization"]] * 2
    assert "secret" not in json.dumps([r.as_dict() for r in srv.captured()])


def test_planned_failures_come_first_and_proxy_requests_are_refused() -> None:
    with CaptureServer(fail_with=[529]) as srv:
        client = anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=1)
        msg = client.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
        assert msg.content[0].text == "hi"
        conn = http.client.HTTPConnection("127.0.0.1", int(srv.url.rsplit(":", 1)[1]), timeout=5)
        conn.request("CONNECT", "example.com:443")
        assert conn.getresponse().status == 403
        conn.close()
        assert srv.hits() == ["POST /v1/messages -> 529", "POST /v1/messages -> 200", "CONNECT example.com:443 -> 403"]
        assert srv.proxied() == ["example.com:443"]
        assert json.dumps(srv.captured()[0].as_dict())  # records are plain JSON
