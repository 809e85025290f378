"""The OpenAI backend against the loopback server: wire format, family defaults, cache, retries, key hygiene."""
from __future__ import annotations

import asyncio
import logging
import time

import pytest

from trajforge.pipeline.synth.llm import LLMConfig, LLMError, OpenAIBackend, VLLMBackend, family_of, vllm_available
from tests.openai_server import Server

SECRET = "sk-test-0123456789abcdefSECRET"
MESSAGES = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "List /etc."}]


def _chat(server: Server, messages=MESSAGES, cache=None, model="deepseek-ai/DeepSeek-R1", sample=0, **kw):
    config_kw = {k: kw.pop(k) for k in list(kw) if k in LLMConfig.__dataclass_fields__}
    config = LLMConfig(model=model, base_url=server.base_url, api_key=SECRET, cache_path=cache,
                       backoff_base_s=0.01, **config_kw)

    async def go():
        backend = OpenAIBackend(config)
        try:
            return await backend.chat(messages, sample=sample, **kw), backend.stats
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
