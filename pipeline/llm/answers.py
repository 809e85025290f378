"""Asking a model for an answer of a given form (a JSON verdict), and asking again when it is not."""
from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from trajforge.pipeline.llm.client import ChatBackend
from trajforge.pipeline.llm.reasoning import split_reasoning

Parsed = TypeVar("Parsed")


class FormatError(ValueError):
    """An answer that is not of the form asked for; `reason` is a code."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


async def ask_parsed(backend: ChatBackend, messages: list[dict], parse: Callable[[str], Parsed], retry_prompt: str,
                     max_format_retries: int = 1, max_tokens: int | None = None) -> Parsed:
    """`parse(answer)` of the model's answer, its reasoning split off. An answer cut off by `max_tokens`, or
    one that `parse` refuses with a FormatError, is shown back with `retry_prompt` and asked again, at most
    `max_format_retries` times; then its FormatError is raised. An LLMError is raised as it comes."""
    error: FormatError | None = None
    for attempt in range(max_format_retries + 1):
        result = await backend.chat(messages, max_tokens=max_tokens)
        choice = result.choices[0]
        try:
            if choice.truncated:
                raise FormatError("truncated", "the answer was cut off by max_tokens")
            return parse(split_reasoning(choice.content, choice.reasoning_content).content)
        except FormatError as exc:
            error = exc
        if attempt < max_format_retries:
            messages = [*messages, {"role": "assistant", "content": choice.content or "(empty)"},
                        {"role": "user", "content": retry_prompt}]
    raise error
