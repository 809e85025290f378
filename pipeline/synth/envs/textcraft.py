"""TextCraft in-process: AgentGym's Minecraft crafting game over the task's own crafting commands.

AgentGym's TextCraft server (agentenv-textcraft) builds each task from the recipe files of
Minecraft's data pack: a goal item, and "crafting commands" (the goal's recipe tree plus
distractor recipes). A task that fixes both, `Crafting commands:\\n...\\n\\nGoal: craft X.` (as every
AgentTraj-L TextCraft row does, and as the server's `create(commands, goal)` accepts), is played
here on those commands alone; no package on the index ships the data pack's recipe files, so an
item index by itself (`textcraft_<n>`, chosen by the server over the whole recipe tree) cannot be
rebuilt and is refused.

The game's rules and replies are the server's:
  `get N item`         -> `Got N item`; `Could not find item` for an item that is crafted, or
                          that is neither an ingredient of a command nor a kind of one
  `craft N item using M a, K b`
                       -> `Crafted <count> minecraft:<item>` when the inventory holds the inputs
                          and a command takes exactly those inputs and counts (the count crafted
                          is the command's, whatever N says); otherwise `Could not find enough
                          items to craft minecraft:<item>`, `Could not find a valid recipe for
                          ...`, or `Wrong item format: ...`
  `inventory`          -> `Inventory: [item] (n) ...` or `Inventory: You are not carrying anything.`
  anything else        -> `Could not execute <action>`
The action is cleaned as AgentGym's client cleans it (the text after `Action:`, only letters,
digits, commas and spaces). Getting or crafting the goal ends the episode with score 1.0.

Generic ingredients: a command may ask for a generic ingredient ("2 planks"), and the prompt
allows any kind of it ("dark oak planks"). The server knows the kinds from the data pack's tags;
here an item is of a kind when its name ends with the kind's name. Without the tags the server
also refuses to `get` a generic name that it has as a tag; here a named ingredient can be got.
"""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any

from trajforge.pipeline.envs.agentgym import extract_action
from trajforge.pipeline.envs.tasks import Task, TaskFormatError, coerce_task
from trajforge.pipeline.synth.envs.base import ClosingEnvironment, StepResult

_TASK = re.compile(r"Crafting commands:\n(?P<commands>.*?)\n\nGoal: craft (?P<goal>[^\n]*?)\.?\s*$", re.S)
_COMMAND = re.compile(r"craft (\d+) (.+?) using (.+)")
_COUNTED = re.compile(r"([0-9]+) (.*)")
_NOT_ALLOWED = re.compile(r"[^A-Za-z0-9, ]+")


def item_id(name: str) -> str:
    return "minecraft:" + name.replace(" ", "_")


def item_name(identifier: str) -> str:
    return identifier.replace("minecraft:", "").replace("_", " ")


def of_kind(identifier: str, ingredient: str) -> bool:
    """`identifier` is the ingredient or a kind of it (`minecraft:dark_oak_planks` of `minecraft:planks`)."""
    return identifier == ingredient or identifier.endswith("_" + ingredient.removeprefix("minecraft:"))


@dataclass(frozen=True)
class Recipe:
    output: str                          # item id
    count: int
    inputs: tuple[tuple[str, int], ...]  # (item id, count), in the command's order


def parse_commands(commands: str) -> list[Recipe]:
    recipes = []
    for line in commands.splitlines():
        found = _COMMAND.fullmatch(line.strip())
        if not found:
            raise TaskFormatError(f"not a crafting command: {line!r}")
        inputs = []
        for part in found.group(3).split(","):
            counted = _COUNTED.fullmatch(part.strip())
            if not counted:
                raise TaskFormatError(f"not a counted ingredient in {line!r}: {part!r}")
            inputs.append((item_id(counted.group(2)), int(counted.group(1))))
        recipes.append(Recipe(item_id(found.group(2)), int(found.group(1)), tuple(inputs)))
    return recipes


def task_parts(task: Task) -> tuple[str, str]:
    """(crafting commands, goal item name) of a task: its `commands` and `goal`, or as its text
    states them."""
    commands, goal = task.data.get("commands"), task.data.get("goal")
    if not (commands and goal):
        found = _TASK.search(task.description)
        if not found:
            raise TaskFormatError(f"task {task.id}: no crafting commands and goal (`Crafting commands:\\n...\\n\\n"
                                  "Goal: craft X.`); an item index alone cannot be rebuilt without the recipe files")
        commands, goal = found.group("commands"), found.group("goal")
    return commands.strip(), item_name(goal)


class ActionFailed(Exception):
    """The game's refusal; its message is the observation."""


