"""BabyAI in-process (minigrid + AgentGym's text interface) against AgentTraj-L's real BabyAI rows."""
from __future__ import annotations

import pytest

pytest.importorskip("minigrid", reason="the `envs` extra (minigrid) is not installed")

from tests.support.local_agentgym import agenttraj_rows, episode  # noqa: E402
from trajforge.pipeline.ingest.dialects import parse_turn  # noqa: E402
from trajforge.pipeline.synth.envs import make_env  # noqa: E402
from trajforge.pipeline.synth.envs.babyai import level_and_seed  # noqa: E402


def task(item: str) -> dict:
    return {"id": item, "env": "babyai", "description": "", "data": {"item_id": item}}


def test_items_map_to_agentgyms_level_and_seed():
    assert level_and_seed(320) == ("BabyAI-GoToRedBallGrey-v0", 8)
    assert level_and_seed(3726) == ("BabyAI-GoToImpUnlock-v0", 93)


@pytest.mark.parametrize("row", agenttraj_rows("babyai"), ids=lambda r: r["item_id"])
def test_replaying_an_agenttraj_row_gives_upstreams_observations_word_for_word(row):
    first, steps = episode(row)
    with make_env("babyai") as env:
        assert env.reset(task(row["item_id"])) == first
        for reply, upstream in steps:
            result = env.step(parse_turn(reply).action)
            if upstream is not None:
                assert result.observation == upstream


def test_refusals_listing_and_a_solved_level():
    with make_env("babyai") as env:
        env.reset(task("babyai_1003"))  # go to the blue ball, out of sight at first
        refused = env.step("pick up blue ball 1")  # the prompt's wording; the server lists `pickup`
        assert (refused.observation, refused.info["valid"]) == ("The action is not recognized. Please check valid "
                                                                "actions.", False)
        assert env.step("drop").observation == "You cannot drop the object, as you are not carrying anything."
        assert env.step("turn right").info["valid"]
        listing = env.step("check available actions").observation
        assert listing.startswith("You can take the following actions: turn left, turn right, move forward, ")
        assert "go to blue ball 1" in listing and "pickup blue ball 1" in listing
        done = env.step("Thought:\nThe ball is close.\n\nAction:\ngo to blue ball 1")
        assert done.done and done.info == {"valid": True, "action": "go to blue ball 1", "score": 1.0, "success": True}
        assert done.observation.endswith("\n The task is completed.") and 0.5 < done.reward < 1.0
        with pytest.raises(RuntimeError):
            env.step("turn left")
