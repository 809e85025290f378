"""GRPO reward functions for agent turns, in a registry (name -> function).

Each function follows TRL's reward signature, `f(completions, **columns) -> list[float | None]`,
where the columns are the `grpo` config's: `rendering` (native|react), `dialect` (the format
the prompt asks for, as parsed from the reference turn), `answer`, `env`, `domain`, `task`.
`None` means "does not apply to this row" and TRL leaves it out of the weighted sum.

- `format`: the completion parses as the dialect its prompt asks for (Think/Act in the react
  rendering, the env's own dialect in native), so a response always follows its prompt.
- `tag_count`: partial credit per structural check (one thought marker, one action marker, in
  order, a non-empty action), the agent analogue of open-r1's <think>/<answer> tag counting.
- `accuracy`: the final answer the completion gives against the row's `answer`, normalized
  exact match, and order-insensitive set match for list answers (DB rows, KG entity sets).
- `tool_call`: for multi-turn rollouts in an environment (`environment` column), the share of the
  model's turns that call one of the environment's tools with the arguments it takes: the format
  reward of the tool-call action format. The episode's score itself comes from the environment
  (the adapters' `get_reward`, training/environments.py), not from this registry.
- `env`: replays the action in the registered environment (`pipeline.envs.make_env`) for the
  row's `env_task` and returns its reward; None where a row has no task or no environment.
- `rm=PATH`, `prm=PATH`: a trained reward model (`trajforge train rm` / `prm`) scores the prompt and
  the completion as one conversation: the outcome model's scalar, or the process model's lowest
  step score over the completion's steps (single-turn replies and whole episodes alike).
"""
from __future__ import annotations

import importlib
import json
import re
from collections.abc import Callable

from trajforge.pipeline.ingest.dialects import DIALECTS, FREE_TEXT, extract_answer, parse_answer_list, parse_turn
from trajforge.pipeline.registry import Registry, UnknownName

REACT_DIALECT = "think_act"

def completion_text(completion) -> str:
    """TRL passes a string for plain prompts and a message list for conversational ones."""
    if isinstance(completion, str):
        return completion
    return "".join(m["content"] for m in completion if m.get("role", "assistant") == "assistant")


def expected_dialect(rendering: str | None, dialect: str | None) -> str | None:
    if rendering == "react":
        return REACT_DIALECT
    return dialect if dialect and dialect != FREE_TEXT else None


def _column(kwargs: dict, name: str, n: int) -> list:
    return kwargs.get(name) or [None] * n


def _score_each(completions, kwargs: dict, score) -> list[float | None]:
    """Apply `score(text, expected_dialect)` to each completion; None where no format is expected."""
    n = len(completions)
    rewards: list[float | None] = []
    for completion, rendering, dialect in zip(completions, _column(kwargs, "rendering", n),
                                              _column(kwargs, "dialect", n)):
        want = expected_dialect(rendering, dialect)
        rewards.append(None if want is None else score(completion_text(completion).strip(), want))
    return rewards


def _format_score(text: str, want: str) -> float:
    return 1.0 if text and parse_turn(text).dialect == want else 0.0


def format_reward(completions, **kwargs) -> list[float | None]:
    return _score_each(completions, kwargs, _format_score)


def _line_starts(text: str, marker: str) -> list[int]:
    return [m.start() for m in re.finditer(rf"(?m)^[ \t]*{re.escape(marker)}", text)]


def _tag_count_score(text: str, want: str) -> float:
    markers = DIALECTS[want].markers if want in DIALECTS else None
    if markers is None:
        # JSON / dict tool calls (and names no dialect has): one well-formed call is the whole structure.
        return _format_score(text, want)
    thought_marker, action_marker = markers
    thoughts = _line_starts(text, thought_marker) if thought_marker else []
    actions = _line_starts(text, action_marker)
    score = 0.25 * (len(thoughts) <= 1)                       # at most one thought (it is optional)
    score += 0.25 * (len(actions) == 1)                       # exactly one action: one step per turn
    score += 0.25 * (len(actions) == 1 and all(t < actions[0] for t in thoughts))  # think, then act
    if len(actions) == 1:
        body = text[actions[0]:].strip()[len(action_marker):].strip()
        score += 0.25 * bool(body)                            # the action says something
    return score


def tag_count_reward(completions, **kwargs) -> list[float | None]:
    return _score_each(completions, kwargs, _tag_count_score)


def _norm(value) -> str:
    """Case, spacing, quotes and number formatting do not change an answer: `12000.0` == `12000`."""
    text = str(value).strip().strip("'\"`").strip().rstrip(".").casefold()
    text = re.sub(r"\s+", " ", text)
    try:
        number = float(text.replace(",", ""))
    except ValueError:
        return text
    return repr(round(number, 6)) if number != int(number) else str(int(number))


def answers_match(predicted: str, reference: str) -> bool:
    pred_list, ref_list = parse_answer_list(predicted), parse_answer_list(reference)
    if pred_list is not None and ref_list is not None:
        return sorted(map(_norm, pred_list)) == sorted(map(_norm, ref_list))
    if ref_list is not None and len(ref_list) == 1:  # `Final Answer: 28` against `[28]`
        return _norm(predicted) == _norm(ref_list[0])
    return _norm(predicted) == _norm(reference)


