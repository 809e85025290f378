"""ScienceWorld in-process, on the `scienceworld` package, as AgentGym's SciWorld server serves it.

The package runs the simulator in a JVM (Java 17 or later on the PATH). AgentGym's server
(agentenv-sciworld) numbers its tasks by listing every variation of every ScienceWorld task
but seven (`5-1`, `5-2`, `9-1`, `9-2`, `9-3`, `10-1`, `10-2`), in the simulator's task order; item
`n` (AgentTraj-L `sciworld_<n>`) is the n-th of that list. Its first observation is the task
description and what `look around` answers; every step is the simulator's own answer, and the
episode ends when the simulator says done. The simulator scores 0-100 (negative when the task
failed); the score here is that divided by 100, floored at 0.
"""
from __future__ import annotations

import shutil
from typing import Any

from trajforge.pipeline.envs.agentgym import extract_action, item_index
from trajforge.pipeline.envs.tasks import Task, coerce_task
from trajforge.pipeline.synth.envs.base import ClosingEnvironment, EnvFailure, StepResult

# The simulator's answer to an action it cannot parse.
UNKNOWN_ACTION = "No known action matches that input."
EXCLUDED_TASKS = {"5-1", "5-2", "9-1", "9-2", "9-3", "10-1", "10-2"}



def games(simulator: Any) -> list[tuple[str, int]]:
    """AgentGym's task list: (task name, variation) for every task it serves, in its order."""
    return [(name, variation) for key, name in simulator.tasks.items() if key not in EXCLUDED_TASKS
            for variation in range(simulator.get_max_variations(name))]


class SciWorldEnv(ClosingEnvironment):
    name = "sciworld"

    def __init__(self, step_limit: int = 100) -> None:
        self.step_limit = step_limit
        self._simulator: Any = None
        self._games: list[tuple[str, int]] = []
        self._done = True

    def reset(self, task: Task | dict) -> str:
        t = coerce_task(task)
        if t.env != self.name:
            raise ValueError(f"task {t.id} is for env {t.env!r}, not {self.name!r}")
        if self._simulator is None:
            if shutil.which("java") is None:
                raise EnvFailure("ScienceWorld needs a Java runtime (java on the PATH); none was found")
            from scienceworld import ScienceWorldEnv

            self._simulator = ScienceWorldEnv("", envStepLimit=self.step_limit)
            self._games = games(self._simulator)
        index = item_index(t.data.get("item_id", t.data.get("data_idx", 0)))
        if not 0 <= index < len(self._games):
            raise ValueError(f"task {t.id}: item {index} is not one of the {len(self._games)} ScienceWorld variations")
        self._simulator.load(*self._games[index])
        description = self._simulator.get_task_description()
        observation, _, _, _ = self._simulator.step("look around")
        self._done = False
        return f"{description}\n{observation}"

    def step(self, action: str) -> StepResult:
        if self._simulator is None or self._done:
            raise RuntimeError("step() before reset() or after the episode ended")
        command = extract_action(action)
        observation, reward, done, info = self._simulator.step(command)
        result: dict[str, Any] = {"valid": not observation.startswith(UNKNOWN_ACTION), "action": command,
                                  "simulator_score": info["score"]}
        if done:
            self._done = True
            score = max(float(info["score"]), 0.0) / 100.0
            result.update(score=score, success=score >= 1.0)
        return StepResult(observation, reward=float(reward), done=bool(done), info=result)

    def close(self) -> None:
        if self._simulator is not None:
            self._simulator.close()
            self._simulator = None
