"""Images in each dialect that takes them: every place an image may be, mapped to the internal form
(``ChatMessage.parts``: the client's texts and images in order; ``Image`` a source, not yet read),
a text-only turn exactly as before, and each refusal in the dialect's own error shape.

OpenAI chat (and LMI's chat, which is OpenAI chat's translator: api/routes/lmi.py), OpenAI
Responses and Anthropic Messages join consecutive text parts with newlines, as they always did;
an image stays in place between them."""

from __future__ import annotations

import json

import msgspec
import pytest
from openai.types.responses.response_item_list import ResponseItemList

from api.dialects import anthropic_messages as am
from api.dialects import openai_chat as chat
from api.dialects import openai_responses as r
from api.submit import check_queueable
from shared.codec import decode_request, encode
from shared.errors import InvalidRequest
from shared.schemas import ChatMessage, Choice, GenerationRequest, Image, JobResult, Text, ToolCall

PNG = "iVBORw0KGgo="  # base64 text: never decoded by a dialect, so any will do
DATA_URL = f"data:image/png;base64,{PNG}"
HTTP_URL = "https://example.com/cat.jpg"


def queued_back(g: GenerationRequest) -> GenerationRequest:
    """The request as the worker would read it back (the parts are plain structs: they encode)."""
    check_queueable(g)
    back = decode_request(encode(g))
    assert back == g
    return back


# --- OpenAI chat (and LMI's chat) -----------------------------------------------------------------


def chat_req(messages: list[dict]) -> GenerationRequest:
    return chat.to_generation_request(msgspec.convert({"messages": messages}, chat.ChatRequest), max_model_len=64)


def chat_refused(messages: list[dict]) -> tuple[InvalidRequest, dict]:
    with pytest.raises(InvalidRequest) as info:
        chat_req(messages)
    status, body = chat.error_body(info.value)
    assert status == 400
    return info.value, json.loads(encode(body))


def image_url(url: str, detail: str | None = None) -> dict:
    return {"type": "image_url", "image_url": {"url": url} | ({"detail": detail} if detail else {})}


def test_chat_user_turn_with_images_is_its_parts_in_order():
    content = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}, image_url(HTTP_URL, "low"),
               {"type": "text", "text": "c"}, {"type": "image_url", "image_url": DATA_URL}]  # the older string form
    g = chat_req([{"role": "system", "content": "be brief"}, {"role": "user", "content": content, "name": "ann"}])
    assert g.messages == [
        ChatMessage(role="system", content="be brief"),
        ChatMessage(role="user", name="ann", parts=[Text(text="a\nb"), Image(url=HTTP_URL, detail="low"),
                                                    Text(text="c"), Image(url=DATA_URL)]),
    ]
    assert g.messages[1].content == "" and g.images == [Image(url=HTTP_URL, detail="low"), Image(url=DATA_URL)]
    queued_back(g)


def test_chat_image_first_and_alone():
    g = chat_req([{"role": "user", "content": [image_url(DATA_URL, "auto"), {"type": "text", "text": "what?"}]},
                  {"role": "assistant", "content": "a cat"},
                  {"role": "user", "content": [image_url(HTTP_URL, "high")]}])
    assert g.messages == [
        ChatMessage(role="user", parts=[Image(url=DATA_URL, detail="auto"), Text(text="what?")]),
        ChatMessage(role="assistant", content="a cat"),
        ChatMessage(role="user", parts=[Image(url=HTTP_URL, detail="high")]),
    ]


def test_chat_text_only_turns_are_as_before():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    g = chat_req([{"role": "user", "content": parts}, {"role": "assistant", "content": None}])
    assert g.messages == [ChatMessage(role="user", content="a\nb"), ChatMessage(role="assistant", content="")]
    assert b'"parts"' not in encode(g) and g.images == []
    # Byte for byte what was queued before images were taken.
    assert encode(g.messages) == b'[{"role":"user","content":"a\\nb"},{"role":"assistant"}]'


