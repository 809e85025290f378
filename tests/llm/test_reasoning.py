"""Reasoning/answer split on the five real DeepSeek-R1 bodies and on the shapes our agent prompts produce."""
from __future__ import annotations

import json

import pytest

from tests.support.paths import FIXTURES
from trajforge.pipeline.ingest.dialects import parse_turn
from trajforge.pipeline.llm.client import parse_body
from trajforge.pipeline.llm.reasoning import recover_action, split_reasoning

R1 = FIXTURES / "reasoning" / "openhands_deepseek_r1"


def _choice(name: str):
    return parse_body(json.loads((R1 / name).read_bytes())).choices[0]


def test_reasoning_content_field_is_taken_as_is():
    c = _choice("jinja_turn1_reasoning_content_then_action.json")
    split = split_reasoning(c.content, c.reasoning_content)
    assert split.issue is None
    assert split.reasoning == c.reasoning_content.strip()
    assert split.content == c.content.strip()
    assert "<function=execute_bash>" in split.content and "<function=" not in split.reasoning


@pytest.mark.parametrize("name", ["nojinja_turn1_think_block_then_action.json",
                                  "nojinja_turn2_think_block_then_action.json"])
def test_think_block_is_split_from_the_answer(name):
    c = _choice(name)
    assert c.reasoning_content is None
    split = split_reasoning(c.content, c.reasoning_content)
    assert split.issue is None
    assert "<think>" not in split.reasoning and "</think>" not in split.reasoning
    assert split.reasoning.startswith("We are")
    assert split.content.startswith("I'll") and "<function=" in split.content
    assert "<think>" not in split.content and "</think>" not in split.content


def test_action_inside_reasoning_with_empty_content_is_recovered_and_marked():
    c = _choice("jinja_turn2_action_inside_reasoning_content_empty_content.json")
    assert c.content == ""
    split = split_reasoning(c.content, c.reasoning_content)
    assert split.issue == "action_in_reasoning"
    assert split.content.startswith("<function=execute_bash>")
    assert "ls -l /workspace/diffcalculia_mcp/tests" in split.content
    # The action moved out of the reasoning; the thinking before it stayed.
    assert "<function=" not in split.reasoning
    assert split.reasoning.endswith("directory.")


def test_unclosed_think_is_reasoning_and_its_trailing_action_is_recovered():
    c = _choice("nojinja_hackish_turn2_action_inside_unclosed_think.json")
    assert "<think>" in c.content and "</think>" not in c.content
    split = split_reasoning(c.content, c.reasoning_content)
    assert split.issue == "unclosed_think"
    assert split.content.startswith("<function=read_file>\n<parameter=path>")
    assert split.content.endswith("read_file.py</parameter>")
    assert "<think>" not in split.reasoning and "<function=read_file>" not in split.reasoning


def test_unclosed_think_without_an_action_gives_empty_content():
    split = split_reasoning("<think>\nLet me consider the permissions of the file and")
    assert split == type(split)("Let me consider the permissions of the file and", "", "unclosed_think")


def test_only_closing_tag_when_the_template_opened_think():
    split = split_reasoning("The file is owned by jack.\n</think>\nThink: run it as jack.\n\nAct: bash\n```bash\nsu - jack -c ~/test\n```")
    assert split.reasoning == "The file is owned by jack." and split.issue is None
    assert parse_turn(split.content).action.startswith("bash")


def test_recovered_react_turn_keeps_its_thought_and_parses():
    reasoning = ("I should count the files first.\nThink: count the files in /etc.\n\nAct: bash\n"
                 "```bash\nls /etc | wc -l\n```")
    split = split_reasoning("", reasoning)
    assert split.issue == "action_in_reasoning"
    parsed = parse_turn(split.content)
    assert (parsed.dialect, parsed.thought) == ("think_act", "count the files in /etc.")
    assert parsed.action == "bash\n```bash\nls /etc | wc -l\n```"
    assert split.reasoning == "I should count the files first."


def test_plain_answer_without_reasoning_passes_through():
    split = split_reasoning("Action: Answer\nFinal Answer: [\"3\"]", None)
    assert split.reasoning is None and split.issue is None and split.content.startswith("Action: Answer")


def test_no_action_anywhere_is_not_invented():
    assert recover_action("I am still thinking about which table to use.") is None
    split = split_reasoning("", "I am still thinking.")
    assert split.content == "" and split.issue is None
