"""Chat-completion backends for synthesis: any OpenAI-compatible server, or vLLM's offline engine.

Why this is more than `client.chat.completions.create`:

* Throughput: one async client, a semaphore bounds the requests in flight, so a synthesis job can
  keep a server saturated without flooding it.
* Robustness: the SDK's own retries are switched off (`max_retries=0`) so that every retry goes
  through one policy: exponential backoff with full jitter on timeouts, connection resets, 5xx and
  malformed bodies, and at least the server's Retry-After on 429. When retries run out the call
  raises `LLMError` with a reason code; the agent turns that into a failure with a reason.
* A server that is gone: after `max_connection_failures` requests in a row that could not connect,
  or at the first refused connection of a server that has not answered yet in this job (nothing
  listens there), every call raises `ServerUnreachable` at once, so the job stops instead of
  retrying each episode.
* Strict servers: a 400/422 that names a sampling field the server does not accept (`top_k`,
  `min_p` outside the OpenAI schema) drops that field for the rest of the job, with one warning.
* Error bodies are kept, redacted (`pipeline.redact`), in the error detail: a server may echo the
  Authorization header.
* Never paying twice: every response is stored in a SQLite cache keyed by a hash of (model,
  messages, sampling parameters, sample index), so a crashed or repeated job makes no call it
  already made. The API key is not part of the key and is never stored or logged.
* Reasoning models: per-family default sampling (DeepSeek-R1 and QwQ-32B as their model cards
  recommend); R1 gets no system prompt, it is merged into the first user turn.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import random
import re
import sqlite3
import threading
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from trajforge.pipeline.redact import redact
from trajforge.pipeline.registry import Registry

log = logging.getLogger("trajforge.llm")

# Environment variables read when the config does not say; the key is only ever read, never echoed.
ENV_BASE_URL = "TRAJFORGE_BASE_URL"
ENV_MODEL = "TRAJFORGE_MODEL"
ENV_API_KEYS = ("TRAJFORGE_API_KEY", "OPENAI_API_KEY")


@dataclass(frozen=True)
class Family:
    """What a model family's card recommends. `system_prompt=False`: merge it into the first user turn."""
    name: str
    sampling: dict[str, Any]
    system_prompt: bool = True


# DeepSeek-R1 card: temperature 0.5-0.7 (0.6 recommended), top_p 0.95, "avoid adding a system
# prompt". QwQ-32B card: temperature 0.6, top_p 0.95, top_k 20-40. top_k is not an OpenAI
# parameter, so it travels in extra_body (vLLM and SGLang read it there).
FAMILIES: Registry[Family] = Registry("model family", {
    "deepseek-r1": Family("deepseek-r1", {"temperature": 0.6, "top_p": 0.95}, system_prompt=False),
    "qwq": Family("qwq", {"temperature": 0.6, "top_p": 0.95, "top_k": 40}),
    "default": Family("default", {}),
})

def family_of(model: str) -> Family:
    """The family of a model name as servers spell it (`deepseek-ai/DeepSeek-R1`, `DeepSeek-R1-Distill-Qwen-7B`,
    `deepseek-reasoner`, `Qwen/QwQ-32B`, `qwq-32b-q4`)."""
    name = model.lower().rsplit("/", 1)[-1]
    if "qwq" in name:
        return FAMILIES["qwq"]
    if "deepseek-r1" in name or "deepseek-reasoner" in name or name.startswith("r1-") or "-r1-" in name:
        return FAMILIES["deepseek-r1"]
    return FAMILIES["default"]


