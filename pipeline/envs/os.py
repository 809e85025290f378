"""AgentBench OS: a Linux shell task (runtime: the sandbox of pipeline/synth/envs/os_sandbox.py).

Task records (AgentBench OS, recognised by their `evaluation` object) become `data`: `init` (list of
scripts run as separate processes before the episode), `start` (a script run in the agent's shell,
or None), `evaluation` (`match`, or `check`: a list of scripts / None, plus `example`), `image`,
`labels`. A script is `{"language": "bash"|"python", "code": str}`. The scoring rule is upstream's
(AgentBench, as the fixtures README describes it).

Actions (Think/Act): `bash` + a ```bash block, `answer(...)`, `finish`; as tools `bash`, `answer`, `finish`.
"""
from __future__ import annotations

import re
from typing import Any

from trajforge.pipeline.envs import Argument, EnvSpec, Tool, spec
from trajforge.pipeline.envs.grammar import INVENTED_VERBS, Breach, Context, Grammar, Replies, starts
from trajforge.pipeline.envs.tasks import Task, TaskFormatError

NAME = "os"
# Script text that needs a package registry or the internet; the sandbox has no network, so a
# task whose setup or reference solution needs one cannot pass offline and is marked, not faked.
_NEEDS_NETWORK = re.compile(
    r"\b(?:apt(?:-get)?\s+(?:-\S+\s+)*(?:update|install|upgrade|dist-upgrade)|pip3?\s+install|npm\s+install|"
    r"git\s+clone)\b|\b(?:curl|wget)\b[^\n]*\b(?:https?|ftp)://(?!localhost|127\.)")


# --- tasks ---------------------------------------------------------------------------------------
# --- OS ------------------------------------------------------------------------------------------
def _script(value: Any, where: str) -> dict[str, str]:
    """Normalise an upstream script (plain string, {code}, {language, code}) to {language, code}."""
    if isinstance(value, str):
        return {"language": "bash", "code": value}
    if isinstance(value, dict):
        if "file" in value:
            raise _NeedsScriptFile(f"{where} refers to an upstream script file {value['file']!r}")
        if isinstance(value.get("code"), str):
            language = value.get("language", "bash")
            if language not in ("bash", "python"):
                raise TaskFormatError(f"{where}: unknown script language {language!r}")
            return {"language": language, "code": value["code"]}
    raise TaskFormatError(f"{where}: a script is a string or {{language?, code}}, got {value!r}")


class _NeedsScriptFile(TaskFormatError):
    """The record points into upstream's scripts folder, which task files do not carry."""


def _init_scripts(create: dict) -> list[dict[str, str]]:
    init = create.get("init")
    return [] if init is None else [_script(s, "create.init") for s in (init if isinstance(init, list) else [init])]


def _os_evaluation(evaluation: dict) -> dict[str, Any]:
    """`match` or `check` (scripts, None where the example fills in), plus `example`."""
    if "match" in evaluation:
        match = evaluation["match"]
        if not (isinstance(match, str) or (isinstance(match, dict) and ("answer" in match or "regex" in match))):
            raise TaskFormatError(f"evaluation.match: unsupported {match!r}")
        ev: dict[str, Any] = {"match": match}
    elif "check" in evaluation:
        check = evaluation["check"]
        ev = {"check": [None if c is None else _script(c, "evaluation.check")
                        for c in (check if isinstance(check, list) else [check])]}
    else:
        raise TaskFormatError("evaluation needs `match` or `check`")
    ev["example"] = _script(evaluation["example"], "evaluation.example") if evaluation.get("example") else None
    if None in ev.get("check", []) and ev["example"] is None:
        raise TaskFormatError("evaluation.check has a null entry but there is no example to fill it")
    return ev


def _os_task(record: dict, tid: str, source_file: str) -> Task:
    description = record.get("description")
    evaluation = record.get("evaluation")
    if not isinstance(description, str) or not isinstance(evaluation, dict):
        raise TaskFormatError("an OS task needs a string `description` and an `evaluation` object")
    try:
        create = record.get("create")
        # Upstream treats a non-dict `create` (two records hold a copy of `check` there) as
        # "default image, no init".
        create = create if isinstance(create, dict) else {}
        init_scripts = _init_scripts(create)
        start = _script(record["start"], "start") if record.get("start") is not None else None
        ev = _os_evaluation(evaluation)
    except _NeedsScriptFile as e:
        # Keep the task visible (counted, reported) but unrunnable, with the reason.
        return Task(tid, NAME, description, {"raw": record}, source_file, skip_reason=str(e))
    data = {"init": init_scripts, "start": start, "evaluation": ev,
            "image": create.get("local") or "default", "labels": list(record.get("labels") or []),
            # Top-level `example` is ignored upstream; kept as an informational reference solution.
            "example": _script(record["example"], "example") if record.get("example") else None}
    scripts = [*init_scripts, start, ev["example"], *ev.get("check", [])]
    skip = None
    if any(s is not None and _NEEDS_NETWORK.search(s["code"]) for s in scripts):
        skip = "needs the network (package install/download in its setup, check or reference solution); the sandbox is offline"
    return Task(tid, NAME, description, data, source_file, skip_reason=skip)