def test_lmi_chat_vision_example():
    """LMI's chat schema (specs/lmi-chat-completions-schema.md, Vision/Image Support), with a data URL."""
    g = chat_req([{"role": "user", "content": [{"type": "text", "text": "What is this an image of?"},
                                               {"type": "image_url", "image_url": {"url": DATA_URL}}]}])
    assert g.messages == [ChatMessage(role="user", parts=[Text(text="What is this an image of?"),
                                                          Image(url=DATA_URL)])]


@pytest.mark.parametrize(("messages", "message"), [
    ([{"role": "system", "content": [image_url(HTTP_URL)]}],
     "messages[0].content[0]: `image_url` content parts are only supported in `user` messages, not `system`"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": [image_url(HTTP_URL)]}],
     "messages[1].content[0]: `image_url` content parts are only supported in `user` messages, not `assistant`"),
    ([{"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": "x"}, image_url(HTTP_URL)]}],
     "messages[0].content[1]: `image_url` content parts are only supported in `user` messages, not `tool`"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content[0].image_url: Field required"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"detail": "low"}}]}],
     "messages[0].content[0].image_url.url: Field required"),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, image_url("ftp://example.com/x.png")]}],
     "messages[0].content[1].image_url.url: an image URL must be an http(s) URL or a data: URL"),
    ([{"role": "user", "content": [image_url(PNG)]}],  # bare base64: not a data URL
     "messages[0].content[0].image_url.url: an image URL must be an http(s) URL or a data: URL"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": "file:///etc/passwd"}]}],
     "messages[0].content[0].image_url: an image URL must be an http(s) URL or a data: URL"),
    ([{"role": "user", "content": [image_url(HTTP_URL, "ultra")]}],
     "messages[0].content[0].image_url.detail: Input should be 'auto', 'low', 'high' or 'original', got 'ultra'"),
    ([{"role": "user", "content": [{"type": "image", "image": HTTP_URL}]}],
     "messages[0]: content parts of type `image` are not supported (text and image_url only)"),
])
def test_chat_image_refusals(messages, message):
    exc, body = chat_refused(messages)
    assert body == {"error": {"message": message, "type": "BadRequestError", "param": "messages", "code": 400}}
    assert exc.message == message


# --- OpenAI Responses -----------------------------------------------------------------------------


def resp_req(**fields) -> GenerationRequest:
    return r.to_generation_request(msgspec.convert({"input": "hi", **fields}, r.ResponsesRequest), max_model_len=64)


def input_image(url: str | None = DATA_URL, detail: str | None = "auto", **extra) -> dict:
    return {"type": "input_image", **({"image_url": url} if url else {}), **({"detail": detail} if detail else {}),
            **extra}


def test_responses_user_message_with_images_is_its_parts_in_order():
    content = [{"type": "input_text", "text": "a"}, input_image(DATA_URL, "high"),
               {"type": "input_text", "text": "b"}, {"type": "input_text", "text": "c"}, input_image(HTTP_URL, None)]
    g = resp_req(instructions="rules", input=[{"role": "user", "content": content}])
    assert g.messages == [
        ChatMessage(role="system", content="rules"),
        ChatMessage(role="user", parts=[Text(text="a"), Image(url=DATA_URL, detail="high"), Text(text="b\nc"),
                                        Image(url=HTTP_URL)]),
    ]
    queued_back(g)


def test_responses_function_call_output_with_images_is_a_tool_turn_with_parts():
    """Codex's ``view_image``: its output is a list of ``input_image`` (and ``input_text``) items."""
    items = [{"role": "user", "content": "look at it"},
             {"type": "function_call", "call_id": "call_1", "name": "view_image", "arguments": '{"path":"a.png"}'},
             {"type": "function_call_output", "call_id": "call_1",
              "output": [{"type": "input_text", "text": "a.png"}, input_image(DATA_URL, "auto")]},
             {"type": "function_call_output", "call_id": "call_2", "output": [input_image(HTTP_URL, "low")]}]
    g = resp_req(input=items)
    assert g.messages == [
        ChatMessage(role="user", content="look at it"),
        ChatMessage(role="assistant", tool_calls=[ToolCall(id="call_1", name="view_image",
                                                           arguments='{"path":"a.png"}')]),
        ChatMessage(role="tool", tool_call_id="call_1", parts=[Text(text="a.png"), Image(url=DATA_URL, detail="auto")]),
        ChatMessage(role="tool", tool_call_id="call_2", parts=[Image(url=HTTP_URL, detail="low")]),
    ]
    queued_back(g)


