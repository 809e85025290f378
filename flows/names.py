"""Readable flow run names (`build agentinstruct+synthetic 2026-12-01 04:00`) instead of Prefect's random pairs."""
from __future__ import annotations

from prefect.runtime import flow_run

from trajforge.sources import DEFAULT_SOURCES


def source_set(sources: dict | None, synthetic: str | None) -> str:
    names = list(sources or DEFAULT_SOURCES)
    if synthetic and "synthetic" not in names:
        names.append("synthetic")
    return "+".join(names)


def _when() -> str:
    return flow_run.scheduled_start_time.strftime("%Y-%m-%d %H:%M")


def build_run_name() -> str:
    params = flow_run.parameters
    sources = params.get("sources") or (params.get("config") or {}).get("sources")
    return f"build {source_set(sources, params.get('synthetic'))} {_when()}"


def synth_run_name() -> str:
    params = flow_run.parameters
    config = params.get("config") or {}
    env = params.get("env") or config.get("env")
    model = params.get("model") or (config.get("llm") or {}).get("model") or ""
    return f"synth {env} {model.rsplit('/', 1)[-1]} {_when()}"


def release_run_name() -> str:
    params = flow_run.parameters
    tag = f" {params['tag']}" if params.get("tag") else ""
    return f"release {params.get('repo')}{tag} {_when()}"
