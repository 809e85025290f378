"""A loopback OpenAI-compatible Chat Completions server for tests and benchmarks.

It speaks the real wire format (non-streaming `chat.completion` bodies with DeepSeek-R1's
envelope and `reasoning_content`), so the real `openai` client and our whole stack run against
it. What it answers comes from a policy (messages -> Reply), shaped like real R1 replies in
rotation: reasoning in `reasoning_content`, reasoning in a `<think>` block, the action inside
`reasoning_content` with empty content, and the action inside an unclosed `<think>`.

`FixturePolicy` replays reference solutions of the AgentBench fixture tasks: OS tasks run
their `evaluation.example` script and then answer with what it printed (match tasks) or
`finish` (check tasks); DB tasks run the reference SQL (`sql.query`, or the INSERT/UPDATE `label`)
and then commit the values the database returned. The answers are never read from the expected
result: a task succeeds only if the environment really produced it.

Faults are injected per call by a function (call number, request body) -> kind or None:
`429` (with Retry-After), `500`, `reset` (connection dropped before any response byte),
`malformed` (a JSON body cut off), `truncate` (finish_reason length, unclosed think), `empty`
(no content, no reasoning), `slow` (the reply waits `slow_s`), `401` (bad key). `max_tokens` (whitespace
tokens), `stop`, `n` and `seed` behave as on a real server.

Real servers' bad habits, each an option: `echo_request` puts the request (headers, Authorization
included, and body) into every error body, as careless servers do; `strict` rejects body fields
outside the OpenAI schema with transformers serve's 422 `{"detail": "Unexpected fields in the request:
{'top_k'}"}`; `sampling` makes replies differ between draws when the temperature is above 0 (without
it, the same request always gets the same reply, as from a server that ignores sampling).
`down_url()` is a base URL where nothing listens (connection refused).

Run standalone for benchmarks: `python -m tests.support.openai_server --latency 0.2` prints the base URL;
`GET /stats` returns the call counts.
"""
from __future__ import annotations

import argparse
import ast
import asyncio
import hashlib
import json
import logging
import random
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
R1_BODY = FIXTURES / "reasoning" / "openhands_deepseek_r1" / "jinja_turn1_reasoning_content_then_action.json"

SHAPES = ("reasoning_content", "think", "action_in_reasoning", "unclosed_think")

# The request fields of OpenAI's Chat Completions schema: what a strict server (transformers serve) accepts.
OPENAI_FIELDS = frozenset({
    "model", "messages", "stream", "stream_options", "temperature", "top_p", "n", "stop", "max_tokens",
    "max_completion_tokens", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs",
    "seed", "user", "response_format", "tools", "tool_choice", "parallel_tool_calls", "reasoning_effort",
    "metadata", "store", "modalities", "prediction", "audio", "service_tier", "web_search_options",
    "functions", "function_call"})