def test_responses_text_only_is_as_before():
    items = [{"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
             {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_text", "text": "x"},
                                                                          {"type": "input_text", "text": "y"}]},
             {"type": "function_call_output", "call_id": "d", "output": "z"}]
    g = resp_req(input=items)
    assert g.messages == [ChatMessage(role="user", content="a\nb"), ChatMessage(role="tool", content="x\ny",
                                                                                tool_call_id="c"),
                          ChatMessage(role="tool", content="z", tool_call_id="d")]
    assert b'"parts"' not in encode(g)


def test_responses_previous_conversation_keeps_its_images():
    first = resp_req(input=[{"role": "user", "content": [{"type": "input_text", "text": "what?"}, input_image()]}])
    history = r.history_of(first, JobResult(choices=[Choice(text="a cat")]))
    g = r.to_generation_request(msgspec.convert({"input": "sure?"}, r.ResponsesRequest), max_model_len=64,
                                history=history)
    assert g.messages == [ChatMessage(role="user", parts=[Text(text="what?"), Image(url=DATA_URL, detail="auto")]),
                          ChatMessage(role="assistant", content="a cat"), ChatMessage(role="user", content="sure?")]


def test_responses_input_items_list_images_in_place():
    items = [{"role": "user", "content": [{"type": "input_text", "text": "a"}, input_image(HTTP_URL, "low")]},
             {"type": "function_call", "call_id": "call_1", "name": "view_image", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "call_1", "output": [input_image(None, None,
                                                                                          image_url=DATA_URL)]}]
    g = resp_req(input=items)
    raw = encode(r.render_input_items(g, "j1"))
    data = json.loads(raw)["data"]
    assert data[0] == {"type": "function_call_output", "id": "fco_j1_2", "call_id": "call_1", "status": "completed",
                       "output": [{"type": "input_image", "detail": "auto", "image_url": DATA_URL, "file_id": None}]}
    assert data[2]["content"] == [{"type": "input_text", "text": "a"},
                                  {"type": "input_image", "detail": "low", "image_url": HTTP_URL, "file_id": None}]
    ResponseItemList.model_validate_json(raw, strict=True)
    # Once admitted, an image is kept by its hash, not its URL: listed without one, never left out.
    stored = Image(sha256="ab" * 32, format="png", width=1, height=1, tokens=3)
    admitted = msgspec.structs.replace(g, messages=[ChatMessage(role="user", parts=[stored])])
    raw = encode(r.render_input_items(admitted, "j2"))
    assert json.loads(raw)["data"][0]["content"] == [{"type": "input_image", "detail": "auto", "image_url": None,
                                                      "file_id": None}]
    ResponseItemList.model_validate_json(raw, strict=True)


