"""The `agentgym` HTTP client against real loopback servers that speak AgentGym's protocol with a
tiny deterministic game (guess the number), in the common shape and in WebShop's shape."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
from aiohttp import web

from trajforge.pipeline.envs.agentgym import extract_action, item_index
from trajforge.pipeline.synth.envs import make_env
from trajforge.pipeline.synth.envs.agentgym import AgentGymError


class GuessServer:
    """Guess a number 0-9; the target is (7 * index + 3) % 10. `webshop=True` uses WebShop's
    shape: bare id from /create, `env_idx`, `session_id`, `state`, no observation from /reset."""

    def __init__(self, webshop: bool = False):
        self.webshop = webshop
        self.id_key = "env_idx" if webshop else "id"
        self.envs: dict[int, dict] = {}
        self.created = 0
        self.busy_left = 0   # answer 503 this many times first
        self.delay = 0.0     # seconds before answering /step

    def app(self) -> web.Application:
        app = web.Application()
        app.add_routes([web.post("/create", self.create), web.post("/reset", self.reset),
                        web.post("/step", self.step), web.get("/observation", self.observation),
                        web.post("/close", self.close)])
        return app

    async def create(self, request: web.Request) -> web.Response:
        if self.busy_left:
            self.busy_left -= 1
            return web.Response(status=503)
        self.created += 1
        self.envs[self.created] = {"target": None, "obs": "", "done": False}
        return web.json_response(self.created if self.webshop else {"id": self.created})

    def _env(self, body: dict) -> dict:
        env = self.envs.get(body.get(self.id_key))
        if env is None:
            raise web.HTTPNotFound(text="no such env")
        return env

    async def reset(self, request: web.Request) -> web.Response:
        body = await request.json()
        env = self._env(body)
        index = body["session_id"] if self.webshop else body["data_idx"]
        env.update(target=(7 * index + 3) % 10, done=False, obs="Guess my number (0-9). Act: guess N")
        if self.webshop:
            return web.json_response([None, 0.0, False, {}])
        return web.json_response({"observation": env["obs"], "available_actions": ["guess 0", "guess 9"]})

    async def step(self, request: web.Request) -> web.Response:
        await asyncio.sleep(self.delay)
        body = await request.json()
        env = self._env(body)
        words = body["action"].split()
        if len(words) != 2 or words[0] != "guess" or not words[1].isdigit():
            env["obs"], reward = "Invalid action.", 0.0
        else:
            guess = int(words[1])
            env["obs"] = "correct" if guess == env["target"] else ("higher" if guess < env["target"] else "lower")
            reward = 1.0 if guess == env["target"] else 0.0
            env["done"] = reward == 1.0
        key = "state" if self.webshop else "observation"
        return web.json_response({key: env["obs"], "reward": reward, "done": env["done"]})

    async def observation(self, request: web.Request) -> web.Response:
        env = self._env({self.id_key: int(request.query[self.id_key])})
        return web.json_response(env["obs"])

    async def close(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.envs.pop(body.get(self.id_key), None)
        return web.json_response({"closed": True})


@pytest.fixture
def serve():
    """Start a GuessServer on a loopback port in a background event loop; yields (server, url)."""
    loops = []

    def start(**kwargs):
        server = GuessServer(**kwargs)
        loop = asyncio.new_event_loop()
        ready = threading.Event()
        state: dict = {}

        async def main():
            runner = web.AppRunner(server.app())
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            state["runner"], state["port"] = runner, site._server.sockets[0].getsockname()[1]
            ready.set()

        thread = threading.Thread(target=lambda: (loop.run_until_complete(main()), loop.run_forever()), daemon=True)
        thread.start()
        assert ready.wait(10)
        loops.append((loop, thread, state))
        return server, f"http://127.0.0.1:{state['port']}"

    yield start
    for loop, thread, state in loops:
        asyncio.run_coroutine_threadsafe(state["runner"].cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


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
