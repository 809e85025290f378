"""One action format from SFT to RL: an environment's actions as tool calls.

Each environment's ReAct actions (AgentBench OS `bash` + block / `answer(...)` / `finish`, DBBench
`Operation` + SQL / `Answer` + `Final Answer: [...]`, AgentGym's action string) map one-to-one to
a named tool call with typed arguments, and back to the action text the environment's `step`
parses; each env spec lists its tools once (`pipeline.envs.Tool`). The TRL adapters
(training/environments.py) expose exactly these tools, so a trajectory rendered with `tool_messages`
(SFT) and an RL rollout of the same task show the model the same calls, the same tool schema, and
the same observations as `tool` messages.
"""
from __future__ import annotations

import re
from typing import Any

from trajforge.pipeline.envs import recorded_in, spec


def environment_of(env: str) -> str:
    """The environment a trajectory recorded as `env` runs in (its tools, its tool instructions)."""
    return recorded_in(env).name


def action_text(environment: str, name: str, arguments: dict[str, Any]) -> str:
    """The ReAct action text `step` parses, for one tool call (ValueError for an unknown tool)."""
    return spec(environment).action_text(name, arguments)


def tool_call(environment: str, action: str) -> dict | None:
    """The tool call `{"name", "arguments"}` of a ReAct action (parsed `action` of a turn), None when
    the action is not one the environment can run."""
    return spec(environment).tool_call(action)


_THINK = re.compile(r"^\s*(?:Think|Thought|THOUGHT):\s*", re.I)


def first_trained(turns: list[dict]) -> int:
    """The first trained assistant turn: what comes before it (instructions, the "OK."
    acknowledgement, one-shot demonstrations) is context, not a trajectory step."""
    return next((i for i, t in enumerate(turns) if t["role"] == "assistant" and t.get("loss", True)), len(turns))


def tool_messages(record: dict, prompt: list[dict], tools: list[dict]) -> dict | None:
    """A trajectory in TRL's tool-calling format, `{"messages", "tools"}`: `prompt` (the task's
    tool-format prompt, as its `grpo_env` row holds it, or `trajectory_prompt`) replaces the turns
    before the first trained assistant turn, whose ReAct instructions no longer apply; each assistant turn becomes a
    `tool_calls` message (the thought kept as content), each observation after it a `tool` message.
    None when an action does not map to a tool call (the record keeps its ReAct rendering).
    Assistant messages keep the turn's `loss` and `critical` flags, which say what SFT trains on
    (`loss_on: critical` reads the second)."""
    environment = environment_of(record["env"])
    turns = record["conversations"]
    first = first_trained(turns)
    messages: list[dict] = [dict(m) for m in prompt]
    pending: str | None = None  # the tool whose observation the next user turn is
    for turn in turns[first:]:
        if turn["role"] == "assistant":
            call = tool_call(environment, turn.get("action") or "")
            if call is None:
                return None
            thought = _THINK.sub("", turn.get("thought") or "").strip()
            messages.append({"role": "assistant", "content": thought, "loss": bool(turn.get("loss", True)),
                             "critical": turn.get("critical"),
                             "tool_calls": [{"type": "function", "function": call}]})
            pending = call["name"]
        elif turn["role"] == "user" and pending is not None:
            messages.append({"role": "tool", "name": pending, "content": turn["content"]})
            pending = None
        else:
            messages.append({"role": turn["role"], "content": turn["content"]})
    return {"messages": messages, "tools": tools}


def trajectory_prompt(record: dict) -> list[dict]:
    """The tool-format prompt of a recorded trajectory: the tool instructions of its environment,
    then the user turn right before its first assistant turn (the task, or the first observation),
    which replaces the ReAct instructions and demonstrations before it."""
    turns = record["conversations"]
    first = first_trained(turns)
    task = next((t["content"] for t in reversed(turns[:first]) if t["role"] == "user"), record.get("task") or "")
    return [{"role": "system", "content": recorded_in(record["env"]).tool_instructions},
            {"role": "user", "content": task}]