def down_url() -> str:
    """A loopback base URL with no server behind it: every connection is refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


@dataclass(frozen=True)
class Reply:
    reasoning: str
    content: str


Policy = Callable[[list[dict]], Reply]
Fault = Callable[[int, dict], "str | None"]


def echo_policy(messages: list[dict]) -> Reply:
    """For benchmarks: a short fixed-size answer about the last message."""
    last = messages[-1]["content"] if messages else ""
    return Reply("The user asked something; I will answer briefly.", f"Think: answering.\nAct: answer({len(last)})")


class Server:
    """The app plus its counters. Use as a context manager to run it on a background thread."""

    def __init__(self, policy: Policy = echo_policy, latency_s: float = 0.0, fault: Fault | None = None,
                 shapes: tuple[str, ...] = SHAPES, slow_s: float = 5.0, retry_after: str = "1",
                 echo_request: bool = False, strict: bool = False, sampling: bool = False,
                 port: int = 0, overlap: bool = False):
        self.policy = policy
        # With `overlap`, the very first request is held (in flight) until a request for another model
        # arrives: two clients' spans then overlap however far apart they start, and the held request
        # takes only one slot of a limit they share, so the other client can still get in.
        self.overlap = overlap
        self._held_model: str | None = None
        self._other_model: asyncio.Event | None = None
        self.echo_request = echo_request
        self.strict = strict
        self.sampling = sampling
        self._draws = random.Random()
        self.latency_s = latency_s
        self.fault = fault
        self.shapes = shapes
        self.slow_s = slow_s
        self.retry_after = retry_after
        self.port = port
        self.calls = 0
        self.faults: dict[str, int] = {}
        self.requests: list[dict] = []
        self.authorizations: set[str] = set()
        # Requests being answered now, the most at once, and (start, end, model) of each answered one.
        self.in_flight = 0
        self.max_in_flight = 0
        self.spans: list[tuple[float, float, str]] = []
        self._envelope = json.loads(R1_BODY.read_bytes())
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self.base_url = ""

    # --- the HTTP side -------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/stats", self._stats)
        return app

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "DeepSeek-R1", "object": "model"}]})

    async def _stats(self, request: web.Request) -> web.Response:
        return web.json_response({"calls": self.calls, "faults": self.faults})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        start = time.monotonic()
        try:
            if self.overlap:
                await self._hold_until_another_model(str(body.get("model")))
            return await self._answer(request, body)
        finally:
            self.in_flight -= 1
            self.spans.append((start, time.monotonic(), str(body.get("model"))))

    async def _hold_until_another_model(self, model: str, timeout_s: float = 120) -> None:
        if self._held_model is None:
            self._held_model, self._other_model = model, asyncio.Event()
            try:
                await asyncio.wait_for(self._other_model.wait(), timeout_s)
            except TimeoutError:
                pass  # the test's overlap check then fails and says so
        elif model != self._held_model:
            self._other_model.set()

    async def _answer(self, request: web.Request, body: dict) -> web.StreamResponse:
        self.calls += 1
        number = self.calls
        self.requests.append(body)
        self.authorizations.add(request.headers.get("Authorization", ""))
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or any(
                not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool")
                or not isinstance(m.get("content"), str) for m in messages):
            return web.json_response({"error": {"message": "invalid messages", "type": "invalid_request_error"}},
                                     status=400)
        unexpected = set(body) - OPENAI_FIELDS if self.strict else set()
        if unexpected:
            self.faults["422"] = self.faults.get("422", 0) + 1
            return self._error(request, body, 422, {"detail": f"Unexpected fields in the request: {unexpected}"})
        kind = self.fault(number, body) if self.fault else None
        if kind:
            self.faults[kind] = self.faults.get(kind, 0) + 1
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        if kind == "slow":
            await asyncio.sleep(self.slow_s)
        if kind == "429":
            return self._error(request, body, 429, {"error": {"message": "Rate limit reached",
                                                              "type": "rate_limit_error"}},
                               headers={"Retry-After": self.retry_after})
        if kind == "500":
            return self._error(request, body, 500, {"error": {"message": "Internal server error",
                                                              "type": "server_error"}})
        if kind == "401":
            return self._error(request, body, 401, {"error": {"message": "Incorrect API key provided",
                                                              "type": "invalid_request_error"}})
        if kind == "reset":
            request.transport.abort()
            raise asyncio.CancelledError
        completion = self.completion(body, kind)
        if kind == "malformed":
            text = json.dumps(completion)
            return web.Response(text=text[: len(text) // 2], content_type="application/json")
        return web.json_response(completion)

    def _error(self, request: web.Request, body: dict, status: int, payload: dict, **kw) -> web.Response:
        if self.echo_request:
            payload = {**payload, "request": {"headers": dict(request.headers), "body": body}}
        return web.json_response(payload, status=status, **kw)

    # --- the completion ------------------------------------------------------------------------
    def completion(self, body: dict, kind: str | None = None) -> dict:
        messages = body.get("messages") or []
        reply = self.policy(messages)
        if self.sampling and (body.get("temperature") or 0) > 0:
            reply = Reply(f"(draw {self._draws.random():.6f}) {reply.reasoning}", reply.content)
        choices, completion_tokens, reasoning_tokens = [], 0, 0
        for index in range(int(body.get("n") or 1)):
            shape = self._shape(messages, body.get("seed"), index)
            message, finish = self._shaped(reply, shape, body, kind)
            completion_tokens += len(((message.get("reasoning_content") or "") + " " + message["content"]).split())
            reasoning_tokens += len(reply.reasoning.split()) if kind not in ("empty", "truncate") else 0
            choices.append({"finish_reason": finish, "index": index, "message": message})
        prompt_tokens = sum(len(str(m.get("content", "")).split()) for m in messages)
        out = {k: v for k, v in self._envelope.items() if k not in ("choices", "timings")}
        digest = hashlib.sha1(json.dumps(body, sort_keys=True).encode()).hexdigest()[:32]
        out.update(choices=choices, created=int(time.time()), model=body.get("model", out["model"]),
                   id=f"chatcmpl-{digest}", usage={"completion_tokens": completion_tokens,
                                                   "prompt_tokens": prompt_tokens,
                                                   "total_tokens": prompt_tokens + completion_tokens,
                                                   # DeepSeek's API counts the reasoning here.
                                                   "completion_tokens_details": {"reasoning_tokens": reasoning_tokens}})
        return out

    def _shape(self, messages: list[dict], seed, index: int) -> str:
        key = json.dumps([messages[-1:] if messages else [], seed, index], sort_keys=True)
        return self.shapes[int(hashlib.sha1(key.encode()).hexdigest(), 16) % len(self.shapes)]

    def _shaped(self, reply: Reply, shape: str, body: dict, kind: str | None) -> tuple[dict, str]:
        if kind == "empty":
            return {"role": "assistant", "content": "", "reasoning_content": ""}, "stop"
        if kind == "truncate":
            cut = reply.reasoning[: max(1, len(reply.reasoning) // 2)]
            return {"role": "assistant", "content": f"<think>\n{cut}"}, "length"
        content, finish = reply.content, "stop"
        for stop in body.get("stop") or []:
            if stop and stop in content:
                content = content[: content.index(stop)]
        limit = body.get("max_tokens") or body.get("max_completion_tokens")
        if limit is not None:
            budget = int(limit) - len(reply.reasoning.split())
            if budget < len(content.split()):
                if budget <= 0:
                    cut = " ".join(reply.reasoning.split()[: int(limit)])
                    return {"role": "assistant", "content": f"<think>\n{cut}"}, "length"
                content, finish = " ".join(content.split()[:budget]), "length"
        if shape == "reasoning_content":
            return {"role": "assistant", "reasoning_content": reply.reasoning, "content": content}, finish
        if shape == "action_in_reasoning":
            return {"role": "assistant", "reasoning_content": f"{reply.reasoning}\n\n{content}", "content": ""}, finish
        if shape == "unclosed_think":
            return {"role": "assistant", "content": f"<think>\n{reply.reasoning}\n\n{content}\n"}, finish
        return {"role": "assistant", "content": f"<think>\n{reply.reasoning}\n</think>\n\n{content}"}, finish

    # --- running it ----------------------------------------------------------------------------
    def __enter__(self) -> Server:
        started = threading.Event()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            self._runner = web.AppRunner(self.app(), access_log=None, handle_signals=False)
            self._loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, "127.0.0.1", self.port, backlog=1024)
            self._loop.run_until_complete(site.start())
            port = site._server.sockets[0].getsockname()[1]
            self.base_url = f"http://127.0.0.1:{port}/v1"
            started.set()
            self._loop.run_forever()
            self._loop.run_until_complete(self._runner.cleanup())
            self._loop.close()

        logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
        self._thread = threading.Thread(target=run, name="openai-test-server", daemon=True)
        self._thread.start()
        if not started.wait(10):
            raise RuntimeError("test server did not start")
        return self

    def __exit__(self, *exc) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(10)


# --- the fixture-task policy -------------------------------------------------------------------
_OS_OUTPUT = re.compile(r"^The output of the OS:\s*", re.S)


def observation_text(observation: str) -> str:
    """What a command printed, without the environment's framing."""
    text = _OS_OUTPUT.sub("", observation.strip())
    return re.sub(r"\n?\[truncated because the output is too long\]$", "", text).strip()


