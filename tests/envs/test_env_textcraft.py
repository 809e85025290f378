"""TextCraft in-process against AgentTraj-L's real TextCraft rows."""
from __future__ import annotations

import pytest

from tests.support.local_agentgym import agenttraj_rows, episode
from trajforge.pipeline.envs.tasks import TaskFormatError
from trajforge.pipeline.synth.envs import make_env

ROWS = {row["item_id"]: row for row in agenttraj_rows("textcraft")}


def task(item: str, description: str) -> dict:
    return {"id": item, "env": "textcraft", "description": description, "data": {"item_id": item}}


@pytest.mark.parametrize("item", sorted(ROWS))
def test_replaying_an_agenttraj_row_gives_upstreams_observations(item):
    first, steps = episode(ROWS[item])
    with make_env("textcraft") as env:
        assert env.reset(task(item, first)) == first
        for reply, upstream in steps:
            # AgentGym's client sends the reply's action (or the whole reply when it has none), cleaned.
            result = env.step(reply)
            if upstream is not None:
                # The server ends the inventory list with a space the collector stripped.
                assert result.observation.rstrip() == upstream
        # Every row's last reply crafts the goal.
        assert result.done and result.info["score"] == 1.0


def test_refusals_and_crafting_rules():
    first, _ = episode(ROWS["textcraft_320"])  # yellow terracotta: 8 terracotta + 1 yellow dye (from a dandelion)
    with make_env("textcraft") as env:
        env.reset(task("textcraft_320", first))
        assert env.step("get 1 yellow dye").observation == "Could not find yellow dye"  # crafted, not got
        assert env.step("get 1 diamond").observation == "Could not find diamond"        # no command names it
        assert env.step("get dandelion").observation == "Could not execute get dandelion"
        assert env.step("craft 1 yellow dye using 1 dandelion").observation == \
            "Could not find enough items to craft minecraft:yellow_dye"
        assert env.step("get 2 dandelion").observation == "Got 2 dandelion"
        assert env.step("craft 1 yellow dye using 2 dandelion").observation.startswith(
            "Could not find a valid recipe for ItemTagWithCount(item_tag=ItemTag(tag=None, item_id='minecraft:yellow_dye')")
        made = env.step("craft 1 yellow dye using 1 dandelion")
        assert (made.observation, made.done) == ("Crafted 1 minecraft:yellow_dye", False)
        assert env.step("inventory").observation == "Inventory: [dandelion] (1) [yellow dye] (1) "
        env.step("get 8 terracotta")
        assert env.step("craft 8 yellow terracotta using 8 terracotta, 1 yellow dye").info["score"] == 1.0


def test_generic_ingredients_take_any_kind():
    description = "Crafting commands:\ncraft 1 loom using 2 planks, 2 string\n\nGoal: craft loom."
    with make_env("textcraft") as env:
        env.reset(task("t", description))
        env.step("get 2 dark oak planks")
        env.step("get 2 string")
        assert env.step("craft 1 loom using 2 dark oak planks, 2 string").done


def test_a_task_without_commands_is_refused_with_the_reason():
    with make_env("textcraft") as env, pytest.raises(TaskFormatError, match="item index alone"):
        env.reset(task("textcraft_7", ""))
