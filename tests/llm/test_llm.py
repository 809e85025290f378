"""The OpenAI backend against the loopback server: wire format, family defaults, cache, retries, key hygiene."""
from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from tests.support.openai_server import Server, down_url
from trajforge.pipeline.llm.client import (
    LLMConfig,
    LLMError,
    OpenAIBackend,
    ServerUnreachable,
    VLLMBackend,
    family_of,
    parse_body,
    unsupported_params,
    vllm_available,
)

SECRET = "sk-test-0123456789abcdefSECRET"
MESSAGES = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "List /etc."}]


def _config(base_url: str, model="deepseek-ai/DeepSeek-R1", cache=None, **kw) -> LLMConfig:
    return LLMConfig(model=model, base_url=base_url, api_key=SECRET, cache_path=cache, backoff_base_s=0.01, **kw)


def _chat(server: Server, messages=MESSAGES, cache=None, model="deepseek-ai/DeepSeek-R1", sample=0, **kw):
    config_kw = {k: kw.pop(k) for k in list(kw) if k in LLMConfig.__dataclass_fields__}
    config = _config(server.base_url, model, cache, **config_kw)

    async def go():
        backend = OpenAIBackend(config)
        try:
            return await backend.chat(messages, sample=sample, **kw), backend.stats
        finally:
            await backend.aclose()
    return asyncio.run(go())


def _chats(config: LLMConfig, count: int) -> tuple[list, OpenAIBackend]:
    """`count` concurrent chats (different samples); each outcome is a ChatResult or the exception."""
    async def go():
        backend = OpenAIBackend(config)
        try:
            outcomes = await asyncio.gather(*(backend.chat(MESSAGES, sample=k) for k in range(count)),
                                            return_exceptions=True)
            return outcomes, backend
        finally:
            await backend.aclose()
    return asyncio.run(go())


def test_r1_defaults_no_system_prompt_and_reasoning_content():
    with Server(shapes=("reasoning_content",)) as server:
        result, stats = _chat(server)
    sent = server.requests[0]
    assert (sent["temperature"], sent["top_p"]) == (0.6, 0.95) and "top_k" not in sent
    assert [m["role"] for m in sent["messages"]] == ["user"]
    assert sent["messages"][0]["content"] == "You are an agent.\n\nList /etc."
    choice = result.choices[0]
    assert choice.reasoning_content and choice.content.startswith("Think:") and choice.finish_reason == "stop"
    assert stats.calls == 1 and not result.cached


def test_qwq_defaults_top_k_in_body_and_overrides_and_passthrough():
    with Server() as server:
        _chat(server, model="Qwen/QwQ-32B")
        result, _ = _chat(server, model="Qwen/QwQ-32B", sampling={"temperature": 0.2, "top_k": None},
                          max_tokens=512, stop=["Observation:"], n=2, seed=7)
    qwq, overridden = server.requests
    assert (qwq["temperature"], qwq["top_p"], qwq["top_k"]) == (0.6, 0.95, 40)
    assert [m["role"] for m in qwq["messages"]] == ["system", "user"]  # QwQ keeps its system prompt
    assert overridden["temperature"] == 0.2 and "top_k" not in overridden
    assert (overridden["max_tokens"], overridden["stop"], overridden["n"], overridden["seed"]) == (512, ["Observation:"], 2, 7)
    assert len(result.choices) == 2


def test_family_names_as_servers_spell_them():
    assert family_of("deepseek-ai/DeepSeek-R1-Distill-Qwen-7B").name == "deepseek-r1"
    assert family_of("deepseek-reasoner").name == "deepseek-r1"
    assert family_of("qwq-32b-q4_k_m").name == "qwq"
    assert family_of("gpt-4o-mini").name == "default"


def test_cache_makes_a_rerun_free_and_tells_samples_apart(tmp_path):
    cache = str(tmp_path / "cache.sqlite")
    with Server() as server:
        first, _ = _chat(server, cache=cache)
        again, stats = _chat(server, cache=cache)  # a new client, as after a crash
        assert server.calls == 1 and again.cached and stats.calls == 0 and stats.cache_hits == 1
        assert again.choices == first.choices
        _chat(server, cache=cache, sample=1)
        _chat(server, cache=cache, temperature=0.9)
        assert server.calls == 3


@pytest.mark.parametrize("kind,reason", [("500", "server_error"), ("reset", "connection"),
                                         ("malformed", "malformed_response"), ("429", "rate_limited")])