def os_match(answer: str | None, match: str | dict) -> bool:
    """Upstream `match`: exact after strip; {"answer", "strip"}; or {"regex"} with re.search."""
    if answer is None:
        return False
    if isinstance(match, str):
        return answer.strip() == match
    if "regex" in match:
        return re.search(match["regex"], answer) is not None
    return (answer.strip() if match.get("strip", True) else answer) == match["answer"]


def reference_answer(task: Task) -> str | None:
    """An OS `match` answer; a task scored by a check script has none."""
    match = task.data["evaluation"].get("match")
    if isinstance(match, str):
        return match
    return match.get("answer") if isinstance(match, dict) else None


def task_prompt(task: Task) -> str:
    """The first user message as upstream words it."""
    return f"Now, I will start a new problem in a new OS. My problem is:\n\n{task.description}"


# --- actions -------------------------------------------------------------------------------------
_BASH_BLOCK = re.compile(r"```(?:bash|sh|shell)?[ \t]*\n(.*?)```", re.S)
_ACT = re.compile(r"(?:^|\n)\s*Act:\s*", re.I)


def parse_os_action(text: str) -> tuple[str, str | None]:
    """("bash", code) | ("answer", value) | ("finish", None) | ("invalid", reason).

    Takes the action part of a Think/Act turn, or the whole text when there is no `Act:`."""
    parts = _ACT.split(text)
    action = parts[-1].strip() if len(parts) > 1 else text.strip()
    if action.startswith("bash"):
        m = _BASH_BLOCK.search(action)
        if not m:
            return "invalid", "`bash` needs a ```bash code block"
        return "bash", m.group(1)
    if action.startswith("answer("):
        end = action.rfind(")")
        if end < len("answer("):
            return "invalid", "`answer(` without a closing parenthesis"
        return "answer", action[len("answer("):end]
    if action.startswith("finish"):
        return "finish", None
    return "invalid", "the action must be `bash` with a code block, `answer(...)` or `finish`"


# The agent's instructions, in AgentBench OS's action syntax.
INSTRUCTIONS = (
    "You are an assistant working in a Linux (Ubuntu) shell that I operate for you. Solve the problem I "
    "give you by running commands, or answer the question I ask. In every turn, first think about what to "
    "do, then take exactly one of three actions.\n\n"
    "To run bash code:\n\nThink: your reasoning\n\nAct: bash\n\n```bash\n# your commands\n```\n\n"
    "When the task is done and there is nothing to answer:\n\nThink: your reasoning\n\nAct: finish\n\n"
    "When you know the answer to the question:\n\nThink: your reasoning\n\nAct: answer(the answer, "
    "nothing else, inside the parentheses)\n\n"
    "Long outputs are cut; deal with that yourself. Your commands must not wait for input.")

# The same actions as tool calls.
TOOL_INSTRUCTIONS = ("You are an assistant working in a Linux (Ubuntu) shell. Solve the problem I give you by running "
                     "commands, or answer the question I ask. Think briefly, then call exactly one tool per turn: `bash` "
                     "runs commands (they must not wait for input; long outputs are cut), `answer` gives the answer to a "
                     "question, `finish` ends a task that has nothing to answer.")

TOOLS = (
    Tool("bash", "Run bash commands in the Linux shell of this task and return their output.",
         (Argument("command", "The bash commands to run; they must not wait for input."),),
         "The output of the commands (cut when long).", lambda command: f"Act: bash\n\n```bash\n{command}\n```"),
    Tool("answer", "Give the answer to the question and end the episode.",
         (Argument("text", "The answer, nothing else."),),
         "A note that the episode is over.", lambda text: f"Act: answer({text})"),
    Tool("finish", "End the episode when the task is done and there is nothing to answer.", (),
         "A note that the episode is over.", lambda: "Act: finish"),
)


def tool_call(action: str) -> dict | None:
    kind, arg = parse_os_action(action)
    return {"bash": {"name": "bash", "arguments": {"command": (arg or "").rstrip("\n")}},
            "answer": {"name": "answer", "arguments": {"text": arg}},
            "finish": {"name": "finish", "arguments": {}}}.get(kind)


# --- evaluation ----------------------------------------------------------------------------------
_OS_OUTPUT = re.compile(r"^The output of the OS:\s*", re.S)


