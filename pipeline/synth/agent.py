"""The ReAct agent loop: one episode of a model against an environment, and its record.

An episode alternates model turns and environment steps until the environment says done (a
final answer, `finish`, or a commit), or `max_turns` model actions were taken. Every model reply
is split into reasoning and answer (`pipeline.reasoning`) and parsed with the same dialect parser
the ingest uses, so a synthetic record is held to the rules of every other record.

A reply the environment cannot act on (no action in any dialect, empty, or cut off by
`max_tokens`) is not sent to the environment: the model is asked again, at most
`max_format_retries` times in a row, and the rejected reply is dropped from the record (it would
teach the format error) but logged in `meta.steps` with its reason. The history sent back to
the model carries the answers only, never the reasoning, as DeepSeek recommends for R1.

An episode always ends in an `Episode` with a status: `success` (scored at or above the
threshold, and a valid record), or `failure` with a reason code and the partial conversation.

Every text that comes from outside (model replies, observations, error messages) passes through the
backend's `redact` (the configured API key, HF tokens, bearer tokens) before the episode keeps it.
"""
from __future__ import annotations

import asyncio
import logging
import re
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from trajforge.pipeline.envs import spec, specs
from trajforge.pipeline.ingest.dialects import FREE_TEXT, ParseError, clean_text, extract_answer, parse_turn
from trajforge.pipeline.ingest.validate import validate_record
from trajforge.pipeline.llm.client import ChatBackend, LLMError, family_of, prepare_messages
from trajforge.pipeline.llm.reasoning import split_reasoning
from trajforge.pipeline.synth.config import AgentConfig
from trajforge.pipeline.synth.envs.base import EnvFailure
from trajforge.schemas.record import TrajectoryRecord, new_record
from trajforge.sources.synthetic import Synthetic

log = logging.getLogger("trajforge.agent")
SYNTHETIC = Synthetic()

REPROMPTS = {
    "format_error": "Your reply has no action I can run. Reply again in exactly the format I described, with "
                    "one action.",
    "no_answer": "Your reply was empty after your reasoning. Reply with your next action in the format I described.",
    "empty_response": "I received an empty reply. Reply with your next action in the format I described.",
    "truncated": "Your reply was cut off before its action. Think more briefly and reply with one action.",
}

EMPTY_OBSERVATION = "(no output)"

@dataclass
class StepLog:
    turn: int
    valid: bool
    issue: str | None = None          # why the reply or the action was not valid
    reasoning_issue: str | None = None  # action_in_reasoning | unclosed_think (recovered)
    finish_reason: str | None = None


@dataclass
class Episode:
    task_id: str
    sample: int
    env: str
    status: str                       # success | failure
    reason: str | None = None         # failure reason code
    detail: str = ""
    reward: float | None = None
    answer: str | None = None
    turns: list[dict] = field(default_factory=list)   # the conversation, schema turns
    steps: list[StepLog] = field(default_factory=list)
    usage: dict[str, int] = field(default_factory=dict)
    record: dict | None = None
    rejected: list[dict] = field(default_factory=list)  # replies re-prompted away: turn, issue, text
    sampling: dict[str, Any] = field(default_factory=dict)  # the parameters the last request really sent

    @property
    def transient(self) -> bool:
        """Failed for reasons outside the model and task: worth running again later."""
        return self.status == "failure" and (self.reason or "").startswith(("llm_error", "env_error"))


def _turn(role: str, content: str, **parsed: Any) -> dict:
    return {"role": role, "content": content, "loss": role == "assistant", "thought": parsed.get("thought"),
            "action": parsed.get("action"), "reasoning": parsed.get("reasoning"), "dialect": parsed.get("dialect")}


def conversation_for(model: str, turns: list[dict]) -> list[dict]:
    """The turns as the model saw them: for R1 the system turn is folded into the first user turn."""
    sent = prepare_messages(model, [{"role": t["role"], "content": t["content"]} for t in turns])
    offset = len(turns) - len(sent)
    out = []
    for i, message in enumerate(sent):
        source = turns[i + offset]
        out.append({**source, "content": message["content"]} if i or not offset else
                   {**turns[offset], "content": message["content"]})
    return out


def instructions_for(env_name: str, config: AgentConfig) -> str:
    text = config.instructions.get(env_name)
    if text is None and env_name in specs():
        text = spec(env_name).instructions
    if text is None:
        raise KeyError(f"no agent instructions for env {env_name!r}; give them in AgentConfig.instructions")
    return text


def _check_reply(choice) -> tuple[Any, str | None, Any]:
    """(split, issue, parsed) for one choice; issue None means the reply carries an action."""
    split = split_reasoning(choice.content, choice.reasoning_content)
    if choice.empty:
        return split, "empty_response", None
    if choice.truncated:
        # A cut-off reply may hold half a command; never run it.
        return split, "truncated", None
    if not split.content.strip():
        return split, "no_answer", None
    try:
        parsed = parse_turn(split.content)
    except ParseError:
        return split, "no_answer", None
    if parsed.dialect == FREE_TEXT or parsed.action is None:
        return split, "format_error", None
    return split, None, parsed


