"""Split a reasoning model's reply into its chain of thought and its answer.

Servers return the chain of thought in one of two places: a separate `reasoning_content` field
(vLLM/SGLang with a reasoning parser, DeepSeek's API, llama.cpp --jinja), or inline in `content`
as `<think>...</think>` (no parser; some templates put `<think>` in the prompt so only the closing
tag comes back). Two failure shapes are real and common (../shared/fixtures/reasoning):

* the action is written inside the reasoning and `content` is empty;
* `<think>` is opened and never closed, with the action inside it.

In both the model did decide on an action, so it is recovered from the end of the reasoning and
the split is marked (`issue`), which the agent records on the step: such a turn is usable, but a
trainer may want to know it was repaired.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"

# Where an action starts, in the formats the agent prompts ask for (Think/Act, Thought/Action,
# DBBench's Action: Operation) and in OpenHands' text function calls (the fixtures). The last
# thought marker before the last action marker starts the recovered turn, so that the recovered
# text parses in its own dialect.
ACTION_MARKER = re.compile(r"(?m)^[ \t]*(?:Act:|Action:|ACTION:|<function=)")
THOUGHT_MARKER = re.compile(r"(?m)^[ \t]*(?:Think:|Thought:|THOUGHT:)")


@dataclass(frozen=True)
class Split:
    reasoning: str | None
    content: str
    issue: str | None = None  # action_in_reasoning | unclosed_think | None


def recover_action(reasoning: str) -> tuple[str, str] | None:
    """(reasoning before the action, the action turn) from the tail of a reasoning text, if it has one."""
    actions = list(ACTION_MARKER.finditer(reasoning))
    if not actions:
        return None
    act = actions[-1]
    start = act.start()
    thoughts = [m for m in THOUGHT_MARKER.finditer(reasoning, 0, act.start())]
    if thoughts and not ACTION_MARKER.search(reasoning, thoughts[-1].end(), act.start()):
        start = thoughts[-1].start()
    turn = _dedent(reasoning[start:])
    if not turn:
        return None
    return reasoning[:start].rstrip(), turn


def _dedent(text: str) -> str:
    # R1 indents calls it writes inside its reasoning ("   <function=read_file>"); the parsers
    # expect the marker at the start of a line.
    lines = text.strip("\n").split("\n")
    indent = min((len(line) - len(line.lstrip()) for line in lines if line.strip()), default=0)
    return "\n".join(line[indent:] for line in lines).strip()


def split_reasoning(content: str | None, reasoning_content: str | None = None) -> Split:
    """Reasoning and answer of one reply; see the module docstring for the cases."""
    content = content or ""
    if reasoning_content and reasoning_content.strip():
        # A server that both parses and leaves a stray closing tag in the content.
        answer = content.split(CLOSE, 1)[1] if CLOSE in content and OPEN not in content else content
        return _answer_or_action_in_reasoning(reasoning_content.strip(), answer)
    head, sep, tail = content.partition(OPEN)
    if sep and not head.strip():
        if CLOSE in tail:
            reasoning, answer = tail.split(CLOSE, 1)
            return _answer_or_action_in_reasoning(reasoning, answer)
        return _unclosed_think(tail)
    if CLOSE in content:
        # The template opened <think> in the prompt; only the closing tag is in the reply.
        reasoning, answer = content.split(CLOSE, 1)
        return Split(reasoning.strip() or None, answer.strip())
    return Split(None, content.strip())


def _answer_or_action_in_reasoning(reasoning: str, answer: str) -> Split:
    """The answer when there is one; else the action written at the end of the reasoning, if any."""
    if answer.strip():
        return Split(reasoning.strip() or None, answer.strip())
    recovered = recover_action(reasoning)
    if recovered is None:
        return Split(reasoning.strip() or None, "")
    return Split(recovered[0] or None, recovered[1], "action_in_reasoning")


def _unclosed_think(reasoning: str) -> Split:
    """A reply that opened <think> and never closed it: all reasoning, unless an action ends it."""
    recovered = recover_action(reasoning)
    if recovered is None:
        return Split(reasoning.strip() or None, "", "unclosed_think")
    return Split(recovered[0] or None, recovered[1], "unclosed_think")
