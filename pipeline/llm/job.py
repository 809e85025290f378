"""The skeleton every model-calling job shares: synthesis (and its tree search), salvage, select-steps, the
score judge.

A job writes its outputs to a folder and keeps its state in a hidden folder under it (`.synth`,
`.salvage`, `.select`, `.score`): the request cache (`requests.sqlite`), so that a rerun pays only for
calls never answered, and a journal of finished work (episodes, searches, selections, ratings), so that
a rerun does not even replay them. At most `concurrency` units of work run at once. The report of every
job has the same `llm` block: the model, the sampling asked and dropped, and the backend's counts.
Units that finish (run, resumed or skipped) are counted and reported to an optional progress callback;
a job that stops when its server cannot be reached raises ServerUnreachable before writing outputs.
"""
from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from trajforge.pipeline.llm.client import JsonStore, LLMConfig, ServerUnreachable, make_backend

log = logging.getLogger("trajforge.job")

Result = TypeVar("Result")


@dataclass
class ModelJob:
    state: Path
    backend: Any                 # a ChatBackend whose request cache is in `state` (None: a job of scripted policies)
    journal: Any                 # finished work by key: a JsonStore, or a typed view of one (get, put, close)
    gate: asyncio.Semaphore      # the concurrency limit
    stats: Any = None            # the backend's counts when the job closed
    unit: str = "units"          # what the job's units of work are called (the journal's name)
    progress: Callable[[int, int], None] | None = None   # called with (finished, total) as units finish
    total: int = 0
    counts: Counter[str] = field(default_factory=Counter)  # units run, resumed, skipped, finished; a job adds its own

    @classmethod
    def open(cls, state: Path, backend: str, llm: LLMConfig | None, journal: str, concurrency: int,
             progress: Callable[[int, int], None] | None = None, total: int = 0) -> ModelJob:
        cached = None if llm is None else LLMConfig(**{**asdict(llm), "cache_path": str(state / "requests.sqlite")})
        return cls(state, None if cached is None else make_backend(backend, cached),
                   JsonStore(state / f"{journal}.sqlite", journal), asyncio.Semaphore(concurrency), unit=journal,
                   progress=progress, total=total)

    async def journaled(self, key: str, work: Callable[[], Awaitable[Result]], keep: Callable[[Result], bool],
                        stopped: Callable[[], Result] | None = None) -> Result:
        """The unit of work `key`: the journal's answer when an earlier run finished it, else `work()` run
        within the concurrency limit and journaled when `keep` says the answer is final (a transient failure
        is not: the next run tries again). `stopped`, for a job that stops when the server cannot be reached:
        what stands for a unit whose turn comes after that; it is neither run nor finished."""
        done = self.journal.get(key)
        if done is not None:
            self.counts["resumed"] += 1
            return self.finished(done)
        async with self.gate:
            if stopped is not None and self.backend.unreachable:
                return stopped()
            result = await work()
        self.counts["run"] += 1
        if self.counts["run"] % 50 == 0:
            log.info("%d %s run", self.counts["run"], self.unit)
        if keep(result):
            self.journal.put(key, result)
        return self.finished(result)

    def skipped(self, result: Result) -> Result:
        """Count a unit that had nothing to run (its task says why) as finished."""
        self.counts["skipped"] += 1
        return self.finished(result)

    def finished(self, result: Result) -> Result:
        """Count a finished unit (run, resumed or skipped) and report the progress."""
        self.counts["finished"] += 1
        if self.progress is not None:
            self.progress(self.counts["finished"], self.total)
        return result

    def stop_if_unreachable(self, journaled: int, total: int) -> None:
        """Raise ServerUnreachable when the server went away during the job: no output is written then."""
        if self.backend is not None and self.backend.unreachable:
            raise ServerUnreachable(
                f"{self.backend.unreachable}. Stopped: {journaled} of {total} {self.unit} finished and are journaled; "
                f"no outputs were written. Rerun the same command once the server answers to resume.")

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