def test_transient_faults_are_retried_until_success(kind, reason):
    with Server(fault=lambda n, body: kind if n <= 2 else None, retry_after="0.3") as server:
        started = time.monotonic()
        result, stats = _chat(server)
        elapsed = time.monotonic() - started
    assert result.choices[0].content and server.calls == 3 and stats.retries == 2
    if kind == "429":
        assert elapsed >= 0.6  # two Retry-After waits were honoured


def test_timeout_is_retried():
    with Server(fault=lambda n, body: "slow" if n == 1 else None, slow_s=3) as server:
        result, stats = _chat(server, timeout_s=0.5)
    assert stats.retries == 1 and result.choices[0].content


def test_persistent_fault_gives_an_error_with_its_reason():
    with Server(fault=lambda n, body: "500") as server:
        with pytest.raises(LLMError) as info:
            _chat(server, max_retries=2)
    assert info.value.reason == "server_error" and server.calls == 3


def test_client_errors_are_not_retried():
    with Server() as server:
        with pytest.raises(LLMError) as info:
            _chat(server, messages=[{"role": "robot", "content": "hi"}])
    assert info.value.reason == "client_error" and server.calls == 1


def test_truncation_and_empty_answers_are_explicit():
    with Server(fault=lambda n, body: {1: "truncate", 2: "empty"}.get(n)) as server:
        truncated, _ = _chat(server)
        empty, _ = _chat(server)
        limited, _ = _chat(server, max_tokens=5)
    assert truncated.choices[0].truncated and not truncated.choices[0].empty
    assert empty.choices[0].empty and not empty.choices[0].truncated
    assert limited.choices[0].truncated


def test_api_key_is_sent_but_never_logged_or_cached(tmp_path, caplog):
    cache = tmp_path / "cache.sqlite"
    caplog.set_level(logging.DEBUG)
    with Server(fault=lambda n, body: "500" if n == 1 else None) as server:
        _chat(server, cache=str(cache))
    assert f"Bearer {SECRET}" in server.authorizations
    assert SECRET not in caplog.text and "retrying" in caplog.text
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes()
    assert SECRET not in repr(LLMConfig(model="m", api_key=SECRET))


def test_vllm_backend_refuses_cleanly_without_cuda():
    if vllm_available():
        pytest.skip("vLLM and CUDA are present: the offline backend is exercised on GPU machines")
    with pytest.raises(RuntimeError, match="vLLM backend needs"):
        VLLMBackend(LLMConfig(model="Qwen/QwQ-32B"))


def test_a_refused_connection_is_a_connection_failure_not_a_timeout():
    """The SDK's aiohttp transport raises APITimeoutError for a refused connection; the cause says otherwise."""
    started = time.monotonic()
    [outcome], backend = _chats(_config(down_url(), max_retries=2, max_connection_failures=0), 1)
    assert isinstance(outcome, LLMError) and not isinstance(outcome, ServerUnreachable)
    assert outcome.reason == "connection" and "ConnectionRefusedError" in outcome.detail
    assert backend.stats.calls == 0 and backend.stats.attempts == 3
    assert time.monotonic() - started < backend.config.timeout_s  # refused at once, not timed out


def test_the_circuit_breaker_stops_every_call_after_n_connection_failures_in_a_row():
    """A server that answered and then went away: the job stops after n failures in a row."""
    server = Server().__enter__()

    async def go():
        backend = OpenAIBackend(_config(server.base_url, max_retries=8, max_connection_failures=4))
        try:
            await backend.chat(MESSAGES)  # answered: the server was up
            server.__exit__(None, None, None)  # and now nothing listens there
            outcomes = await asyncio.gather(*(backend.chat(MESSAGES, sample=k) for k in range(1, 13)),
                                            return_exceptions=True)
            return outcomes, backend
        finally:
            await backend.aclose()
    outcomes, backend = asyncio.run(go())
    assert all(isinstance(o, ServerUnreachable) for o in outcomes), outcomes
    assert "4 requests in a row could not connect" in outcomes[0].detail
    # The calls already in flight when it tripped end too; no call is retried after that.
    assert backend.stats.calls == 1 and 1 + 4 <= backend.stats.attempts <= 1 + 12 and backend.unreachable


def test_a_server_that_never_answered_and_refuses_stops_the_job_at_the_first_refusal():
    """A mistyped port with one request in flight: no backoff retries (8 of them took minutes)."""
    started = time.monotonic()
    config = replace(_config(down_url(), max_retries=8, concurrency=1), backoff_base_s=5.0)
    [outcome], backend = _chats(config, 1)
    assert isinstance(outcome, ServerUnreachable) and "ConnectionRefusedError" in outcome.detail
    assert "refused the connection and has not answered since the job started" in outcome.detail
    assert backend.stats.attempts == 1 and backend.stats.retries == 0
    assert time.monotonic() - started < 5.0  # one backoff step alone would be up to 5 s


