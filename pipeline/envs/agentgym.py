"""AgentGym: one HTTP server per environment (webshop, alfworld, babyai, ...), one client for all.

The `agentgym` env (runtime: pipeline/synth/envs/agentgym.py) hosts every AgentGym env that has no
runtime of its own, and every recorded trajectory whose env does not run itself. Its action is the
AgentGym action string (the text after the last `Action:`), its tool `act`. AgentGym's envs that
run in-process (babyai, textcraft, sciworld) take the same task records and the same tool:
`in_process` makes their specs.
"""
from __future__ import annotations

import functools
import importlib
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trajforge.pipeline.envs import Argument, EnvSpec, Tool, specs
from trajforge.pipeline.envs.grammar import Grammar
from trajforge.pipeline.envs.tasks import Task, TaskFormatError

NAME = "agentgym"


@dataclass(frozen=True)
class ServerProfile:
    """How one AgentGym server differs from the common shape (the id's key, the reset arguments,
    where the reward is); an env spec carries its server's profile."""
    id_key: str = "id"
    reset_args: Callable[[int], dict[str, Any]] = field(default=lambda idx: {"data_idx": idx})
    observation_key: str = "observation"
    reward_key: str = "reward"
    # WebShop's reset answers no observation; its client reads GET /observation afterwards.
    observe_after_reset: bool = False


# The shape of AgentGym's generic client: a server with no profile (a new environment) speaks it.
COMMON_PROFILE = ServerProfile()


def server_profile(env_name: str) -> ServerProfile:
    """The profile of the server of `env_name`; one without a profile gets the common shape, not an error."""
    found = specs().get(env_name)
    return found.server if found is not None and found.server is not None else COMMON_PROFILE


_ACTION = re.compile(r"Action:\s*", re.I)


def extract_action(text: str) -> str:
    """The text after the last `Action:` (AgentGym clients send only that), else the whole text."""
    parts = _ACTION.split(text)
    return parts[-1].strip()


def item_index(value: Any) -> int:
    """AgentGym item ids are ints or `<env>_<n>` strings (AgentTraj-L `item_id`)."""
    if isinstance(value, int):
        return value
    found = re.search(r"(\d+)$", str(value))
    if not found:
        raise ValueError(f"no item index in {value!r}")
    return int(found.group(1))


def task_format(record: dict, tid: str, source_file: str, env: str = NAME) -> Task:
    """Whatever the server needs (`env_name`, `item_id`), passed through in `data`."""
    if not isinstance(record.get("description", ""), str):
        raise TaskFormatError("description must be a string")
    data = dict(record.get("data") or {})
    data.update({k: v for k, v in record.items() if k not in ("id", "env", "description", "data")})
    return Task(tid, env, record.get("description", ""), data, source_file)


ACT = Tool("act", "Take one action in the environment, in its own action syntax (e.g. `search[red shoes]`).",
           (Argument("action", "The action to take."),), "What the environment shows after the action.",
           lambda action: f"Action: {action}")


def act_call(action: str) -> dict | None:
    command = extract_action(action)
    return {"name": "act", "arguments": {"action": command}} if command else None


TOOL_INSTRUCTIONS = ("You are an agent in an interactive environment. Think briefly, then call `act` with exactly "
                     "one action per turn, in the environment's own action syntax; the environment answers with "
                     "what happened.")
# AgentTraj-L item ids name the server's task index: `<env>_<n>` (ALFWorld's are game names).
_ITEM_ID = re.compile(r"[a-z_]+_\d+")


def recorded_task(record: dict) -> Task | None:
    """The AgentGym task an AgentTraj-L trajectory was recorded on (its `item_id`, `<env>_<n>`,
    names the server's task index), or None: AgentInstruct / Agent-FLAN rows carry no task an
    environment can load, and ALFWorld item ids are game names, not indices."""
    if record["source"] != "agenttraj_l" or not _ITEM_ID.fullmatch(record["source_id"]):
        return None
    index = item_index(record["source_id"])
    return Task(f"{record['env']}/{index}", NAME, record["task"],
                {"env_name": record["env"], "item_id": index}, record["source_file"])


AGENTGYM_FORMAT = "Thought:\n{thought}\n\nAction:\n{action}"


def reference_steps(task: Task) -> list | None:
    """The oracle: the actions of the task's `reference` list."""
    actions = task.data.get("reference")
    if not isinstance(actions, list) or not actions:
        return None
    return [AGENTGYM_FORMAT.format(thought="The reference solution's next step.", action=a) for a in actions]


def random_moves(*actions: str) -> tuple[str, ...]:
    return tuple(AGENTGYM_FORMAT.format(thought="A random move.", action=a) for a in actions)


def needs(*modules: str, java: bool = False) -> Callable[[dict], str | None]:
    """Why an in-process env cannot run here: a module of the `envs` extra missing, or no Java runtime."""
    def unavailable(settings: dict) -> str | None:
        for module in modules:
            try:
                importlib.import_module(module)
            except ImportError as exc:
                return f"the `envs` extra is not installed ({exc})"
        if java and shutil.which("java") is None:
            return "ScienceWorld needs a Java runtime"
        return None
    return unavailable


def _server_unavailable(settings: dict) -> str | None:
    return None if settings.get("base_url") else "needs an AgentGym server: give its URL (--agentgym-url)"


def in_process(name: str, runtime: str, instructions: str, grammar: Grammar, server: ServerProfile | None = None,
               task_pattern: re.Pattern | None = None, unavailable: Callable[[dict], str | None] | None = None,
               moves: tuple[str, ...] = (), eval_split: dict[str, Any] | None = None) -> EnvSpec:
    """The spec of an AgentGym env that also runs in-process: its own task records (AgentGym items under
    its own name), its benchmark's ReAct instructions, and the HTTP client's tool, so a trajectory of
    either runs in the other. A prefix replays the same way in a fresh instance (the same seeded level,
    recipe set or simulator variation)."""
    return EnvSpec(name, grammar=grammar, task_pattern=task_pattern, server=server, runtime=runtime,
                   task_format=functools.partial(task_format, env=name), instructions=instructions,
                   tool_instructions=TOOL_INSTRUCTIONS, tools=(ACT,), tool_call=act_call, replayable=True,
                   unavailable=unavailable, eval_split=eval_split, reference_steps=reference_steps,
                   random_moves=random_moves(*moves))


SPECS = [EnvSpec(NAME, runtime="trajforge.pipeline.synth.envs.agentgym:AgentGymEnv", task_format=task_format,
                 tool_instructions=TOOL_INSTRUCTIONS, tools=(ACT,), tool_call=act_call, hosts_recorded=True,
                 recorded_task=recorded_task, record_env=lambda task: task.data.get("env_name", task.env),
                 unavailable=_server_unavailable, reference_steps=reference_steps)]
