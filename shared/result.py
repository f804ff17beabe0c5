"""Folding a job's events into its final result.

The worker uses this to write ``result`` into the job record; the API uses the same code to
answer non-streaming requests from the events it relayed, so both always agree.
"""

from __future__ import annotations

from shared.events import Done, Error, Event, TokenDelta, Tokens
from shared.schemas import Choice, JobResult, Pooled, PromptInfo, ToolCall, Usage

__all__ = ["ResultBuilder"]


def _extend(target: list | None, items: list | None) -> list | None:
    if items is None:
        return target
    if target is None:
        return list(items)
    target.extend(items)
    return target


class ResultBuilder:
    def __init__(self) -> None:
        self._choices: dict[int, Choice] = {}
        # Text arrives in many small pieces: join once at the end instead of re-concatenating.
        self._text_parts: dict[int, list[str]] = {}
        self._reasoning_parts: dict[int, list[str]] = {}
        self._calls: dict[int, dict[int, list[str]]] = {}  # choice -> call index -> [id, name, *arguments]
        self.usage = Usage()
        self.prompt: PromptInfo | None = None
        self.pooled: Pooled | None = None

    def _choice(self, index: int) -> Choice:
        choice = self._choices.get(index)
        if choice is None:
            choice = self._choices[index] = Choice(index=index, token_ids=[])
            self._text_parts[index] = []
        return choice

    def add(self, event: Event) -> None:
        match event:
            case Tokens():
                self._deltas(event)
            case Done():
                self._deltas(event)
                self.usage = event.usage
                self.pooled = event.pooled
            case Error():
                pass  # a terminal error has no result: the caller raises it

    def _deltas(self, event: Tokens | Done) -> None:
        if event.prompt is not None:
            self.prompt = event.prompt
        self.add_deltas(event.deltas)

    def add_deltas(self, deltas: list[TokenDelta]) -> None:
        """A token event's deltas, without the event (a worker encodes its events from their
        deltas, with no event object in between: workers/attempt.py)."""
        for delta in deltas:
            choice = self._choice(delta.index)
            self._text_parts[delta.index].append(delta.text)
            if delta.reasoning:
                self._reasoning_parts.setdefault(delta.index, []).append(delta.reasoning)
            for call in delta.tool_calls:
                parts = self._calls.setdefault(delta.index, {}).setdefault(call.index, ["", ""])
                if call.id is not None:
                    parts[0], parts[1] = call.id, call.name or ""
                parts.append(call.arguments)
            choice.token_ids.extend(delta.token_ids)
            choice.token_texts = _extend(choice.token_texts, delta.token_texts)
            choice.logprobs = _extend(choice.logprobs, delta.logprobs)
            choice.top_logprobs = _extend(choice.top_logprobs, delta.top_logprobs)
            if delta.finish_reason is not None:
                choice.finish_reason = delta.finish_reason
                choice.stop_reason = delta.stop_reason

    def result(self) -> JobResult:
        choices = []
        for index in sorted(self._choices):
            choice = self._choices[index]
            choice.text = "".join(self._text_parts[index])
            if index in self._reasoning_parts:
                choice.reasoning = "".join(self._reasoning_parts[index])
            if index in self._calls:
                calls = self._calls[index]
                choice.tool_calls = [ToolCall(id=calls[i][0], name=calls[i][1], arguments="".join(calls[i][2:]))
                                     for i in sorted(calls)]
            choices.append(choice)
        return JobResult(choices=choices, usage=self.usage, prompt=self.prompt, pooled=self.pooled)