def test_answered_requests_reset_the_breaker_and_count_as_calls():
    # Every other request is reset before any byte: 20 connection failures, never 2 in a row.
    with Server(fault=lambda n, body: "reset" if n % 2 else None) as server:
        outcomes, backend = _chats(_config(server.base_url, max_connection_failures=2, concurrency=1), 20)
    assert not any(isinstance(o, Exception) for o in outcomes)
    assert backend.stats.calls == 20 and backend.stats.attempts == 40 == server.calls


def test_a_server_killed_mid_request_is_a_connection_failure():
    server = subprocess.Popen([sys.executable, "-m", "tests.support.openai_server", "--latency", "30"], stdout=subprocess.PIPE,
                              text=True, cwd=Path(__file__).parents[2], env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        base_url = server.stdout.readline().strip()

        async def go():
            backend = OpenAIBackend(_config(base_url, max_retries=0, timeout_s=60))
            try:
                call = asyncio.create_task(backend.chat(MESSAGES))
                await asyncio.sleep(1.0)  # the request is in the server's hands
                server.kill()
                with pytest.raises(LLMError) as info:
                    await call
                return info.value
            finally:
                await backend.aclose()
        error = asyncio.run(go())
    finally:
        server.kill()
        server.wait()
    assert error.reason == "connection", error


@pytest.mark.parametrize("kind,status,reason", [("401", 401, "client_error"), ("500", 500, "server_error")])
def test_error_bodies_are_kept_redacted_and_logged_once(kind, status, reason, caplog):
    caplog.set_level(logging.DEBUG)
    with Server(fault=lambda n, body: kind, echo_request=True) as server:
        for _ in range(2):
            with pytest.raises(LLMError) as info:
                _chat(server, max_retries=2)
    assert f"Bearer {SECRET}" in server.authorizations
    error = info.value
    assert error.reason == reason and f"HTTP {status}" in error.detail and "[REDACTED]" in error.detail
    assert ("Incorrect API key" if kind == "401" else "Internal server error") in error.detail
    assert SECRET not in error.detail and SECRET not in caplog.text
    bodies = [r for r in caplog.records if "the server answered" in r.getMessage()]
    assert len(bodies) == 2  # once per backend (each _chat is a new one), not once per attempt


def test_a_strict_server_s_unknown_fields_are_dropped_once_and_remembered(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    cache = str(tmp_path / "cache.sqlite")
    with Server(strict=True) as server:
        result, _ = _chat(server, model="Qwen/QwQ-32B", cache=cache, sampling={"min_p": 0.05})
        assert server.faults == {"422": 1} and server.calls == 2
        assert result.params == {"temperature": 0.6, "top_p": 0.95}
        assert "top_k" not in server.requests[-1] and "min_p" not in server.requests[-1]
        # A new client on the same cache (a rerun) does not ask with them again.
        _chat(server, model="Qwen/QwQ-32B", cache=cache, sampling={"min_p": 0.05}, sample=1)
        assert server.faults == {"422": 1} and server.calls == 3
    warnings = [r.getMessage() for r in caplog.records if "rejects" in r.getMessage()]
    assert len(warnings) == 1 and "min_p, top_k" in warnings[0] and "Unexpected fields" in warnings[0]


def test_unsupported_fields_are_named_only_when_the_server_says_so():
    sent = ["temperature", "top_p", "top_k", "max_tokens"]
    assert unsupported_params(422, "Unexpected fields in the request: {'top_k'}", sent) == ["top_k"]
    assert unsupported_params(400, "Unrecognized request argument supplied: top_k", sent) == ["top_k"]
    assert unsupported_params(422, '{"detail":[{"type":"extra_forbidden","loc":["body","top_k"]}]}', sent) == ["top_k"]
    # Naming a field is not rejecting it; nor is a server error.
    assert unsupported_params(400, "max_tokens must be at most 4096", sent) == []
    assert unsupported_params(500, "unexpected error in top_k sampling", sent) == []


def test_usage_keeps_reasoning_tokens_and_stats_sum_what_was_paid():
    body = {"choices": [{"index": 0, "message": {"content": "x"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 7, "total_tokens": 17,
                      "completion_tokens_details": {"reasoning_tokens": 5}}}
    assert parse_body(body).usage == {"prompt_tokens": 10, "completion_tokens": 7, "total_tokens": 17,
                                      "reasoning_tokens": 5}
    with Server() as server:
        outcomes, backend = _chats(_config(server.base_url), 3)
    assert backend.stats.usage["prompt_tokens"] == sum(o.usage["prompt_tokens"] for o in outcomes) > 0