class _Ended(Exception):
    """The episode ended early (a failure); `episode` is its outcome."""

    def __init__(self, episode: Episode):
        super().__init__(episode.reason)
        self.episode = episode


async def run_episode(backend: ChatBackend, make_env: Callable[[], Any], task: Any, sample: int,
                      config: AgentConfig = AgentConfig(), prefix: list[dict] = ()) -> Episode:
    """Run one episode of `task` (a pipeline.envs.tasks.Task) as draw number `sample`.

    `prefix`: assistant turns (schema turns with `action`) of an earlier trajectory, replayed in the
    fresh environment before the model takes over (salvage, `pipeline.salvage`). They count towards
    `max_turns`; their observations are the ones the environment gives now. A prefix whose replay
    ends the episode fails it as `prefix_ended`."""
    episode = Episode(task.id, sample, task.env, "failure")
    overrides = {"max_tokens": config.max_tokens, "stop": list(config.stop) if config.stop else None,
                 "seed": None if config.seed is None else config.seed + sample}
    env = None
    # Environments are blocking and may be bound to the thread that made them (SQLite connections,
    # a shell's pipes): each episode gets one thread of its own for every env call.
    thread = ThreadPoolExecutor(1, thread_name_prefix="env")
    loop = asyncio.get_running_loop()

    def on_env_thread(fn, *args):
        return loop.run_in_executor(thread, fn, *args)

    try:
        try:
            env = await on_env_thread(make_env)
            observation = await on_env_thread(env.reset, task)
        except Exception as exc:  # a reason, not a crash (see `_env_error`)
            return _env_error(episode, "reset", exc, backend)
        turns = [_turn("system", instructions_for(task.env, config)), _turn("user", _observed(backend, observation))]
        await _replay_prefix(episode, backend, on_env_thread, env, prefix, turns)
        for turn_no in range(len(prefix), config.max_turns):
            split, parsed, choice = await _next_action(episode, backend, turns, turn_no, overrides,
                                                       config.max_format_retries)
            turns.append(_turn("assistant", clean_text(split.content), thought=parsed.thought, action=parsed.action,
                               reasoning=split.reasoning, dialect=parsed.dialect))
            try:
                step = await on_env_thread(env.step, parsed.action)
            except Exception as exc:
                return _env_error(episode, "step", exc, backend, turns)
            episode.steps.append(_step_log(turn_no, step, split.issue, choice.finish_reason))
            if step.done:
                return _finish(episode, step, turns, backend, task, config)
            turns.append(_turn("user", _observed(backend, step.observation)))
        return _fail(episode, "max_turns", f"no final answer in {config.max_turns} turns", turns)
    except _Ended as ended:
        return ended.episode
    finally:
        if env is not None:
            await _close_env(env, on_env_thread, episode, backend)
        thread.shutdown(wait=False)


def _observed(backend: ChatBackend, observation: str) -> str:
    """An observation as the episode keeps it: stripped and redacted, never empty."""
    return backend.redact(observation.strip()) or EMPTY_OBSERVATION


async def _replay_prefix(episode: Episode, backend: ChatBackend, on_env_thread: Callable, env: Any,
                         prefix: list[dict], turns: list[dict]) -> None:
    """Step the prefix's actions in the environment, appending them and their observations to `turns`;
    raises _Ended when a step fails or ends the episode."""
    for turn_no, replayed in enumerate(prefix):
        turns.append(_turn("assistant", replayed["content"], thought=replayed.get("thought"),
                           action=replayed["action"], reasoning=replayed.get("reasoning"),
                           dialect=replayed.get("dialect")))
        try:
            step = await on_env_thread(env.step, replayed["action"])
        except Exception as exc:
            raise _Ended(_env_error(episode, f"replaying step {turn_no}", exc, backend, turns)) from exc
        episode.steps.append(_step_log(turn_no, step, None, None))
        if step.done:
            raise _Ended(_fail(episode, "prefix_ended", f"replaying step {turn_no} ended the episode", turns))
        turns.append(_turn("user", _observed(backend, step.observation)))


async def _next_action(episode: Episode, backend: ChatBackend, turns: list[dict], turn_no: int,
                       overrides: dict[str, Any], max_format_retries: int) -> tuple[Any, Any, Any]:
    """(split, parsed, choice) of the model's next reply that carries an action. A reply without one is
    logged in the episode and re-prompted away; raises _Ended on an LLM error or too many such replies."""
    nudges: list[dict] = []  # re-prompts since the last valid reply; sent, never recorded
    retries = 0
    while True:
        messages = [{"role": t["role"], "content": t["content"]} for t in turns] + nudges
        try:
            result = await backend.chat(messages, sample=episode.sample, **overrides)
        except LLMError as exc:
            raise _Ended(_fail(episode, f"llm_error:{exc.reason}", backend.redact(exc.detail))) from exc
        for key, value in result.usage.items():
            episode.usage[key] = episode.usage.get(key, 0) + value
        episode.sampling = result.params
        choice = result.choices[0]
        choice = replace(choice, content=backend.redact(choice.content),
                         reasoning_content=backend.redact(choice.reasoning_content))
        split, issue, parsed = _check_reply(choice)
        if issue is None:
            return split, parsed, choice
        episode.steps.append(StepLog(turn_no, False, issue, split.issue, choice.finish_reason))
        episode.rejected.append({"turn": turn_no, "issue": issue, "content": choice.content,
                                 "reasoning": choice.reasoning_content, "finish_reason": choice.finish_reason})
        retries += 1
        if retries > max_format_retries:
            raise _Ended(_fail(episode, issue, f"{retries} replies in a row without an action", turns))
        if split.content.strip():
            nudges.append({"role": "assistant", "content": split.content.strip()})
        nudges.append({"role": "user", "content": REPROMPTS[issue]})


