"""One action format from SFT to RL: an environment's actions as tool calls.

Each environment's ReAct actions (AgentBench OS `bash` + block / `answer(...)` / `finish`, DBBench
`Operation` + SQL / `Answer` + `Final Answer: [...]`, AgentGym's action string) map one-to-one to
a named tool call with typed arguments, and back to the action text the environment's `step`
parses. The TRL adapters (training/environments.py) expose exactly these tools, so a trajectory
rendered with `tool_messages` (SFT) and an RL rollout of the same task show the model the same
calls, the same tool schema, and the same observations as `tool` messages.
"""
from __future__ import annotations

import re
from typing import Any

from trajforge.pipeline.synth.envs import LOCAL_AGENTGYM
from trajforge.pipeline.synth.envs.agentgym import extract_action
from trajforge.pipeline.synth.envs.db import _DECLARED, _FINAL, _SQL_BLOCK
from trajforge.pipeline.synth.envs.os_sandbox import parse_os_action

# Which environment a trajectory's `env` runs in: AgentBench OS and DB; every other env name is an
# AgentGym server env (webshop, alfworld, ...).
ENV_OF = {"os": "os", "db": "db"}

# env -> tool name -> argument names, in the order the action text needs them.
TOOLS: dict[str, dict[str, tuple[str, ...]]] = {
    "os": {"bash": ("command",), "answer": ("text",), "finish": ()},
    "db": {"execute_sql": ("query",), "submit": ("answer",)},
    "agentgym": {"act": ("action",)},
}


def environment_of(env: str) -> str:
    return ENV_OF.get(env, "agentgym")


def action_text(environment: str, name: str, arguments: dict[str, Any]) -> str:
    """The ReAct action text `step` parses, for one tool call. Unknown tools raise ValueError
    (TRL turns the error into the tool's answer, so the model sees what went wrong)."""
    expected = TOOLS[environment].get(name)
    if expected is None:
        raise ValueError(f"unknown tool {name!r}; the tools are {', '.join(TOOLS[environment])}")
    missing = [a for a in expected if a not in arguments]
    if missing:
        raise ValueError(f"{name}: missing argument(s) {', '.join(missing)}")
    args = [str(arguments[a]) for a in expected]
    if name == "bash":
        return f"Act: bash\n\n```bash\n{args[0]}\n```"
    if name == "answer":
        return f"Act: answer({args[0]})"
    if name == "finish":
        return "Act: finish"
    if name == "execute_sql":
        return f"Action: Operation\n```sql\n{args[0]}\n```"
    if name == "submit":
        return f"Action: Answer\nFinal Answer: {args[0]}"
    return f"Action: {args[0]}"


def tool_call(environment: str, action: str) -> dict | None:
    """The tool call `{"name", "arguments"}` of a ReAct action (parsed `action` of a turn), None when
    the action is not one the environment can run."""
    if environment == "os":
        kind, arg = parse_os_action(action)
        return {"bash": {"name": "bash", "arguments": {"command": (arg or "").rstrip("\n")}},
                "answer": {"name": "answer", "arguments": {"text": arg}},
                "finish": {"name": "finish", "arguments": {}}}.get(kind)
    if environment == "db":
        declared = _DECLARED.search(action)
        final = _FINAL.search(action) if not declared or declared.group(1) == "Answer" else None
        if final:
            return {"name": "submit", "arguments": {"answer": final.group(1).strip()}}
        block = _SQL_BLOCK.search(action)
        return {"name": "execute_sql", "arguments": {"query": block.group(1).strip()}} if block else None
    command = extract_action(action)
    return {"name": "act", "arguments": {"action": command}} if command else None


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
    return [{"role": "system", "content": INSTRUCTIONS[environment_of(record["env"])]},
            {"role": "user", "content": task}]


# The agent's instructions when its actions are tool calls (the ReAct instructions of
# pipeline/synth/agent.py describe the same actions as text).
INSTRUCTIONS = {
    "os": ("You are an assistant working in a Linux (Ubuntu) shell. Solve the problem I give you by running "
           "commands, or answer the question I ask. Think briefly, then call exactly one tool per turn: `bash` "
           "runs commands (they must not wait for input; long outputs are cut), `answer` gives the answer to a "
           "question, `finish` ends a task that has nothing to answer."),
    "db": ("I will ask you a question about a table; answer it, or change the table as asked, by operating a "
           "SQLite database. Think briefly, then call exactly one tool per turn: `execute_sql` runs one SQL "
           "statement (quote names with backticks) and returns the raw rows; `submit` commits your answer, a "
           "list of the values only such as [\"ANSWER1\", \"ANSWER2\"] (also after a change to the table)."),
    "agentgym": ("You are an agent in an interactive environment. Think briefly, then call `act` with exactly "
                 "one action per turn, in the environment's own action syntax; the environment answers with "
                 "what happened."),
}
# AgentGym's environments run in-process take the same action, so the same tool, as its HTTP client.
for _name in LOCAL_AGENTGYM:
    TOOLS[_name], INSTRUCTIONS[_name] = TOOLS["agentgym"], INSTRUCTIONS["agentgym"]
