"""HTTP client environment for AgentGym environment servers (webshop, alfworld, babyai, sciworld,
textcraft, ...), following the protocol of AgentGym's own clients (agentenv/envs/*.py):

  POST /create                       -> {"id": n} (webshop: a bare n)
  POST /reset   {<id>, <reset args>} -> {"observation", ...}  (webshop: then GET /observation)
  POST /step    {<id>, "action"}     -> {"observation"|"state", "reward", "score"?, "done"}
  GET  /observation?<id>=n           -> the current observation
  POST /close   {<id>}

The servers differ in small ways (the id's key, the reset arguments, where the reward is), so
each known server has a profile (its env's spec holds it); any other server gets the common shape. Every request has a
timeout, and the instance on the server is closed in `close()`, which the context manager and
`reset` (for the previous instance) always call: AgentGym's servers keep an instance per
`create` until it is closed, and leaked instances were what made them fall over under load.
"""
from __future__ import annotations

import logging
import time
from typing import Any

import httpx

from trajforge.pipeline.envs.agentgym import extract_action, item_index, server_profile
from trajforge.pipeline.envs.tasks import Task, coerce_task
from trajforge.pipeline.synth.envs.base import ClosingEnvironment, EnvFailure, StepResult

log = logging.getLogger(__name__)


class AgentGymError(EnvFailure):
    """The environment server failed, answered garbage, or did not answer in time."""


class AgentGymEnv(ClosingEnvironment):
    name = "agentgym"

    def __init__(self, base_url: str, env_name: str = "", timeout: float = 30.0, busy_retries: int = 3):
        self.base_url = base_url.rstrip("/")
        self.env_name = env_name
        self.timeout = timeout
        self.busy_retries = busy_retries
        self._client: httpx.Client | None = None
        self._profile = server_profile(env_name)
        self._instance: Any = None
        self._done = False

    # --- HTTP --------------------------------------------------------------------------------
    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        if self._client is None:
            self._client = httpx.Client(base_url=self.base_url, timeout=self.timeout)
        for attempt in range(self.busy_retries + 1):
            try:
                response = self._client.request(method, path, **kwargs)
            except httpx.TimeoutException as e:
                raise AgentGymError(f"{method} {path}: no answer within {self.timeout}s") from e
            except httpx.HTTPError as e:
                raise AgentGymError(f"{method} {path}: {type(e).__name__}: {e}") from e
            # 503 means the server is busy and did nothing (AgentGym's WebShop client retries it).
            if response.status_code == 503 and attempt < self.busy_retries:
                time.sleep(0.1 * 2 ** attempt)
                continue
            if response.status_code != 200:
                raise AgentGymError(f"{method} {path}: HTTP {response.status_code}: {response.text[:300]}")
            try:
                return response.json()
            except ValueError as e:
                raise AgentGymError(f"{method} {path}: not JSON: {response.text[:300]}") from e
        raise AssertionError("unreachable")

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        return self._request("POST", path, json={self._profile.id_key: self._instance, **body})

    def _observation(self, response: Any) -> str:
        if not isinstance(response, dict) or self._profile.observation_key not in response:
            raise AgentGymError(f"answer without {self._profile.observation_key!r}: {str(response)[:300]}")
        text = str(response[self._profile.observation_key])
        # SciWorld puts the goal beside the first observation; ALFWorld lists the legal actions.
        if response.get("task_description"):
            text = f"{response['task_description']}\n{text}"
        if response.get("available_actions"):
            text = f"{text}\nAVAILABLE ACTIONS: {','.join(map(str, response['available_actions']))}"
        return text

    # --- protocol ----------------------------------------------------------------------------
    def reset(self, task: Task | dict) -> str:
        self.close()
        t = coerce_task(task)
        if t.env != "agentgym":
            raise ValueError(f"task {t.id} is for env {t.env!r}, not 'agentgym'")
        name = t.data.get("env_name") or self.env_name
        self._profile = server_profile(name)
        index = item_index(t.data.get("item_id", t.data.get("data_idx", 0)))
        created = self._request("POST", "/create")
        self._instance = created if not isinstance(created, dict) else created.get("id", created.get("env_idx"))
        if self._instance is None:
            raise AgentGymError(f"/create answered no instance id: {str(created)[:300]}")
        self._done = False
        try:
            response = self._post("/reset", self._profile.reset_args(index))
            if self._profile.observe_after_reset:
                return str(self._request("GET", "/observation", params={self._profile.id_key: self._instance}))
            return self._observation(response)
        except BaseException:
            self.close()
            raise

    def step(self, action: str) -> StepResult:
        if self._instance is None or self._done:
            raise RuntimeError("step() before reset() or after the episode ended")
        command = extract_action(action)
        if not command:
            return StepResult("Invalid action: empty.", info={"valid": False})
        response = self._post("/step", {"action": command})
        observation = self._observation(response)
        reward = float(response.get(self._profile.reward_key, response.get("reward", 0.0)) or 0.0)
        done = bool(response.get("done", False))
        info: dict[str, Any] = {"valid": True, "action": command}
        if done:
            self._done = True
            info.update(score=reward, success=reward >= 1.0)
        return StepResult(observation, reward=reward, done=done, info=info)

    def close(self) -> None:
        """Close the server-side instance (best effort: the server may already be gone), then
        the connection pool."""
        try:
            if self._instance is not None:
                try:
                    self._post("/close", {})
                except AgentGymError as e:
                    log.warning("closing AgentGym instance %s failed: %s", self._instance, e)
        finally:
            self._instance = None
            if self._client is not None:
                self._client.close()
                self._client = None
