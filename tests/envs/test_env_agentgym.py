"""The `agentgym` HTTP client against real loopback servers that speak AgentGym's protocol with a
tiny deterministic game (guess the number), in the common shape and in WebShop's shape."""
from __future__ import annotations

import time

import pytest

from trajforge.pipeline.envs.agentgym import extract_action, item_index
from trajforge.pipeline.synth.envs import make_env
from trajforge.pipeline.synth.envs.agentgym import AgentGymError


def play(env, task) -> tuple[list[str], float]:
    """Binary search with the server's hints, as an agent would."""
    observations = [env.reset(task)]
    low, high = 0, 9
    while True:
        guess = (low + high) // 2
        result = env.step(f"Thought:\nnarrowing down\n\nAction:\nguess {guess}")
        observations.append(result.observation)
        if result.done:
            return observations, result.info["score"]
        if result.observation == "higher":
            low = guess + 1
        else:
            high = guess - 1


@pytest.mark.parametrize("index", [0, 4, 7])
def test_plays_to_success_and_closes_the_instance(serve, index):
    server, url = serve()
    task = {"env": "agentgym", "description": "guess", "data": {"env_name": "guess", "item_id": f"guess_{index}"}}
    with make_env("agentgym", base_url=url, timeout=5) as env:
        observations, score = play(env, task)
        assert server.envs, "the instance lives during the episode"
    assert score == 1.0 and observations[-1] == "correct"
    assert observations[0].startswith("Guess my number") and "AVAILABLE ACTIONS: guess 0,guess 9" in observations[0]
    assert server.envs == {}  # closed on exit


def test_webshop_shaped_server(serve):
    server, url = serve(webshop=True)
    with make_env("agentgym", base_url=url, env_name="webshop", timeout=5) as env:
        observations, score = play(env, {"env": "agentgym", "description": "", "data": {"item_id": 2}})
    assert observations[0] == "Guess my number (0-9). Act: guess N" and score == 1.0
    assert server.envs == {}


def test_invalid_actions_and_reset_closes_the_previous_instance(serve):
    server, url = serve()
    env = make_env("agentgym", base_url=url, timeout=5)
    env.reset({"env": "agentgym", "description": "", "data": {"item_id": 1}})
    result = env.step("Action: dance")
    assert result.observation == "Invalid action." and not result.done and result.info["valid"]
    assert env.step("Thought: nothing to do").info["valid"] is True  # sent as-is, the server judges it
    assert env.step("Action:   ").info["valid"] is False
    first = set(server.envs)
    env.reset({"env": "agentgym", "description": "", "data": {"item_id": 2}})
    assert set(server.envs).isdisjoint(first) and len(server.envs) == 1
    env.close()
    env.close()  # idempotent
    assert server.envs == {}


def test_timeout_raises_and_close_still_happens(serve):
    server, url = serve()
    server.delay = 3.0
    env = make_env("agentgym", base_url=url, timeout=0.5)
    env.reset({"env": "agentgym", "description": "", "data": {"item_id": 1}})
    started = time.monotonic()
    with pytest.raises(AgentGymError, match="no answer within"):
        env.step("Action: guess 1")
    assert time.monotonic() - started < 2.5
    env.close()
    assert server.envs == {}


def test_busy_server_is_retried_then_errors_are_clear(serve):
    server, url = serve()
    server.busy_left = 2
    with make_env("agentgym", base_url=url, timeout=5) as env:
        assert env.reset({"env": "agentgym", "description": "", "data": {"item_id": 3}}).startswith("Guess")
    server.busy_left = 10
    with make_env("agentgym", base_url=url, timeout=5, busy_retries=1) as env:
        with pytest.raises(AgentGymError, match="HTTP 503"):
            env.reset({"env": "agentgym", "description": "", "data": {"item_id": 3}})
    with make_env("agentgym", base_url="http://127.0.0.1:9", timeout=1) as env:
        with pytest.raises(AgentGymError, match="ConnectError"):
            env.reset({"env": "agentgym", "description": "", "data": {}})


def test_helpers():
    assert extract_action("Thought:\nI should look.\n\nAction:\ngo to desk 1") == "go to desk 1"
    assert extract_action("click[Buy Now]") == "click[Buy Now]"
    assert item_index("webshop_1418") == 1418 and item_index(7) == 7
    with pytest.raises(ValueError):
        item_index("no-number-here")