async def _close_env(env: Any, on_env_thread: Callable, episode: Episode, backend: ChatBackend) -> None:
    try:
        await on_env_thread(env.close)
    except Exception as exc:  # the episode's outcome stands; the leak is the env's to report
        log.warning("closing env for %s~%d failed: %s", episode.task_id, episode.sample,
                    backend.redact(f"{type(exc).__name__}: {exc}"))


def _step_log(turn_no: int, step: Any, reasoning_issue: str | None, finish_reason: str | None) -> StepLog:
    info = step.info or {}
    valid = info.get("valid", True) is not False
    # `error`: the action ran but failed (an SQL error, a non-zero exit); still a valid step.
    problem = None if valid else "invalid_action"
    if valid and info.get("error"):
        problem = "action_error"
    return StepLog(turn_no, valid, problem, reasoning_issue, finish_reason)


# Environment bugs whose traceback was logged, by (exception type, innermost frame): one a run.
_LOGGED_ENV_BUGS: set[tuple[str, str]] = set()


def _env_error(episode: Episode, where: str, exc: Exception, backend: ChatBackend,
               turns: list[dict] | None = None) -> Episode:
    """Fail the episode as `env_error` (transient: a rerun tries it again). A declared `EnvFailure`
    (sandbox missing, server down) needs no more; any other exception is a bug in environment
    code, and its traceback is logged the first time that bug shows, so that a bug failing every
    episode is one traceback in the log, and still an `env_error` in each episode's count."""
    if not isinstance(exc, EnvFailure):
        frames = traceback.extract_tb(exc.__traceback__)
        bug = (type(exc).__name__, f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "")
        if bug not in _LOGGED_ENV_BUGS:
            _LOGGED_ENV_BUGS.add(bug)
            log.error("a bug in the %s environment (%s of %s~%d); its episodes fail as env_error, this "
                      "traceback is shown once:\n%s", episode.env, where, episode.task_id, episode.sample,
                      backend.redact("".join(traceback.format_exception(exc))))
    return _fail(episode, "env_error", backend.redact(f"{where}: {type(exc).__name__}: {exc}"), turns)


def _fail(episode: Episode, reason: str, detail: str, turns: list[dict] | None = None) -> Episode:
    episode.status, episode.reason, episode.detail = "failure", reason, detail[:1000]
    episode.turns = turns or []
    return episode


def _finish(episode: Episode, step: Any, turns: list[dict], backend: ChatBackend, task: Any,
            config: AgentConfig) -> Episode:
    info = step.info or {}
    score = info.get("score", step.reward)
    episode.reward = None if score is None else float(score)
    last = turns[-1]
    episode.answer = info.get("answer") if isinstance(info.get("answer"), str) else extract_answer(last["action"], last["dialect"])
    episode.turns = turns
    if episode.reward is None:
        return _fail(episode, "unscored", "the task has no known answer to score against", turns)
    success = bool(info.get("success", episode.reward >= config.success_threshold))
    if not success:
        return _fail(episode, "wrong_answer", f"score {episode.reward}", turns)
    record = build_record(episode, backend, task, config)
    violation = validate_record(record)
    if violation is not None:
        return _fail(episode, f"invalid_record:{violation.reason}", violation.detail, turns)
    episode.status, episode.record = "success", record
    return episode


def record_id(task_id: str, sample: int) -> str:
    safe = re.sub(r"\s+", "_", task_id)
    return f"synthetic/{safe}~{sample}"


def build_record(episode: Episode, backend: ChatBackend, task: Any, config: AgentConfig) -> TrajectoryRecord:
    """A `source: synthetic` record in the trajectory schema; provenance and sampling in `meta`."""
    env_name = spec(task.env).record_env(task)
    meta = {
        "generator": {"model": backend.model, "family": family_of(backend.model).name},
        "sampling": episode.sampling,
        "sample": episode.sample,
        "reward": episode.reward,
        "task_id": task.id,
        "usage": episode.usage,
        "steps": [asdict(s) for s in episode.steps],
    }
    return new_record(
        id=record_id(task.id, episode.sample), source=SYNTHETIC.name, source_id=f"{task.id}~{episode.sample}",
        source_file=task.source_file or "", license=config.license, domain=SYNTHETIC.domain_of(env_name),
        env=env_name, task=task.description.strip() or task.id, answer=episode.answer, reward=episode.reward,
        success=True, conversations=conversation_for(backend.model, episode.turns), meta=meta)