def db_values(observation: str) -> list[str]:
    """The values of a DB observation (`[('x',), ('y',)]`, MySQL style), flattened."""
    text = observation.strip()
    try:
        rows = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return [text] if text else []
    if not isinstance(rows, (list, tuple)):
        return [str(rows)]
    return [str(v) for row in rows for v in (row if isinstance(row, (list, tuple)) else [row])]


def _script_code(script) -> str | None:
    if script is None:
        return None
    if isinstance(script, str):
        return script
    if isinstance(script, dict) and script.get("language", "bash") == "bash":
        return script.get("code")
    return None


@dataclass
class TaskScript:
    """Steps of a reference solution: each step is (thought, observation of the previous step -> action)."""
    steps: list[tuple[str, Callable[[str], str]]]


@dataclass
class FixturePolicy:
    """Replays the reference solution of whichever fixture task the conversation is about."""
    scripts: dict[str, TaskScript] = field(default_factory=dict)

    def add_os_task(self, task: dict) -> None:
        example = _script_code(task.get("evaluation", {}).get("example")) or _script_code(task.get("example"))
        steps: list[tuple[str, Callable[[str], str]]] = []
        if example:
            steps.append(("I will run the reference commands for this task.",
                          lambda _obs, code=example: f"bash\n```bash\n{code}\n```"))
        else:
            steps.append(("I will look around first.", lambda _obs: "bash\n```bash\nls\n```"))
        if "match" in task.get("evaluation", {}):
            steps.append(("The command printed the answer.", lambda obs: f"answer({observation_text(obs)})"))
        else:
            steps.append(("The system is in the required state now.", lambda _obs: "finish"))
        self.scripts[task["description"]] = TaskScript(steps)

    def add_db_task(self, task: dict) -> None:
        if task.get("sql"):
            query = task["sql"]["query"]
        else:
            query = task["label"][0]
        steps = [("I will query the table.", lambda _obs, q=query: f"Operation\n```sql\n{q}\n```"),
                 ("The database returned the answer.",
                  lambda obs: "Answer\nFinal Answer: " + json.dumps(db_values(obs), ensure_ascii=False))]
        self.scripts[task["description"]] = TaskScript(steps)

    def __call__(self, messages: list[dict]) -> Reply:
        prompt = next((m["content"] for m in messages if m["role"] == "user"), "")
        matches = [d for d in self.scripts if d in prompt]
        if not matches:
            return Reply("I do not recognise this task.", "Think: I cannot solve this.\nAct: finish")
        description = max(matches, key=len)
        script = self.scripts[description]
        # Turns that did not parse (the agent re-prompted) do not advance the script.
        done = sum(1 for m in messages if m["role"] == "assistant" and _is_action(m["content"]))
        thought, act = script.steps[min(done, len(script.steps) - 1)]
        # The observation is the user turn right after the last action (re-prompts come later).
        acted = [i for i, m in enumerate(messages) if m["role"] == "assistant" and _is_action(m["content"])]
        after = acted[-1] + 1 if acted else len(messages)
        observation = messages[after]["content"] if after < len(messages) else ""
        action = act(observation)
        dialect_db = action.startswith(("Operation", "Answer"))
        reasoning = (f"Okay, the task is: {description[:200]}\nStep {done + 1} of my plan. {thought} "
                     f"Let me make sure the command is right before I send it.")
        content = f"{thought}\nAction: {action}" if dialect_db else f"Think: {thought}\n\nAct: {action}"
        return Reply(reasoning, content)


