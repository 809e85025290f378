"""ScienceWorld in-process (the `scienceworld` package, a JVM) as AgentGym's server serves it."""
from __future__ import annotations

import shutil

import pytest

pytest.importorskip("scienceworld", reason="the `envs` extra (scienceworld) is not installed")
if shutil.which("java") is None:
    pytest.skip("ScienceWorld runs in a JVM and no `java` is on the PATH (.ci/run installs "
                "openjdk-17-jre-headless)", allow_module_level=True)

from trajforge.pipeline.synth.envs import make_env  # noqa: E402


def test_an_item_resets_to_its_task_and_the_simulator_answers_and_refuses():
    with make_env("sciworld") as env:
        first = env.reset({"id": "s", "env": "sciworld", "description": "", "data": {"item_id": "sciworld_350"}})
        assert first.startswith("Your task is to measure the temperature of sodium chloride")
        assert "\nThis room is called the " in first
        moved = env.step("Thought:\nI look.\n\nAction:\nlook around")
        assert moved.info["valid"] and moved.observation.startswith("This room is called the ")
        refused = env.step("fly to the moon")
        assert refused.observation == "No known action matches that input." and not refused.info["valid"]
        assert not refused.done