def accuracy_reward(completions, **kwargs) -> list[float | None]:
    n = len(completions)
    rewards: list[float | None] = []
    # Episodes in an environment (`environment` column) answer by tool call; their environment scores them.
    for completion, answer, environment in zip(completions, _column(kwargs, "answer", n),
                                               _column(kwargs, "environment", n)):
        if answer is None or environment is not None:
            rewards.append(None)
            continue
        text = completion_text(completion).strip()
        parsed = parse_turn(text) if text else None
        predicted = extract_answer(parsed.action, parsed.dialect) if parsed else None
        rewards.append(float(predicted is not None and answers_match(predicted, answer)))
    return rewards


def env_reward(completions, **kwargs) -> list[float | None]:
    """Replay each completion's action in a fresh environment for the row's `env_task` (a task
    record as `pipeline.envs.tasks` reads it, or its JSON text) and return the environment's reward.
    None for rows without a task or whose env has no registered environment."""
    n = len(completions)
    from trajforge.pipeline.envs.tasks import coerce_task
    from trajforge.pipeline.synth.envs import env_class

    rewards: list[float | None] = []
    for completion, task in zip(completions, _column(kwargs, "env_task", n)):
        if task is None:
            rewards.append(None)
            continue
        task = coerce_task(json.loads(task) if isinstance(task, str) else task)
        try:
            environment = env_class(task.env)
        except UnknownName:  # no environment registered under this name; a bug in one's constructor raises
            rewards.append(None)
            continue
        env = environment()
        text = completion_text(completion).strip()
        parsed = parse_turn(text) if text else None
        try:
            env.reset(task)
            rewards.append(float(env.step(parsed.action).reward) if parsed and parsed.action else 0.0)
        finally:
            env.close()
    return rewards


def _valid_call(call: dict, environment: str) -> bool:
    from trajforge.pipeline.envs import spec

    function = call.get("function") or {}
    try:
        tool = spec(environment).tool(function.get("name"))
    except ValueError:  # no tool of the environment
        return False
    arguments = function.get("arguments")
    return isinstance(arguments, dict) and set(arguments) == {a.name for a in tool.arguments}


def tool_call_reward(completions, **kwargs) -> list[float | None]:
    n = len(completions)
    rewards: list[float | None] = []
    for completion, environment in zip(completions, _column(kwargs, "environment", n)):
        if environment is None or isinstance(completion, str):
            rewards.append(None)
            continue
        # The reply after the last observation may close the episode in words: only the turns
        # that led to an observation, or all of them when none did, must be calls.
        last_tool = max((i for i, m in enumerate(completion) if m.get("role") == "tool"), default=len(completion))
        turns = [m for m in completion[:last_tool] if m.get("role") == "assistant"]
        good = sum(len(m.get("tool_calls") or []) == 1 and _valid_call(m["tool_calls"][0], environment)
                   for m in turns)
        rewards.append(good / len(turns) if turns else 0.0)
    return rewards


REWARDS: Registry[Callable[..., list[float | None]]] = Registry("reward", {
    "format": format_reward,
    "tag_count": tag_count_reward,
    "accuracy": accuracy_reward,
    "env": env_reward,
    "tool_call": tool_call_reward,
})


class ModelReward:
    """A trained (process) reward model as a reward function, loaded on first call, on this
    process's GPU when there is one. TRL names a reward by `__name__`."""

    def __init__(self, kind: str, path: str):
        MODEL_REWARDS[kind]  # an unknown kind fails here, with the known ones
        self.kind, self.path, self.__name__ = kind, path, f"{kind}_reward"
        self._model = None

    def _load(self):
        import os

        import torch

        model = importlib.import_module(MODEL_REWARDS[self.kind][0])
        loaded = getattr(model, MODEL_REWARDS[self.kind][1]).load(self.path)
        if torch.cuda.is_available():
            loaded.model.to(torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))))
        return loaded

    def __call__(self, prompts, completions, **kwargs) -> list[float | None]:
        if self._model is None:
            self._model = self._load()
        as_messages = lambda turns, role: [{"role": role, "content": turns}] if isinstance(turns, str) else turns  # noqa: E731
        conversations = [as_messages(p, "user") + as_messages(c, "assistant") for p, c in zip(prompts, completions)]
        if self.kind == "prm":
            # Only the completion's steps are the policy's; the prompt's are context.
            conversations = [[{**m, "loss": i >= len(as_messages(p, "user"))} for i, m in enumerate(c)]
                             for p, c in zip(prompts, conversations)]
        return self._model.score(conversations)


# kind -> (module, class) of a trained reward model with `load(path)` and `score(conversations)`.
MODEL_REWARDS: Registry[tuple[str, str]] = Registry("model reward", {
    "rm": ("trajforge.training.reward_model", "RewardModel"),
    "prm": ("trajforge.training.process_reward_model", "ProcessRewardModel"),
})


def get_rewards(names: list[str]) -> list[Callable]:
    """The reward functions of `names`: registry names, or `rm=PATH` / `prm=PATH` (ModelReward)."""
    return [ModelReward(*n.split("=", 1)) if "=" in n else REWARDS[n] for n in names]
