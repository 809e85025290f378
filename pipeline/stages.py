"""The stage protocol: a stage keeps some records and says why it dropped each of the others.

A build is a short sequence of named stages. The map stages (read, normalize, validate) see one
record at a time, inside a unit; the global stages (decontaminate, exact and near dedup) see the
key tables of every unit. Either kind reports a `StageTally`: how many records came in, how many
it kept, and the dropped ones by reason. The build's counts, its quarantine rows and the report's
`stages` section are made from those tallies and the dropped rows, never rebuilt afterwards.
"""
from __future__ import annotations

import ctypes
import gc
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import pyarrow as pa


@dataclass(frozen=True)
class Dropped:
    """Why a stage did not keep a record: a reason code (the quarantine's, or `duplicate`) and a detail."""
    reason: str
    detail: str = ""
    source_id: str | None = None


@dataclass
class StageTally:
    """One stage's counts: records in, kept, and dropped by reason (in + nothing else = kept + dropped)."""
    stage: str
    seen: int = 0
    kept: int = 0
    dropped: Counter = field(default_factory=Counter)

    def keep(self, n: int = 1) -> None:
        self.seen += n
        self.kept += n

    def drop(self, reason: str, n: int = 1) -> None:
        self.seen += n
        self.dropped[reason] += n

    def add(self, other: StageTally) -> None:
        self.seen += other.seen
        self.kept += other.kept
        self.dropped.update(other.dropped)

    def as_dict(self) -> dict:
        return {"stage": self.stage, "in": self.seen, "kept": self.kept,
                "dropped": dict(sorted(self.dropped.items()))}

    @classmethod
    def from_dict(cls, entry: dict) -> StageTally:
        return cls(entry["stage"], entry["in"], entry["kept"], Counter(entry["dropped"]))

    @classmethod
    def of(cls, stage: str, seen: int, dropped: dict[str, int]) -> StageTally:
        """A global stage's tally: `seen` records in, `dropped` by reason, the rest kept."""
        dropped = Counter({reason: n for reason, n in dropped.items() if n})
        return cls(stage, seen, seen - sum(dropped.values()), dropped)


def merge_tallies(tallies: list[list[StageTally]]) -> list[StageTally]:
    """Tallies of the same stages (as several units report them) added up, in stage order."""
    merged: dict[str, StageTally] = {}
    for sequence in tallies:
        for tally in sequence:
            merged.setdefault(tally.stage, StageTally(tally.stage)).add(tally)
    return list(merged.values())


def in_order(function, calls: list[tuple], sizes: list[int] | None = None, meanwhile=None) -> list:
    """A build's `map_units` in this process: each call in turn, then `meanwhile()`; results in call
    order. A flow passes its task runner's instead (flows/build.py), which returns the same results:
    `sizes` (each call's expected work, in any one unit) lets it balance its tasks, and it runs
    `meanwhile` in the flow while its workers make the calls."""
    results = [function(*args) for args in calls]
    if meanwhile is not None:
        meanwhile()
    return results


@contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside. A unit's loops (the map's stages, the writers' row makers)
    make many short-lived dicts and lists and next to no cycles, and each collection they would set
    off walks every tracked object of the process: ~0.05 ms of CPU a record at 20k."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


# glibc's malloc_trim, or None (another C library).
_MALLOC_TRIM = getattr(ctypes.CDLL(None), "malloc_trim", None)


def release_freed_memory() -> None:
    """Hand the pages the allocators hold free back to the system: Arrow's pool keeps what it freed
    until it allocates again, and glibc's malloc the free pages of its heaps (Python's large strings
    and lists are malloc's). A process that runs one step after another (a worker's units and then
    the second half's steps, the flow once its workers run) otherwise carries the largest step's
    pages into the next: a worker kept ~80-110 MB of a 50k-row unit's once it was done, and at 1M
    the near stage's reads of the sketches left ~120 MB in the flow through the unit writers and the
    shards. The pages handed back are faulted in again when the process grows again: call it between
    steps, not between the calls of one."""
    pa.default_memory_pool().release_unused()
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