def sampling_params(model: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The family defaults with the config's overrides on top; a None override removes a default."""
    params = dict(family_of(model).sampling)
    for key, value in (overrides or {}).items():
        if value is None:
            params.pop(key, None)
        else:
            params[key] = value
    return params


def prepare_messages(model: str, messages: list[dict]) -> list[dict]:
    """Messages as the family wants them: R1 gets its system prompt as the head of the first user turn."""
    if family_of(model).system_prompt or not messages or messages[0]["role"] != "system":
        return [dict(m) for m in messages]
    system, rest = messages[0]["content"], [dict(m) for m in messages[1:]]
    first_user = next((i for i, m in enumerate(rest) if m["role"] == "user"), None)
    if first_user is None:
        return [{"role": "user", "content": system}, *rest]
    rest[first_user]["content"] = f"{system}\n\n{rest[first_user]['content']}"
    return rest


@dataclass
class LLMConfig:
    """Where and how to call the model. `api_key` is excluded from repr so that it never lands in a log."""
    model: str | None = None
    base_url: str | None = None
    api_key: str | None = field(default=None, repr=False)
    sampling: dict[str, Any] = field(default_factory=dict)
    concurrency: int = 64
    timeout_s: float = 600.0
    max_retries: int = 8
    # Requests in a row that could not connect before the job stops (the first refused one, while the
    # server has not answered yet); 0: never.
    max_connection_failures: int = 10
    backoff_base_s: float = 0.5
    backoff_max_s: float = 60.0
    cache_path: str | None = None
    # Entered around every HTTP request, inside the per-job bound: how an orchestrator adds a limit
    # shared by all jobs on one endpoint (flows/limits.py puts a Prefect global concurrency limit here).
    request_gate: Callable[[], AbstractAsyncContextManager] | None = field(default=None, repr=False, compare=False)

    def resolved(self) -> LLMConfig:
        """Fill model, base URL and key from the environment when the config leaves them out."""
        key = self.api_key or next((os.environ[k] for k in ENV_API_KEYS if os.environ.get(k)), None)
        model = self.model or os.environ.get(ENV_MODEL)
        if not model:
            raise ValueError(f"no model: set it in the config or {ENV_MODEL}")
        # vLLM and SGLang accept any key; the SDK refuses to start without one.
        return replace(self, model=model, base_url=self.base_url or os.environ.get(ENV_BASE_URL),
                       api_key=key or "EMPTY")

    @property
    def params(self) -> dict[str, Any]:
        return sampling_params(self.model or "", self.sampling)


@dataclass(frozen=True)
class Choice:
    content: str
    reasoning_content: str | None
    finish_reason: str | None

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"

    @property
    def empty(self) -> bool:
        return not self.content.strip() and not (self.reasoning_content or "").strip()


@dataclass(frozen=True)
class ChatResult:
    choices: list[Choice]
    usage: dict[str, int]
    model: str
    cached: bool
    params: dict[str, Any] = field(default_factory=dict)  # the sampling parameters this request really sent


class LLMError(RuntimeError):
    """A call that failed for good. `reason` is a code: rate_limited, server_error, timeout, connection,
    malformed_response, client_error."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class ServerUnreachable(LLMError):
    """The server could not be reached `max_connection_failures` times in a row: the job stops."""

    def __init__(self, detail: str):
        super().__init__("connection", detail)


class _Retryable(Exception):
    def __init__(self, reason: str, detail: str, retry_after: float | None = None):
        super().__init__(detail)
        self.reason = reason
        self.detail = detail
        self.retry_after = retry_after


class _UnsupportedParams(Exception):
    def __init__(self, names: list[str], detail: str):
        super().__init__(detail)
        self.names = names
        self.detail = detail


# How servers say a body field is not theirs: transformers serve (422 "Unexpected fields in the request:
# {'top_k'}"), pydantic (`extra_forbidden`, "Extra inputs are not permitted"), OpenAI ("Unrecognized request
# argument supplied: top_k", "Unsupported parameter: 'top_k'").
_UNSUPPORTED_FIELD = re.compile(r"unexpected|unrecogni[sz]ed|unknown|unsupported|not supported|extra[_ ]"
                                r"(?:fields?|inputs?|forbidden)|not permitted|not allowed", re.I)


def unsupported_params(status: int, text: str, sent: list[str]) -> list[str]:
    """The sent parameter names that a 400/422 error text rejects as unknown or unsupported."""
    if status not in (400, 422) or not _UNSUPPORTED_FIELD.search(text):
        return []
    return [name for name in sent if re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text)]


def _connection_cause(exc: BaseException) -> BaseException | None:
    """The deepest error under `exc` that says the connection failed (refused, reset, closed by a dying server).

    The SDK's aiohttp transport reports a refused connection as `APITimeoutError` (through httpx's
    `ConnectTimeout`) within milliseconds, so the exception's class alone would say `timeout`.
    """
    found, seen = None, set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and not isinstance(exc, TimeoutError) or type(exc).__name__ == "ServerDisconnectedError":
            found = exc
        exc = exc.__cause__ or exc.__context__
    return found


def parse_body(body: Any) -> ChatResult:
    """A Chat Completions body (dict) -> ChatResult; raises ValueError when it is not one."""
    if not isinstance(body, dict) or not isinstance(body.get("choices"), list) or not body["choices"]:
        raise ValueError("no choices in the response body")
    choices = [_parse_choice(c) for c in
               sorted(body["choices"], key=lambda c: c.get("index", 0) if isinstance(c, dict) else 0)]
    return ChatResult(choices, _usage_counts(body.get("usage")), str(body.get("model", "")), False)


def _parse_choice(choice: Any) -> Choice:
    message = choice.get("message") if isinstance(choice, dict) else None
    if not isinstance(message, dict):
        raise ValueError("a choice without a message")
    content = message.get("content")
    # vLLM and DeepSeek say `reasoning_content`; newer vLLM and OpenRouter say `reasoning`.
    reasoning = message.get("reasoning_content", message.get("reasoning"))
    if content is not None and not isinstance(content, str) or reasoning is not None and not isinstance(reasoning, str):
        raise ValueError("message content is not text")
    return Choice(content or "", reasoning, choice.get("finish_reason"))


def _usage_counts(usage: Any) -> dict[str, int]:
    """The integer token counts of a body's `usage`, with `reasoning_tokens` lifted from its details."""
    usage = usage if isinstance(usage, dict) else {}
    counts = {k: v for k, v in usage.items() if isinstance(v, int) and not isinstance(v, bool)}
    # OpenAI, vLLM and DeepSeek count the reasoning inside `completion_tokens_details`.
    details = usage.get("completion_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("reasoning_tokens"), int):
        counts["reasoning_tokens"] = details["reasoning_tokens"]
    return counts


def request_key(model: str, messages: list[dict], params: dict[str, Any], sample: int) -> str:
    """Cache key. `sample` tells apart the N draws of best-of-N, which share messages and params."""
    blob = json.dumps({"model": model, "messages": messages, "params": params, "sample": sample},
                      sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


class JsonStore:
    """JSON values by key in one SQLite table; each put is committed, so a crash loses nothing done.

    WAL lets several processes share one file. The request cache and the synthesis episode
    journal are both one of these.
    """

    def __init__(self, path: str | Path, table: str):
        if not table.isidentifier():
            raise ValueError(f"bad table name {table!r}")
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._table = table
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(path), check_same_thread=False, timeout=30)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute(f"CREATE TABLE IF NOT EXISTS {table} (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        self._db.commit()

    def get(self, key: str) -> Any | None:
        with self._lock:
            row = self._db.execute(f"SELECT value FROM {self._table} WHERE key = ?", (key,)).fetchone()
        return json.loads(row[0]) if row else None

    def put(self, key: str, value: Any) -> None:
        with self._lock:
            self._db.execute(f"INSERT OR REPLACE INTO {self._table} VALUES (?, ?)", (key, json.dumps(value)))
            self._db.commit()

    def __len__(self) -> int:
        with self._lock:
            return self._db.execute(f"SELECT COUNT(*) FROM {self._table}").fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._db.close()


class RequestCache(JsonStore):
    """Response bodies by request key."""

    def __init__(self, path: str | Path):
        super().__init__(path, "responses")


class ChatBackend(Protocol):
    model: str
    params: dict[str, Any]            # the sampling parameters sent (fields the server rejected are dropped)
    config: LLMConfig
    stats: CallStats
    unreachable: str | None           # why the server counts as gone (set by the circuit breaker)
    dropped: list[str]                # sampling fields the server rejected, no longer sent

    def redact(self, text: str | None) -> str | None: ...

    async def chat(self, messages: list[dict], sample: int = 0, **overrides: Any) -> ChatResult: ...

    async def aclose(self) -> None: ...


@dataclass
class CallStats:
    calls: int = 0          # requests the server answered (any HTTP status), retries included
    attempts: int = 0       # requests sent, answered or not (refused, reset, timed out)
    cache_hits: int = 0
    retries: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    usage: dict[str, int] = field(default_factory=dict)  # tokens of the answers this run paid for

    def add_usage(self, usage: dict[str, int]) -> None:
        for key, value in usage.items():
            self.usage[key] = self.usage.get(key, 0) + value


class OpenAIBackend:
    """Async Chat Completions through the `openai` client, with bounded concurrency, retries and a cache."""

    def __init__(self, config: LLMConfig):
        import openai

        self.config = config.resolved()
        self.model = self.config.model
        self.stats = CallStats()
        self.unreachable: str | None = None
        self._requested = self.config.params
        self._openai = openai
        # The SDK's aiohttp transport: at concurrency 64 the httpx pool cost 3.5 ms of client CPU per
        # call, which capped the rate below what the server allows; aiohttp costs 2.5 ms (bench/).
        self._client = openai.AsyncOpenAI(base_url=self.config.base_url, api_key=self.config.api_key,
                                          timeout=self.config.timeout_s, max_retries=0,
                                          http_client=openai.DefaultAioHttpClient(timeout=self.config.timeout_s))
        self._semaphore = asyncio.Semaphore(self.config.concurrency)
        self._gate = self.config.request_gate or nullcontext
        self._cache = RequestCache(self.config.cache_path) if self.config.cache_path else None
        self._connection_failures = 0
        self._logged: set[str] = set()
        # Fields this server rejected, remembered with the cache so that a rerun does not ask again.
        self._unsupported_key = f"unsupported-params {self.config.base_url} {self.model}"
        self.dropped: list[str] = (self._cache.get(self._unsupported_key) if self._cache is not None else None) or []

    @property
    def params(self) -> dict[str, Any]:
        return {k: v for k, v in self._requested.items() if k not in self.dropped}

    def request(self, messages: list[dict], **overrides: Any) -> tuple[list[dict], dict[str, Any]]:
        """The messages and parameters actually sent (family rules applied, rejected fields dropped)."""
        params = {**self._requested, **{k: v for k, v in overrides.items() if v is not None}}
        return prepare_messages(self.model, messages), {k: v for k, v in params.items() if k not in self.dropped}

    def redact(self, text: str | None) -> str | None:
        return redact(text, [self.config.api_key])

    async def chat(self, messages: list[dict], sample: int = 0, **overrides: Any) -> ChatResult:
        while True:
            sent, params = self.request(messages, **overrides)
            key = request_key(self.model, sent, params, sample)
            if self._cache is not None:
                body = self._cache.get(key)
                if body is not None:
                    self.stats.cache_hits += 1
                    return replace(parse_body(body), cached=True, params=params)
            try:
                body, result = await self._call_with_retries(sent, params)
            except _UnsupportedParams as exc:
                self._drop(exc.names, exc.detail)
                continue
            if self._cache is not None:
                self._cache.put(key, body)
            self.stats.add_usage(result.usage)
            return replace(result, params=params)

    def _drop(self, names: list[str], detail: str) -> None:
        new = sorted(n for n in names if n not in self.dropped)
        if not new:
            return
        self.dropped = sorted({*self.dropped, *new})
        if self._cache is not None:
            self._cache.put(self._unsupported_key, self.dropped)
        log.warning("the server rejects %s (%s); sending the requests without %s from now on",
                    ", ".join(new), detail, "it" if len(new) == 1 else "them")

    def _log_once(self, level: int, message: str) -> None:
        if message not in self._logged:
            self._logged.add(message)
            log.log(level, "%s", message)

    async def _call_with_retries(self, messages: list[dict], params: dict[str, Any]) -> tuple[dict, ChatResult]:
        attempt = 0
        while True:
            try:
                async with self._semaphore, self._gate():
                    if self.unreachable:
                        raise ServerUnreachable(self.unreachable)
                    self.stats.attempts += 1
                    return await self._call_once(messages, params)
            except _Retryable as exc:
                attempt += 1
                if attempt > self.config.max_retries:
                    self.stats.failures[exc.reason] = self.stats.failures.get(exc.reason, 0) + 1
                    raise LLMError(exc.reason, f"gave up after {attempt} attempts: {exc.detail}") from None
                self.stats.retries += 1
                # Full jitter spreads the retries of many concurrent calls; Retry-After is a floor.
                delay = random.uniform(0, min(self.config.backoff_max_s, self.config.backoff_base_s * 2 ** (attempt - 1)))
                if exc.retry_after is not None:
                    delay = max(delay, min(exc.retry_after, self.config.backoff_max_s))
                log.warning("%s (attempt %d/%d); retrying in %.2fs", exc.reason, attempt,
                            self.config.max_retries + 1, delay)
                await asyncio.sleep(delay)
            except ServerUnreachable:
                self.stats.failures["connection"] = self.stats.failures.get("connection", 0) + 1
                raise

    async def _call_once(self, messages: list[dict], params: dict[str, Any]) -> tuple[dict, ChatResult]:
        openai = self._openai
        try:
            # The client's own POST (auth, headers, timeouts, errors mapped to openai exceptions) with
            # the body as we built it: `chat.completions.create` would re-walk every message through
            # the SDK's TypedDict transform, which costs more CPU than the rest of the call (bench/),
            # and its parsed model would drop nothing we need but cost a pydantic pass. Parameters
            # other servers read from the top level (top_k, min_p) go there, as extra_body would put them.
            body = await self._client.post("/chat/completions", cast_to=object,
                                           body={"model": self.model, "messages": messages, "stream": False, **params})
        except openai.APIStatusError as exc:
            self._answered()
            raise self._status_error(exc, params) from None
        except openai.APIConnectionError as exc:  # APITimeoutError included
            raise self._unanswered(exc) from None
        except ValueError as exc:  # a body that is not JSON (cut off, HTML from a proxy)
            self._answered()
            raise _Retryable("malformed_response", type(exc).__name__) from None
        self._answered()
        try:
            return body, parse_body(body)
        except ValueError as exc:
            raise _Retryable("malformed_response", str(exc)) from None

    def _answered(self) -> None:
        self.stats.calls += 1
        self._connection_failures = 0

    def _unanswered(self, exc: Exception) -> Exception:
        cause = _connection_cause(exc)
        if cause is None:
            return _Retryable("timeout", f"no response within {self.config.timeout_s}s")
        detail = self.redact(f"{type(cause).__name__}: {cause}"[:300])
        self._connection_failures += 1
        limit = self.config.max_connection_failures
        where = self.config.base_url or "the OpenAI API"
        if limit and not self.unreachable:
            if self._connection_failures >= limit:
                self.unreachable = (f"{self._connection_failures} requests in a row could not connect to {where} "
                                    f"(last: {detail})")
            elif isinstance(cause, ConnectionRefusedError) and not self.stats.calls:
                # Nothing listens there (a mistyped port, a server not started): retrying with backoff
                # would take minutes per request when few requests are in flight to fill the count.
                self.unreachable = (f"{where} refused the connection and has not answered since the job started "
                                    f"({detail}); check the base URL and that the server is up")
            if self.unreachable:
                log.error("%s; stopping", self.unreachable)
        if self.unreachable:
            return ServerUnreachable(self.unreachable)
        return _Retryable("connection", detail)

    def _status_error(self, exc: Exception, params: dict[str, Any]) -> Exception:
        status = exc.status_code
        try:
            text = exc.response.text
        except Exception:  # a body the transport could not decode: what the SDK parsed is all there is
            text = json.dumps(exc.body, default=str) if exc.body is not None else ""
        detail = f"HTTP {status}: {self.redact(' '.join(text.split())[:500]) or '(empty body)'}"
        names = unsupported_params(status, text, list(params))
        if names:
            return _UnsupportedParams(names, detail)
        if status == 429:
            return _Retryable("rate_limited", detail, _retry_after(exc.response.headers))
        self._log_once(logging.WARNING, f"the server answered {detail}")
        if status >= 500 or status in (408, 409):
            return _Retryable("server_error", detail, _retry_after(exc.response.headers))
        self.stats.failures["client_error"] = self.stats.failures.get("client_error", 0) + 1
        return LLMError("client_error", detail)

    async def aclose(self) -> None:
        await self._client.close()
        if self._cache is not None:
            self._cache.close()


def _retry_after(headers: Any) -> float | None:
    """Seconds from `retry-after-ms` or `Retry-After` (delta-seconds; an HTTP date is not worth a parser here)."""
    for name, scale in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        value = headers.get(name) if headers is not None else None
        if value is None:
            continue
        try:
            return max(0.0, float(value) / scale)
        except ValueError:
            continue
    return None


class VLLMBackend:
    """vLLM's offline engine (`vllm.LLM.chat`), batched. Needs the `vllm` extra and a CUDA GPU.

    Concurrent `chat` calls are gathered for `batch_window_s` (or until `max_batch`) and sent as one
    `LLM.chat` batch on a worker thread, so the agent loop's many episodes share the engine's
    continuous batching. Same cache and interface as the HTTP backend.
    """

    def __init__(self, config: LLMConfig, max_batch: int = 256, batch_window_s: float = 0.02, **engine_kw: Any):
        if not vllm_available():
            raise RuntimeError("the vLLM backend needs the `vllm` package and a CUDA GPU")
        import vllm

        self.config = replace(config, model=config.model or os.environ.get(ENV_MODEL))
        self.model = self.config.model
        self.params = self.config.params
        self.stats = CallStats()
        self.unreachable: str | None = None
        self.dropped: list[str] = []
        self._vllm = vllm
        self._engine = vllm.LLM(model=self.model, **engine_kw)
        self._cache = RequestCache(self.config.cache_path) if self.config.cache_path else None
        self._queue: list[tuple[list[dict], dict, asyncio.Future]] = []
        self._max_batch = max_batch
        self._window = batch_window_s
        self._flusher: asyncio.Task | None = None

    async def chat(self, messages: list[dict], sample: int = 0, **overrides: Any) -> ChatResult:
        params = {**self.params, **{k: v for k, v in overrides.items() if v is not None}}
        messages = prepare_messages(self.model, messages)
        key = request_key(self.model, messages, params, sample)
        if self._cache is not None and (body := self._cache.get(key)) is not None:
            self.stats.cache_hits += 1
            return replace(parse_body(body), cached=True, params=params)
        future = asyncio.get_running_loop().create_future()
        self._queue.append((messages, params, future))
        if len(self._queue) >= self._max_batch:
            self._flush_now()
        elif self._flusher is None:
            self._flusher = asyncio.create_task(self._flush_later())
        body = await future
        if self._cache is not None:
            self._cache.put(key, body)
        result = parse_body(body)
        self.stats.add_usage(result.usage)
        return replace(result, params=params)

    def redact(self, text: str | None) -> str | None:
        return redact(text, [self.config.api_key])

    async def _flush_later(self) -> None:
        await asyncio.sleep(self._window)
        self._flusher = None
        self._flush_now()

    def _flush_now(self) -> None:
        batch, self._queue = self._queue, []
        if batch:
            asyncio.create_task(self._run_batch(batch))

    async def _run_batch(self, batch: list[tuple[list[dict], dict, asyncio.Future]]) -> None:
        try:
            bodies = await asyncio.to_thread(self._generate, [(m, p) for m, p, _ in batch])
        except Exception as exc:  # one engine failure fails every request of the batch, with its reason
            for _, _, future in batch:
                future.set_exception(LLMError("engine_error", self.redact(f"{type(exc).__name__}: {exc}"[:300])))
            return
        for (_, _, future), body in zip(batch, bodies):
            future.set_result(body)

    def _generate(self, requests: list[tuple[list[dict], dict]]) -> list[dict]:
        # LLM.chat takes one SamplingParams per conversation, so mixed parameters batch together.
        sampling = [self._vllm.SamplingParams(**_vllm_sampling(p)) for _, p in requests]
        self.stats.calls += 1
        self.stats.attempts += 1
        outputs = self._engine.chat([m for m, _ in requests], sampling, use_tqdm=False)
        bodies = []
        for out in outputs:
            choices = [{"index": i, "finish_reason": o.finish_reason,
                        "message": {"role": "assistant", "content": o.text}} for i, o in enumerate(out.outputs)]
            completion = sum(len(o.token_ids) for o in out.outputs)
            bodies.append({"object": "chat.completion", "model": self.model, "choices": choices,
                           "usage": {"prompt_tokens": len(out.prompt_token_ids or []), "completion_tokens": completion}})
        return bodies

    async def aclose(self) -> None:
        if self._cache is not None:
            self._cache.close()


def _vllm_sampling(params: dict[str, Any]) -> dict[str, Any]:
    allowed = {"temperature", "top_p", "top_k", "min_p", "max_tokens", "stop", "n", "seed", "presence_penalty",
               "frequency_penalty", "repetition_penalty"}
    return {k: v for k, v in params.items() if k in allowed}


def vllm_available() -> bool:
    """True when vLLM is installed and a CUDA device is visible; imports nothing heavy otherwise."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


BACKENDS: Registry[type[ChatBackend]] = Registry("LLM backend", {"openai": OpenAIBackend, "vllm": VLLMBackend})


def make_backend(name: str, config: LLMConfig, **kw: Any) -> ChatBackend:
    return BACKENDS[name](config, **kw)