def _is_action(content: str) -> bool:
    return bool(re.search(r"(?m)^(?:Act|Action):", content))


def fixture_policy(os_files: list[Path] = (), db_files: list[Path] = ()) -> FixturePolicy:
    policy = FixturePolicy()
    for path in os_files:
        data = json.loads(Path(path).read_text())
        for task in data if isinstance(data, list) else [data]:
            policy.add_os_task(task)
    for path in db_files:
        for line in Path(path).read_text().splitlines():
            if line.strip():
                policy.add_db_task(json.loads(line))
    return policy


# --- the critical-step selector policy ---------------------------------------------------------
_STEP_HEADER = re.compile(r"^### (Step (\d+)|Observation|Agent \(context, not a step\))$", re.M)
_ERROR_WORDS = re.compile(r"error|not found|no such|denied|invalid|traceback|syntax", re.I)


@dataclass
class CriticalStepPolicy:
    """Answers the selector prompt of `pipeline.critical_steps` from the trajectory it is shown.

    Its judgement is a rule a careful annotator would also apply: the first step makes the plan, a
    step right after an observation that reports an error corrects course, and the last step (the
    answer or the commit) is the critical action; everything else is routine. `garble(prompt)`
    says which prompts get a reply that is not JSON (every time they are asked).
    """
    garble: Callable[[str], bool] = lambda _prompt: False
    answered: int = 0

    def __call__(self, messages: list[dict]) -> Reply:
        prompt = next((m["content"] for m in messages if m["role"] == "user"), "")
        if self.garble(prompt):
            return Reply("The trajectory is long.", "I think steps one and three matter most.")
        blocks = list(_STEP_HEADER.finditer(prompt))
        chosen: dict[int, tuple[str, str]] = {}
        previous_observation = ""
        steps = []
        for k, block in enumerate(blocks):
            end = blocks[k + 1].start() if k + 1 < len(blocks) else len(prompt)
            body = prompt[block.end():end]
            if block.group(2):
                number = int(block.group(2))
                steps.append(number)
                if steps[:-1] and _ERROR_WORDS.search(previous_observation):
                    chosen[number] = ("self_correction", "It reacts to the error the environment reported.")
                previous_observation = ""
            elif block.group(1) == "Observation":
                previous_observation = body
        if steps:
            chosen.setdefault(steps[0], ("plan_creation", "It decides how to approach the task."))
            chosen[steps[-1]] = ("critical_action", "It gives the final answer that completes the task.")
        self.answered += 1
        answer = {"critical_steps": [{"step": n, "category": c, "reason": r} for n, (c, r) in sorted(chosen.items())]}
        return Reply(f"The trajectory has {len(steps)} steps; I look for plans, errors and the final action.",
                     json.dumps(answer))


def main() -> None:
    parser = argparse.ArgumentParser(description="loopback OpenAI-compatible test server")
    parser.add_argument("--latency", type=float, default=0.0, help="seconds each call waits before answering")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (default: any free one)")
    parser.add_argument("--db-tasks", action="append", default=[], help="DBBench task file: answer with the fixture policy")
    parser.add_argument("--os-tasks", action="append", default=[], help="AgentBench OS task file: the same")
    args = parser.parse_args()
    policy = fixture_policy(args.os_tasks, args.db_tasks) if args.db_tasks or args.os_tasks else echo_policy
    with Server(policy, latency_s=args.latency, port=args.port) as server:
        print(server.base_url, flush=True)
        threading.Event().wait()


if __name__ == "__main__":
    main()