def _bash(code: str, language: str = "bash") -> str:
    if language == "python":
        code = f"python3 - <<'TRAJFORGE_EOF'\n{code}\nTRAJFORGE_EOF"
    return f"Think: I run the reference solution.\n\nAct: bash\n\n```bash\n{code}\n```"


def _last_line(observation: str) -> str | None:
    text = _OS_OUTPUT.sub("", observation.strip())
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("[truncated")]
    return lines[-1].strip() if lines else None


def reference_steps(task: Task) -> list | None:
    """The oracle: run `evaluation.example` (or the top-level `example`) in the shell, then answer the
    expected `match` string, or, for a check task, the last line the reference printed (`finish` when it
    printed nothing)."""
    ev = task.data.get("evaluation") or {}
    example = ev.get("example") or task.data.get("example")
    match = ev.get("match")
    expected = match if isinstance(match, str) else match.get("answer") if isinstance(match, dict) else None
    if example is None and expected is None:
        return None
    steps: list = [_bash(example["code"], example["language"])] if example else []
    if expected is not None:
        steps.append(f"Think: The reference answer.\n\nAct: answer({expected})")
    else:
        steps.append(lambda obs: (f"Think: The reference printed it.\n\nAct: answer({line})"
                                  if (line := _last_line(obs)) else "Think: Done.\n\nAct: finish"))
    return steps


def unavailable(settings: dict) -> str | None:
    """Why the sandbox cannot run here: its runtime's own probe, reached through the spec's `runtime`
    name as every runtime is (the runtime imports this module's parser and scorer, not the reverse)."""
    return spec(NAME).env_class().unavailable_reason()


_OS_FILES = tuple(f"agentbench/os/{name}" for name in
                  ("4-N4.json", "4-N41.json", "4-Q47.json", "4-Q49.json", "6-new.json", "dev.json"))


# --- grammar -------------------------------------------------------------------------------------
# Our OS env answers an action it cannot parse with `Invalid action: ...` (os_sandbox). A command
# that runs and fails (`No such file or directory`) is the shell's answer, not a refusal: exploring
# with it is part of the task.
OS_REPLIES = Replies({"os.invalid_action": starts(r"Invalid action: ")})


def _os_check(action: str, context: Context) -> Breach | None:
    kind, why = parse_os_action(action)
    if kind != "invalid":
        return None
    text = action.strip()
    rule = "os.bash_block" if text.startswith("bash") else "os.answer" if text.startswith("answer(") else "os.command"
    return Breach(rule, f"{text[:120]!r}: {why}")


def _os_breaks(action: str, context: Context) -> dict[str, str]:
    text = action.strip()
    verb_end = text.find("(") if text.startswith("answer(") else len(text.split()[0])
    out = {"os.command": INVENTED_VERBS[0] + text[verb_end:]}
    if text.startswith("bash"):
        out["os.bash_block"] = "bash " + parse_os_action(text)[1].strip().replace("\n", "; ")
    if text.startswith("answer("):
        out["os.answer"] = text.rstrip(")")
    return out


def _os_terminal(action: str) -> bool:
    return parse_os_action(action)[0] in ("answer", "finish")


GRAMMAR = Grammar(NAME, "AgentBench OS prompt: `bash` + a ```bash block, `answer(...)`, `finish` "
                  "(pipeline/envs/os.parse_os_action)",
                  {"os.command": "bash, answer(...) or finish",
                   "os.bash_block": "`bash` is followed by a ```bash code block",
                   "os.answer": "`answer(` is closed"},
                  _os_check, _os_breaks, _os_terminal, "with `answer(...)` or `finish`", replies=OS_REPLIES)

SPECS = [EnvSpec(
    NAME, grammar=GRAMMAR,
    task_start=re.compile(r"^Now, I will start a new problem in a new OS\. My problem is:\s*"),
    task_pattern=re.compile(r"My problem is:\s*(.+)$", re.S), recorded_here=True,
    runtime="trajforge.pipeline.synth.envs.os_sandbox:OsSandboxEnv", task_format=_os_task,
    recognizes=lambda record: isinstance(record.get("evaluation"), dict), first_prompt=task_prompt,
    instructions=INSTRUCTIONS, tool_instructions=TOOL_INSTRUCTIONS, tools=TOOLS, tool_call=tool_call,
    reference_answer=reference_answer, replayable=True, unavailable=unavailable,
    eval_split={"name": "agentbench-os-dev", "files": _OS_FILES, "held_out_by": "text",
                "about": "AgentBench OS interaction, the dev tasks the repository carries, in the offline sandbox"},
    reference_steps=reference_steps,
    random_moves=("Think: I give up.\n\nAct: finish", "Think: Look around.\n\nAct: bash\n\n```bash\nls\n```"))]
