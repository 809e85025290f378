"""Bounded, deterministic per-env pools for the negative makers that need other records.

`wrong_answer` / `premature_answer` take another task's answer of the same env, and
`irrelevant_tools` the offered tools (the first user turn) of another tool env. Scanning every
positive for each record is quadratic and needs all records in memory; the pools keep, per env,
only what those makers can pick from:

- answers: the first `max_answers` distinct answers of the env's positives, in build order (all of
  them while an env has fewer);
- tool prompts: the last first-user-turn of the env's positives and the last one that differs from
  it. A maker excludes the record's own prompt, so these two always hold the pick the full scan
  would make (the last qualifying record of each env).

Pools are filled in build order from the records that are kept, so the same inputs give the same
pools whatever the batching. A build fills one pool per unit (in parallel) and merges them in unit
order (`merge`): the result is the pool of all units' records in order, because a unit's pool
keeps all that the merged pool can take from it (its first distinct answers; its last prompt and
the last one that differs from it).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

MAX_ANSWERS = 1024


@dataclass
class EnvPools:
    max_answers: int = MAX_ANSWERS
    answers: dict[str, dict[str, None]] = field(default_factory=dict)
    # env -> [last tool prompt, last tool prompt that differs from it]
    tool_prompts: dict[str, list[str | None]] = field(default_factory=dict)
    # env -> its answers sorted, made when a maker first asks (the pools are complete by then) and
    # dropped when the env's answers change: not a sort of up to `max_answers` answers per negative.
    _sorted_answers: dict[str, list[str]] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def of(cls, records, max_answers: int = MAX_ANSWERS) -> EnvPools:
        pools = cls(max_answers)
        for record in records:
            pools.add(record)
        return pools

    def add(self, record: dict) -> None:
        if record["kind"] != "positive":
            return
        env = record["env"]
        if record["answer"]:
            seen = self.answers.setdefault(env, {})
            if len(seen) < self.max_answers:
                seen.setdefault(record["answer"], None)
                self._sorted_answers.pop(env, None)
        first = record["conversations"][0] if record["conversations"] else None
        if record["domain"] == "tool" and first is not None and first["role"] == "user":
            self._add_prompt(env, first["content"])

    def merge(self, later: EnvPools) -> None:
        """Add the pool of records that come after this pool's records (in place)."""
        for env, answers in later.answers.items():
            self._sorted_answers.pop(env, None)
            seen = self.answers.setdefault(env, {})
            for answer in answers:
                if len(seen) >= self.max_answers:
                    break
                seen.setdefault(answer, None)
        for env, (last, before) in later.tool_prompts.items():
            for prompt in (before, last):
                if prompt is not None:
                    self._add_prompt(env, prompt)

    def _add_prompt(self, env: str, prompt: str) -> None:
        last = self.tool_prompts.setdefault(env, [None, None])
        if last[0] is not None and last[0] != prompt:
            last[1] = last[0]
        last[0] = prompt

    def wrong_answers(self, env: str, own: str | None) -> list[str]:
        """Distinct answers of `env` other than `own`, sorted."""
        ordered = self._sorted_answers.get(env)
        if ordered is None:
            ordered = self._sorted_answers[env] = sorted(self.answers.get(env, ()))
        at = bisect.bisect_left(ordered, own) if own is not None else len(ordered)
        if at < len(ordered) and ordered[at] == own:
            return ordered[:at] + ordered[at + 1:]
        return ordered[:]

    def tool_prompts_of_other_envs(self, env: str, own_prompt: str) -> list[tuple[str, str]]:
        """(env, first user turn) of every other tool env, sorted by env; never `own_prompt`."""
        out = []
        for other, (last, before) in sorted(self.tool_prompts.items()):
            pick = last if last != own_prompt else before
            if other != env and pick is not None:
                out.append((other, pick))
        return out
