"""A chat rendered with the model's own chat template, tokenised: the prompt the engine sees.

One function for the worker, which feeds it to the engine (workers/engine.py), and for the API,
which counts it (Anthropic's ``count_tokens``, api/tokenizer.py): the same messages give the same
ids in both, so a count equals the ``input_tokens`` the job reports.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from shared.errors import InvalidRequest
from shared.schemas import ChatMessage, ChatOptions, Text, ToolUse

__all__ = ["chat_token_ids", "openai_tools"]


def chat_token_ids(tokenizer: Any, messages: Sequence[ChatMessage], options: ChatOptions,
                   tools: ToolUse | None = None) -> list[int]:
    """``messages`` (and ``tools``) through ``tokenizer.apply_chat_template``, tokenised there so
    the template's BOS is not doubled. A template that refuses them (a role it does not know, a bad
    kwarg) is the client's 400. Tools go to the template even with ``tool_choice: none``, as vLLM
    sends them."""
    rendered = _developer_roles(tokenizer, [_template_message(m) for m in messages])
    if any(m.parts for m in messages):
        rendered = [_as_parts(m) for m in rendered]
    try:
        encoded = tokenizer.apply_chat_template(
            rendered, tools=openai_tools(tools),
            tokenize=True,
            add_generation_prompt=options.add_generation_prompt,
            continue_final_message=options.continue_final_message, **options.template_kwargs,
        )
    except Exception as exc:  # jinja errors: a role the template refuses, a bad kwarg, ...
        raise InvalidRequest(f"the chat template could not render these messages: {exc}") from None
    return list(encoded["input_ids"] if not isinstance(encoded, list) else encoded)


def _developer_roles(tokenizer: Any, rendered: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``developer`` turns as vLLM renders them (``vllm/renderers/hf.py``): kept for a template that
    names the role; else sent as ``system``, and then every system turn is merged into one at the
    start (joined with a blank line), since many templates refuse a system turn anywhere else."""
    if not any(m["role"] == "developer" for m in rendered) or _names_developer(tokenizer):
        return rendered
    system = [_text(m["content"]) for m in rendered if m["role"] in ("system", "developer") and m["content"]]
    rest = [m for m in rendered if m["role"] not in ("system", "developer")]
    return [{"role": "system", "content": "\n\n".join(system)}, *rest]


def _text(content: str | list[dict[str, str]]) -> str:
    """A system turn's text (it holds no image: dialects put images in user and tool turns only)."""
    return content if isinstance(content, str) else "".join(p.get("text", "") for p in content)


def _names_developer(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    texts = template.values() if isinstance(template, dict) else [template or ""]
    return any('"developer"' in t or "'developer'" in t for t in texts)


def _as_parts(message: dict[str, Any]) -> dict[str, Any]:
    """A turn of a chat with images, its content as a list of parts, as multimodal templates
    (Idefics3's, SmolVLM's) take every turn of such a chat: vLLM's "openai" content format."""
    content = message["content"]
    if isinstance(content, str):
        message = {**message, "content": [{"type": "text", "text": content}] if content else []}
    return message


def _template_message(m: ChatMessage) -> dict[str, Any]:
    """A turn as chat templates take it (OpenAI's form). A call's arguments go as an object, as
    vLLM's ``_postprocess_messages`` passes them ("how tool-use chat templates expect them"),
    unless they are not a JSON object. A turn with images is a list of parts, an image as
    ``{"type": "image"}``: the template writes its placeholder, which the engine's processor
    expands to the image's tokens (the image itself goes to the engine beside the prompt)."""
    content: str | list[dict[str, str]] = m.content
    if m.parts:
        content = [{"type": "text", "text": p.text} if isinstance(p, Text) else {"type": "image"} for p in m.parts]
    out: dict[str, Any] = {"role": m.role, "content": content}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": _arguments(c.arguments)}}
                             for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.reasoning is not None:
        out["reasoning"] = m.reasoning
    return out


def _arguments(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def openai_tools(tools: ToolUse | None) -> list[dict[str, Any]] | None:
    """The tools in OpenAI's chat form, as chat templates and vLLM's parsers take them."""
    if tools is None or not tools.tools:
        return None
    # OpenAI's order (name, description, parameters, strict): templates dump the dict as it is.
    functions = ({"name": t.name, "description": t.description, "parameters": t.parameters or {}, "strict": t.strict}
                 for t in tools.tools)
    return [{"type": "function", "function": {k: v for k, v in f.items() if v is not None}} for f in functions]
