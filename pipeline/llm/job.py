"""The skeleton every model-calling job shares: synthesis (and its tree search), salvage, select-steps.

A job writes its outputs to a folder and keeps its state in a hidden folder under it (`.synth`,
`.salvage`, `.select`): the request cache (`requests.sqlite`), so that a rerun pays only for calls
never answered, and a journal of finished work (episodes, searches, selections), so that a rerun
does not even replay them. At most `concurrency` units of work run at once. The report of every job
has the same `llm` block: the model, the sampling asked and dropped, and the backend's counts.
"""
from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from trajforge.pipeline.llm.client import JsonStore, LLMConfig, make_backend


@dataclass
class ModelJob:
    state: Path
    backend: Any                 # a ChatBackend whose request cache is in `state` (None: a job of scripted policies)
    journal: JsonStore           # finished work, by key
    gate: asyncio.Semaphore      # the concurrency limit
    stats: Any = None            # the backend's counts when the job closed

    @classmethod
    def open(cls, state: Path, backend: str, llm: LLMConfig | None, journal: str, concurrency: int) -> ModelJob:
        cached = None if llm is None else LLMConfig(**{**asdict(llm), "cache_path": str(state / "requests.sqlite")})
        return cls(state, None if cached is None else make_backend(backend, cached),
                   JsonStore(state / f"{journal}.sqlite", journal), asyncio.Semaphore(concurrency))

    async def close(self) -> None:
        """Keep the backend's counts for the report, then close the backend and the journal."""
        try:
            if self.backend is not None:
                self.stats = self.backend.stats
                await self.backend.aclose()
        finally:
            self.journal.close()

    def llm_report(self) -> dict:
        stats = self.stats or self.backend.stats
        return {"model": self.backend.model, "sampling": self.backend.params, "sampling_dropped": self.backend.dropped,
                "calls": stats.calls, "attempts": stats.attempts, "cache_hits": stats.cache_hits,
                "retries": stats.retries, "failures": stats.failures, "usage": stats.usage}