class TextCraftEnv(ClosingEnvironment):
    name = "textcraft"

    def __init__(self) -> None:
        self._recipes: dict[str, list[Recipe]] = {}
        self._ingredients: set[str] = set()
        self._goal = ""
        self._inventory: dict[str, int] = {}
        self._started = False
        self._done = False

    def reset(self, task: Task | dict) -> str:
        t = coerce_task(task)
        if t.env != self.name:
            raise ValueError(f"task {t.id} is for env {t.env!r}, not {self.name!r}")
        commands, goal = task_parts(t)
        self._recipes = {}
        for recipe in parse_commands(commands):
            self._recipes.setdefault(recipe.output, []).append(recipe)
        self._ingredients = {i for rs in self._recipes.values() for r in rs for i, _ in r.inputs}
        self._goal = item_id(goal)
        self._inventory = {}
        self._started, self._done = True, False
        return f"Crafting commands:\n{commands}\n\nGoal: craft {goal}."

    def step(self, action: str) -> StepResult:
        if not self._started or self._done:
            raise RuntimeError("step() before reset() or after the episode ended")
        command = " ".join(_NOT_ALLOWED.sub("", extract_action(action)).split())
        try:
            observation, made = self._act(command)
        except ActionFailed as failure:
            return StepResult(str(failure), info={"valid": False, "action": command})
        info: dict[str, Any] = {"valid": True, "action": command}
        if made == self._goal:
            self._done = True
            info.update(score=1.0, success=True)
        return StepResult(observation, reward=float(self._done), done=self._done, info=info)

    def _act(self, command: str) -> tuple[str, str | None]:
        """(observation, the item got or crafted) of one command, or ActionFailed."""
        if found := re.match(r"craft (.*) using (.*)", command):
            return self._craft(found.group(1), found.group(2))
        if found := re.match(r"get ([0-9]+) (.*)", command):
            count, name = int(found.group(1)), found.group(2)
            identifier = item_id(name)
            if identifier in self._recipes or not any(of_kind(identifier, i) for i in self._ingredients):
                raise ActionFailed(f"Could not find {name}")
            self._inventory[identifier] = self._inventory.get(identifier, 0) + count
            return f"Got {count} {name}", identifier
        if re.match(r"inventory", command):
            if not self._inventory:
                return "Inventory: You are not carrying anything.", None
            return "Inventory: " + "".join(f"[{item_name(i)}] ({n}) " for i, n in self._inventory.items()), None
        raise ActionFailed(f"Could not execute {command}")

    def _craft(self, target: str, ingredients: str) -> tuple[str, str]:
        counted = _COUNTED.match(target)
        output = item_id(counted.group(2) if counted else target)
        wanted = []
        for part in ingredients.split(","):
            found = _COUNTED.match(part.strip())
            if not found:
                raise ActionFailed(f"Wrong item format: {part.strip()}")
            wanted.append((item_id(found.group(2)), int(found.group(1))))
        if any(self._inventory.get(i, 0) < n for i, n in wanted):
            raise ActionFailed(f"Could not find enough items to craft {output}")
        recipe = next((r for r in self._recipes.get(output, []) if self._matches(r, wanted)), None)
        if recipe is None:
            # The server names the output by the repr of its own item record.
            raise ActionFailed("Could not find a valid recipe for ItemTagWithCount(item_tag=ItemTag(tag=None, "
                               f"item_id='{output}'), count={int(counted.group(1)) if counted else 1})")
        for i, n in wanted:
            self._inventory[i] -= n
            if not self._inventory[i]:
                del self._inventory[i]
        self._inventory[output] = self._inventory.get(output, 0) + recipe.count
        return f"Crafted {recipe.count} {output}", output

    @staticmethod
    def _matches(recipe: Recipe, wanted: list[tuple[str, int]]) -> bool:
        """The command's inputs are the recipe's, each with the recipe's count; an input of a
        generic ingredient may be any kind of it (`dark oak planks` for `planks`)."""
        left = list(wanted)
        for ingredient, count in recipe.inputs:
            match = next((w for w in left if of_kind(w[0], ingredient)), None)
            if match is None or match[1] != count:
                return False
            left.remove(match)
        return not left

    def snapshot(self) -> dict[str, Any]:
        """The episode's state (the recipes, the goal and the inventory), for `restore`: tree search branches from it."""
        return copy.deepcopy(vars(self))

    def restore(self, state: dict[str, Any]) -> None:
        """Go back to a `snapshot`; the snapshot stays usable (restoring copies it)."""
        vars(self).update(copy.deepcopy(state))

    def close(self) -> None:
        self._started = False
