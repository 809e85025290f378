"""BabyAI in-process, on minigrid, with the text interface of AgentGym's BabyAI server.

AgentGym (agentenv-babyai) turns a minigrid BabyAI level into text: the first observation is
`Your goal: <mission>` and a description of what the agent sees, and the agent acts with
high-level commands (`turn left`, `move forward`, `go to grey key 1`, `pickup red ball 1`,
`toggle and go through grey locked door 1`, `check available actions`, ...) that the server
expands into minigrid's low-level actions along a shortest path. This module speaks the same
language on the same engine, so that AgentTraj-L's BabyAI tasks run here without the server:

- An item index `n` is the level `LEVELS[n % 40]` reset with seed `n // 40`, as the server
  maps `data_idx` (AgentTraj-L `babyai_<n>`).
- The observation sentences, the object numbering, the action space and the refusals are the
  server's, word for word (`bench/env_fidelity.py` measures it against AgentTraj-L).
- AgentGym's server answers the action names it lists (`pickup <obj> <id>`), not the
  `pick up` its prompt shows; so does this module.
- An episode ends when the level says the mission is done (AgentGym ends it then only when
  minigrid's step-discounted reward is above 0.5; so does this module). The score is 1.0 then;
  the discounted reward is the step's `reward`.
"""
from __future__ import annotations

import copy
from collections import deque
from typing import Any

from trajforge.pipeline.envs.agentgym import extract_action, item_index
from trajforge.pipeline.envs.tasks import Task, coerce_task
from trajforge.pipeline.synth.envs.base import ClosingEnvironment, StepResult

# AgentGym's level list, in its order: item n plays LEVELS[n % 40] with seed n // 40.
LEVELS = (
    "BabyAI-GoToRedBallGrey-v0", "BabyAI-GoToRedBall-v0", "BabyAI-GoToRedBallNoDists-v0", "BabyAI-GoToObjS6-v0",
    "BabyAI-GoToLocalS8N7-v0", "BabyAI-GoToObjMazeS7-v0", "BabyAI-GoToImpUnlock-v0", "BabyAI-GoToSeqS5R2-v0",
    "BabyAI-GoToRedBlueBall-v0", "BabyAI-GoToDoor-v0", "BabyAI-GoToObjDoor-v0", "BabyAI-Open-v0",
    "BabyAI-OpenRedDoor-v0", "BabyAI-OpenDoorLoc-v0", "BabyAI-OpenRedBlueDoorsDebug-v0",
    "BabyAI-OpenDoorsOrderN4Debug-v0", "BabyAI-Pickup-v0", "BabyAI-UnblockPickup-v0", "BabyAI-PickupLoc-v0",
    "BabyAI-PickupDistDebug-v0", "BabyAI-PickupAbove-v0", "BabyAI-PutNextLocalS6N4-v0",
    "BabyAI-PutNextS7N4Carrying-v0", "BabyAI-Unlock-v0", "BabyAI-UnlockLocalDist-v0", "BabyAI-KeyInBox-v0",
    "BabyAI-UnlockPickupDist-v0", "BabyAI-BlockedUnlockPickup-v0", "BabyAI-UnlockToUnlock-v0",
    "BabyAI-ActionObjDoor-v0", "BabyAI-FindObjS7-v0", "BabyAI-KeyCorridorS6R3-v0", "BabyAI-OneRoomS20-v0",
    "BabyAI-MoveTwoAcrossS8N9-v0", "BabyAI-SynthS5R2-v0", "BabyAI-SynthLoc-v0", "BabyAI-SynthSeq-v0",
    "BabyAI-MiniBossLevel-v0", "BabyAI-BossLevel-v0", "BabyAI-BossLevelNoUnlock-v0",
)

# minigrid's low-level actions.
LEFT, RIGHT, FORWARD, PICKUP, DROP, TOGGLE = 0, 1, 2, 3, 4, 5
# Cells a path cannot cross, and cells an object cannot be dropped on (by name part).
BLOCKING = ("wall", "box", "lava", "ball", "key")
NOT_UNDERSTOOD = "The action is not recognized. Please check valid actions."
NO_CHANGE = "No change in state."
COMPLETED = "\n The task is completed."



def level_and_seed(item: int) -> tuple[str, int]:
    """The level and seed of AgentGym's BabyAI item `item`."""
    return LEVELS[item % len(LEVELS)], item // len(LEVELS)


def _vec(direction: int) -> tuple[int, int]:
    return ((1, 0), (0, 1), (-1, 0), (0, -1))[direction % 4]


