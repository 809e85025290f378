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

from trajforge.pipeline.synth.envs.agentgym import extract_action, item_index
from trajforge.pipeline.synth.envs.base import ClosingEnvironment, EnvFailure, StepResult
from trajforge.pipeline.synth.tasks import Task, coerce_task

# The simulator's answer to an action it cannot parse.
UNKNOWN_ACTION = "No known action matches that input."
EXCLUDED_TASKS = {"5-1", "5-2", "9-1", "9-2", "9-3", "10-1", "10-2"}

INSTRUCTIONS = (
    "You are an agent for science world. Every round I will give you an observation, you have to respond an action "
    "based on the observation to finish the given task. Here are the actions you may take: [{\"action\": "
    "\"open/close OBJ\", \"description\": \"open/close a container\"}, {\"action\": \"de/activate OBJ\", "
    "\"description\": \"activate/deactivate a device\"}, {\"action\": \"connect OBJ to OBJ\", \"description\": "
    "\"connect electrical components\"}, {\"action\": \"disconnect OBJ\", \"description\": \"disconnect electrical "
    "components\"}, {\"action\": \"use OBJ [on OBJ]\", \"description\": \"use a device/item\"}, {\"action\": "
    "\"look around\", \"description\": \"describe the current room\"}, {\"action\": \"look at OBJ\", "
    "\"description\": \"describe an object in detail\"}, {\"action\": \"look in OBJ\", \"description\": "
    "\"describe a container's contents\"}, {\"action\": \"read OBJ\", \"description\": \"read a note or book\"}, "
    "{\"action\": \"move OBJ to OBJ\", \"description\": \"move an object to a container\"}, {\"action\": "
    "\"pick up OBJ\", \"description\": \"move an object to the inventory\"}, {\"action\": \"put down OBJ\", "
    "\"description\": \"drop an inventory item\"}, {\"action\": \"pour OBJ into OBJ\", \"description\": "
    "\"pour a liquid into a container\"}, {\"action\": \"dunk OBJ into OBJ\", \"description\": \"dunk a container "
    "into a liquid\"}, {\"action\": \"mix OBJ\", \"description\": \"chemically mix a container\"}, {\"action\": "
    "\"go to LOC\", \"description\": \"move to a new location\"}, {\"action\": \"eat OBJ\", \"description\": "
    "\"eat a food\"}, {\"action\": \"flush OBJ\", \"description\": \"flush a toilet\"}, {\"action\": "
    "\"focus on OBJ\", \"description\": \"signal intent on a task object\"}, {\"action\": \"wait\", "
    "\"description\": \"take no action for 10 iterations\"}, {\"action\": \"wait1\", \"description\": \"take no "
    "action for 1 iteration\"}, {\"action\": \"task\", \"description\": \"describe current task\"}, {\"action\": "
    "\"inventory\", \"description\": \"list your inventory\"}]\nYour response should use the following format:\n"
    "Thought:\nyour thoughts.\n\nAction:\nyour next action")


def games(simulator: Any) -> list[tuple[str, int]]:
    """AgentGym's task list: (task name, variation) for every task it serves, in its order."""
    return [(name, variation) for key, name in simulator.tasks.items() if key not in EXCLUDED_TASKS
            for variation in range(simulator.get_max_variations(name))]


class SciWorldEnv(ClosingEnvironment):
    name = "sciworld"
    instructions = INSTRUCTIONS

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
