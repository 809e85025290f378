"""A loopback server that speaks AgentGym's HTTP protocol with a tiny deterministic game (guess the
number), in the common shape and in WebShop's shape."""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from aiohttp import web


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


@contextmanager
def guess_servers() -> Iterator:
    """Yields start(**kwargs) -> (server, url): a GuessServer on a loopback port in a background event
    loop; every server started is stopped on exit."""
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

    try:
        yield start
    finally:
        for loop, thread, state in loops:
            asyncio.run_coroutine_threadsafe(state["runner"].cleanup(), loop).result(10)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)