@pytest.mark.parametrize(("items", "param", "message"), [
    ([{"role": "user", "content": [input_image(file_id="file_1", url=None)]}], "input[0].content[0].file_id",
     "input[0].content[0]: an input_image by `file_id` is not supported (this server has no files API): send "
     "`image_url`, an http(s) URL or a data URL"),
    ([{"role": "user", "content": [input_image(None)]}], "input[0].content[0].image_url",
     "input[0].content[0]: an input_image needs `image_url`"),
    ([{"role": "user", "content": [{"type": "input_text", "text": "a"}, input_image("s3://bucket/x.png")]}],
     "input[0].content[1].image_url",
     "input[0].content[1].image_url: an image URL must be an http(s) URL or a data: URL"),
    ([{"role": "user", "content": [input_image(detail="ultra")]}], "input[0].content[0].detail",
     "input[0].content[0].detail: Input should be 'auto', 'low', 'high' or 'original', got 'ultra'"),
    ([{"role": "developer", "content": [input_image()]}], "input[0].content[0].type",
     "input[0].content[0]: content of type 'input_image' is not supported (text only: images go in user messages, "
     "not developer messages)"),
    ([{"role": "system", "content": [input_image()]}], "input[0].content[0].type",
     "input[0].content[0]: content of type 'input_image' is not supported (text only: images go in user messages, "
     "not system messages)"),
    ([{"type": "message", "role": "assistant", "content": [input_image()]}], "input[0].content[0].type",
     "input[0].content[0]: content of type 'input_image' is not supported (text only: images go in user messages, "
     "not assistant messages)"),
    ([{"type": "function_call_output", "call_id": "c", "output": [input_image(file_id="file_1", url=None)]}],
     "input[0].output[0].file_id",
     "input[0].output[0]: an input_image by `file_id` is not supported (this server has no files API): send "
     "`image_url`, an http(s) URL or a data URL"),
    ([{"type": "function_call_output", "call_id": "c", "output": [input_image("nope")]}],
     "input[0].output[0].image_url",
     "input[0].output[0].image_url: an image URL must be an http(s) URL or a data: URL"),
    ([{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_file", "file_id": "f"}]}],
     "input[0].output[0].type", "input[0].output[0]: content of type 'input_file' is not supported (text and "
     "images only)"),
    ([{"type": "reasoning", "summary": [], "content": [input_image()]}], "input[0].content[0].type",
     "input[0].content[0]: content of type 'input_image' is not supported (text only)"),
])
def test_responses_image_refusals(items, param, message):
    with pytest.raises(InvalidRequest) as info:
        resp_req(input=items)
    status, body = r.error_body(info.value)
    assert status == 400 and json.loads(encode(body)) == {"error": {
        "message": message, "type": "invalid_request_error", "param": param, "code": "invalid_request"}}


# --- Anthropic Messages ---------------------------------------------------------------------------


def b64(media_type: str | None = "image/png", data: str | None = PNG) -> dict:
    source = {"type": "base64"} | ({"media_type": media_type} if media_type else {}) | ({"data": data} if data else {})
    return {"type": "image", "source": source}


def url_block(url: str = HTTP_URL) -> dict:
    return {"type": "image", "source": {"type": "url", "url": url}}


def text(t: str) -> dict:
    return {"type": "text", "text": t}


def am_req(messages: list[dict], **fields) -> GenerationRequest:
    return am.to_generation_request(msgspec.convert({"model": "m", "max_tokens": 8, "messages": messages, **fields},
                                                    am.MessagesRequest))


def test_anthropic_user_turn_with_images_is_its_parts_in_order():
    g = am_req([{"role": "user", "content": [text("a"), b64("image/jpeg"), text("b"), text("c"), url_block()]}],
               system="be brief")
    assert g.messages == [
        ChatMessage(role="system", content="be brief"),
        ChatMessage(role="user", parts=[Text(text="a"), Image(data=PNG, media_type="image/jpeg"), Text(text="b\nc"),
                                        Image(url=HTTP_URL)]),
    ]
    queued_back(g)


def test_anthropic_consecutive_user_messages_are_one_turn_with_their_images():
    g = am_req([{"role": "user", "content": "look"}, {"role": "user", "content": [url_block(DATA_URL)]},
                {"role": "user", "content": "closely"}])
    assert g.messages == [ChatMessage(role="user", parts=[Text(text="look"), Image(url=DATA_URL),
                                                          Text(text="closely")])]


def test_anthropic_tool_result_images_are_the_tool_turns_parts():
    """Claude Code's ``Read`` of an image: a tool_result whose content is the image. The turn's
    results come first (as before), and its own text and images follow as the user turn."""
    call = {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"file_path": "/a.png"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": [b64("image/png")]}
    other = {"type": "tool_result", "tool_use_id": "toolu_2", "content": [text("x"), text("y"), b64("image/webp"),
                                                                          text("z")]}
    g = am_req([{"role": "user", "content": "show me"}, {"role": "assistant", "content": [call]},
                {"role": "user", "content": [result, text("and this"), url_block(), other]}])
    assert g.messages == [
        ChatMessage(role="user", content="show me"),
        ChatMessage(role="assistant", tool_calls=[ToolCall(id="toolu_1", name="Read",
                                                           arguments='{"file_path":"/a.png"}')]),
        ChatMessage(role="tool", tool_call_id="toolu_1", parts=[Image(data=PNG, media_type="image/png")]),
        ChatMessage(role="tool", tool_call_id="toolu_2", parts=[Text(text="x\ny"),
                                                                Image(data=PNG, media_type="image/webp"),
                                                                Text(text="z")]),
        ChatMessage(role="user", parts=[Text(text="and this"), Image(url=HTTP_URL)]),
    ]
    queued_back(g)


def test_anthropic_failed_tool_result_with_images_is_marked():
    def tool_turn(*content: dict) -> ChatMessage:
        g = am_req([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "is_error": True,
                                                  "content": list(content)}]}])
        return g.messages[0]
    image = Image(data=PNG, media_type="image/gif")
    assert tool_turn(text("bad"), b64("image/gif")).parts == [Text(text="Error: bad"), image]
    assert tool_turn(b64("image/gif")).parts == [Text(text="Error"), image]
    assert tool_turn(text("bad")) == ChatMessage(role="tool", content="Error: bad", tool_call_id="t")