class _View:
    """What the agent sees after a step: the sentence, and the commands it can give (each a list of
    low-level actions) with the refusals of the commands it cannot."""

    def __init__(self, env: Any, obs: dict) -> None:
        from minigrid.core.constants import IDX_TO_COLOR, IDX_TO_OBJECT, STATE_TO_IDX

        level = env.unwrapped
        size = level.agent_view_size
        self.pos = (int(level.agent_pos[0]), int(level.agent_pos[1]))
        self.dir = int(obs["direction"])
        front, right = _vec(self.dir), _vec(self.dir + 1)
        # The view square in grid coordinates; its bounds as the server computes them.
        corner = (self.pos[0] + front[0] * (size - 1) - right[0] * (size // 2),
                  self.pos[1] + front[1] * (size - 1) - right[1] * (size // 2))
        far = (corner[0] + size * (right[0] - front[0]), corner[1] + size * (right[1] - front[1]))
        self.xs = range(far[0], corner[0] + 1) if far[0] < corner[0] else range(corner[0], far[0])
        self.ys = range(far[1], corner[1] + 1) if far[1] < corner[1] else range(corner[1], far[1])
        self.objects: list[dict] = []   # every object in view, nearest first (walls included)
        self.barriers: list[dict] = []  # walls and boxes straight ahead, nearest first
        image = obs["image"]
        state_name = {v: k for k, v in STATE_TO_IDX.items()}
        for row in range(size):          # farthest row first, then left to right: the server's order
            for col in range(size):
                x = corner[0] - front[0] * row + right[0] * col
                y = corner[1] - front[1] * row + right[1] * col
                distance = abs(self.pos[0] - x) + abs(self.pos[1] - y)
                if x < 0 or y < 0 or distance == 0:
                    continue
                kind = IDX_TO_OBJECT[int(image[col, row, 0])]
                color = IDX_TO_COLOR[int(image[col, row, 1])]
                if kind in ("door", "key", "ball", "box", "goal", "lava", "wall"):
                    name = f"{color} {state_name[int(image[col, row, 2])]} door" if kind == "door" else f"{color} {kind}"
                    self.objects.append({"name": name, "pos": (x, y), "distance": distance})
                rel = (x - self.pos[0], y - self.pos[1])
                if kind in ("box", "wall") and front[0] * rel[1] - front[1] * rel[0] == 0:
                    self.barriers.append({"name": kind, "pos": (x, y),
                                          "distance": front[0] * rel[0] + front[1] * rel[1]})
        self.objects.sort(key=lambda o: o["distance"])
        self.barriers.sort(key=lambda o: o["distance"])
        self.carrying = level.carrying
        self.text = self._describe()
        self.actions: dict[str, list[int]] = {}
        self.refusals: dict[str, str] = {}
        self._list_actions()

    def _offsets(self, pos: tuple[int, int]) -> tuple[int, int]:
        rel = (pos[0] - self.pos[0], pos[1] - self.pos[1])
        front, right = _vec(self.dir), _vec(self.dir + 1)
        return front[0] * rel[0] + front[1] * rel[1], right[0] * rel[0] + right[1] * rel[1]

    def _describe(self) -> str:
        visible = [o for o in self.objects if "wall" not in o["name"]]
        if self.objects:
            parts, seen = [], {}
            for o in visible:
                seen[o["name"]] = seen.get(o["name"], 0) + 1
                ahead, side = self._offsets(o["pos"])
                if side == 0:
                    where = f"right in front of you {ahead} steps away. "
                else:
                    where = f"{ahead} steps in front of you and {abs(side)} steps to your {'right' if side > 0 else 'left'}. "
                parts.append(f"There is a {o['name']} {seen[o['name']]} {where} ")
            text = "In front of you in this room, you can see several objects: " + "".join(parts)
        else:
            text = "You cannot see any objects within sight."
        text += "The room has walls around you. "
        if self.barriers:
            text += f"You are facing a {self.barriers[0]['name']} {self.barriers[0]['distance']} steps away. "
        if self.carrying is not None:
            return text + f"You are carrying a {self.carrying.color} {self.carrying.type}."
        return text + "You are not carrying anything."

    def path(self, goal: tuple[int, int], arrive: bool) -> list[int] | None:
        """Low-level actions that bring the agent onto `goal` (arrive) or facing it next to it:
        breadth-first over (cell, direction), forward before left before right, around the objects
        in view; None when no such path stays inside the view. Like the server, a state reached
        again before it is expanded takes its latest parent."""
        blocked = {o["pos"] for o in self.objects + self.barriers if any(b in o["name"] for b in BLOCKING)}
        start = (self.pos, self.dir)
        parent: dict[tuple, tuple[tuple, int]] = {}
        expanded: set[tuple] = set()
        queue = deque([start])
        while queue:
            state = queue.popleft()
            expanded.add(state)
            if _reaches(state, goal, arrive):
                return _actions_to(state, start, parent)
            for action, nxt in _moves(state):
                cell = nxt[0]
                if cell[0] not in self.xs or cell[1] not in self.ys or nxt in expanded or cell in blocked:
                    continue
                queue.append(nxt)
                parent[nxt] = (state, action)
        return None

    def _numbered(self, verb: str, refusal: str, candidates: list[dict], arrive: bool, suffix: list[int]) -> None:
        """`<verb> <name> <k>` for each reachable candidate, k counting the reachable ones of that
        name; an unreachable one is refused under the number the next reachable one would get."""
        count: dict[str, int] = {}
        for o in candidates:
            name = o["name"]
            steps = self.path(o["pos"], arrive)
            if steps is not None:
                count[name] = count.get(name, 0) + 1
                self.actions[f"{verb} {name} {count[name]}"] = steps + suffix
            else:
                k = count.get(name, 0) + 1
                self.refusals[f"{verb} {name} {k}"] = f"You cannot {refusal} {name} {k}, as there is no path leading to it."

    def _list_actions(self) -> None:
        """The server's action list, in its order: turns, move, pickup or drop, doors, goal, go to, check."""
        self.actions.update({"turn left": [LEFT], "turn right": [RIGHT]})
        if not self.barriers or self.barriers[0]["distance"] > 1:
            self.actions["move forward"] = [FORWARD]
        else:
            self.refusals["move forward"] = "There is a barrier in front of you, you can't move forward."
        self._pickup_or_drop()
        doors: dict[str, int] = {}
        for o in self.objects:
            if "door" in o["name"]:
                doors[o["name"]] = doors.get(o["name"], 0) + 1
                self._door_actions(o, doors)
        for o in self.objects:
            if "goal" in o["name"]:
                self._go_to_goal(o)
        self._numbered("go to", "go to", [o for o in self.objects if "wall" not in o["name"] and "goal" not in o["name"]],
                       arrive=False, suffix=[])
        self.actions["check available actions"] = []

    def _pickup_or_drop(self) -> None:
        """Empty-handed, pick up any object in reach; carrying, drop it unless something is in front."""
        if self.carrying is None:
            self._numbered("pickup", "pickup", [o for o in self.objects if not any(
                k in o["name"] for k in ("wall", "door", "goal"))], arrive=False, suffix=[PICKUP])
            self.refusals["drop"] = "You cannot drop the object, as you are not carrying anything."
            return
        front = _vec(self.dir)
        ahead = (self.pos[0] + front[0], self.pos[1] + front[1])
        if any(o["pos"] == ahead and any(b in o["name"] for b in BLOCKING) for o in self.objects):
            self.refusals["drop"] = "You cannot drop the object, as there is already an object in front of you."
        else:
            self.actions["drop"] = [DROP]

    def _door_actions(self, door: dict, doors: dict[str, int]) -> None:
        """The commands for one door; `doors` counts the doors of each name seen so far, this one included."""
        name = door["name"]
        label = f"{name} {doors[name]}"
        if "open door" in name:
            steps = self.path(door["pos"], arrive=True)
            if steps is not None:
                self.actions[f"go through {label}"] = steps
            else:
                self.refusals[f"go through {label}"] = f"You cannot go through {label}, as there is no path leading to it."
            return
        why = self._locked_door_refusal(name) if "locked door" in name else None
        if why:
            self.refusals[f"toggle and go through {label}"] = f"You cannot toggle and go through {label}, as {why}."
            return
        steps = self.path(door["pos"], arrive=False)
        if steps is not None:
            self.actions[f"toggle and go through {label}"] = steps + [TOGGLE, FORWARD]
        else:
            # The server prints its whole door count here (a dict), not the door's number.
            self.refusals[f"toggle and go through {label}"] = (
                f"You cannot toggle and go through {name} {doors}, as there is no path leading to it.")
        if steps == []:
            self.actions["toggle"] = [TOGGLE]
        if "closed door" in name:
            self.refusals[f"go through {label}"] = (f"You cannot go through {label}, as it is closed. "
                                                    "You should toggle it first.")

    def _locked_door_refusal(self, name: str) -> str | None:
        """Why the locked door `name` cannot be opened with what the agent carries; None when it can."""
        carrying = self.carrying
        if carrying is None or carrying.type != "key":
            return "you are not carrying a key"
        if carrying.color != name.split(" ")[0]:
            return "the color of the key you are carrying does not match the color of door"
        return None

    def _go_to_goal(self, goal: dict) -> None:
        steps = self.path(goal["pos"], arrive=True)
        if steps is not None:
            self.actions["go to goal"] = steps
        else:
            self.refusals["go to goal"] = "You cannot go to the goal, as there is no path leading to it."


def _reaches(state: tuple, goal: tuple[int, int], arrive: bool) -> bool:
    """The (cell, direction) `state` is on `goal` (arrive) or faces it from the next cell."""
    (x, y), d = state
    return (x, y) == goal if arrive else (goal[0] - x, goal[1] - y) == _vec(d)


def _moves(state: tuple) -> list[tuple[int, tuple]]:
    """(action, next state) for forward, left and right, in the server's order."""
    (x, y), d = state
    front = _vec(d)
    return [(FORWARD, ((x + front[0], y + front[1]), d)), (LEFT, ((x, y), (d - 1) % 4)), (RIGHT, ((x, y), (d + 1) % 4))]


def _actions_to(state: tuple, start: tuple, parent: dict[tuple, tuple[tuple, int]]) -> list[int]:
    """The low-level actions from `start` to `state`, following the parents back."""
    actions = []
    while state != start:
        state, action = parent[state]
        actions.append(action)
    return actions[::-1]


class BabyAIEnv(ClosingEnvironment):
    name = "babyai"

    def __init__(self) -> None:
        self._env: Any = None
        self._view: _View | None = None
        self._image: Any = None
        self._done = False

    def reset(self, task: Task | dict) -> str:
        import gymnasium
        import minigrid  # noqa: F401  (registers the BabyAI levels with gymnasium)

        self.close()
        t = coerce_task(task)
        if t.env != self.name:
            raise ValueError(f"task {t.id} is for env {t.env!r}, not {self.name!r}")
        level, seed = level_and_seed(item_index(t.data.get("item_id", t.data.get("data_idx", 0))))
        self._env = gymnasium.make(level)
        obs, _ = self._env.reset(seed=seed)
        self._image = obs["image"]
        self._view = _View(self._env, obs)
        self._done = False
        goal = self._env.unwrapped.mission.replace("then", "and").replace("after you", "and")
        return f"Your goal: {goal}\n{self._view.text}"

    def step(self, action: str) -> StepResult:
        if self._view is None or self._done:
            raise RuntimeError("step() before reset() or after the episode ended")
        command = extract_action(action).lower().strip()
        view = self._view
        if "check" in command:
            return StepResult("You can take the following actions: " + ", ".join(view.actions),
                              info={"valid": True, "action": command})
        if command not in view.actions:
            refusal = NO_CHANGE if not command else view.refusals.get(command, NOT_UNDERSTOOD)
            return StepResult(refusal, info={"valid": False, "action": command})
        if not view.actions[command]:
            return StepResult(NO_CHANGE, info={"valid": True, "action": command})
        reward, done, obs = 0.0, False, None
        for low in view.actions[command]:
            obs, reward, done, _, _ = self._env.step(low)
            if (obs["image"] == self._image).all():
                break  # the low-level action did nothing (a door in the way, ...): stop, as the server does
            self._image = obs["image"]
        self._view = _View(self._env, obs)
        text = self._view.text
        # The server says so when the level is done, but ends the episode only when the level's
        # step-discounted reward is above 0.5.
        if done:
            text += COMPLETED
        self._done = bool(done) and reward > 0.5
        info: dict[str, Any] = {"valid": True, "action": command}
        if self._done:
            info.update(score=1.0, success=True)
        return StepResult(text, reward=float(reward), done=self._done, info=info)

    def snapshot(self) -> dict[str, Any]:
        """The episode's state (the level (minigrid engine, random generator included) and the view), for `restore`: tree search branches from it."""
        return copy.deepcopy(vars(self))

    def restore(self, state: dict[str, Any]) -> None:
        """Go back to a `snapshot`; the snapshot stays usable (restoring copies it)."""
        vars(self).update(copy.deepcopy(state))

    def close(self) -> None:
        if self._env is not None:
            self._env.close()
            self._env = None
        self._view = None