def test_anthropic_text_only_is_as_before():
    result = {"type": "tool_result", "tool_use_id": "t", "content": [text("x"), text("y")]}
    g = am_req([{"role": "user", "content": [result, text("a"), text("b")]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "u"}, text("")]}])
    assert g.messages == [ChatMessage(role="tool", content="x\ny", tool_call_id="t"),
                          ChatMessage(role="tool", content="", tool_call_id="u"),
                          ChatMessage(role="user", content="a\nb\n")]
    assert b'"parts"' not in encode(g)


def test_anthropic_count_tokens_sees_the_images():
    messages = [{"role": "user", "content": [text("what?"), b64()]}]
    body = msgspec.convert({"model": "m", "messages": messages}, am.CountTokensRequest)
    counted, _, _ = am.chat_of(body)
    assert counted == am_req(messages).messages == [ChatMessage(role="user", parts=[
        Text(text="what?"), Image(data=PNG, media_type="image/png")])]


MEDIA = "Input should be 'image/jpeg', 'image/png', 'image/gif' or 'image/webp'"


@pytest.mark.parametrize(("fields", "message"), [
    (dict(messages=[{"role": "user", "content": [{"type": "image"}]}]), "messages.0.content.0.source: Field required"),
    (dict(messages=[{"role": "user", "content": [text("a"), {"type": "image", "source": {"type": "file",
                                                                                           "file_id": "f"}}]}]),
     "messages.0.content.1.source.type: Input should be 'base64' or 'url' (this server has no files API)"),
    (dict(messages=[{"role": "user", "content": [b64(data=None)]}]),
     "messages.0.content.0.source.data: Field required"),
    (dict(messages=[{"role": "user", "content": [b64(media_type=None)]}]),
     "messages.0.content.0.source.media_type: Field required"),
    (dict(messages=[{"role": "user", "content": [b64("image/bmp")]}]),
     f"messages.0.content.0.source.media_type: {MEDIA}"),
    (dict(messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "url"}}]}]),
     "messages.0.content.0.source.url: Field required"),
    (dict(messages=[{"role": "user", "content": [url_block("x")]}]),
     "messages.0.content.0.source.url: an image URL must be an http(s) URL or a data: URL"),
    (dict(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": [b64()]}]),
     "messages.1.content.0: `image` blocks can only be in `user` messages"),
    (dict(messages=[{"role": "system", "content": [b64()]}, {"role": "user", "content": "hi"}]),
     "messages.0.content.0: `image` blocks can only be in `user` messages"),
    (dict(system=[text("rules"), b64()]),
     "system.1: content blocks of type `image` are not supported by this server (text only)"),
    (dict(messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                  "content": [text("a"), b64("image/tiff")]}]}]),
     f"messages.0.content.0.content.1.source.media_type: {MEDIA}"),
    (dict(messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                  "content": [url_block("ftp://x/y.png")]}]}]),
     "messages.0.content.0.content.0.source.url: an image URL must be an http(s) URL or a data: URL"),
])
def test_anthropic_image_refusals(fields, message):
    with pytest.raises(InvalidRequest) as info:
        am_req(**fields) if "messages" in fields else am_req([{"role": "user", "content": "hi"}], **fields)
    status, body = am.error_body(info.value)
    assert status == 400 and json.loads(encode(body)) == {"type": "error", "error": {
        "type": "invalid_request_error", "message": message}}
