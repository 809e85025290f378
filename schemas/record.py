"""The trajectory record (schemas/trajectory.schema.json) as Python types, and its one constructor.

Ingest (`pipeline.ingest.normalize`) and synthesis (`pipeline.synth.agent`) both build records
with `new_record`, so the two cannot disagree on a key; tests/ingest/test_record_types.py holds the
TypedDicts to the JSON Schema's keys and required fields.
"""
# No `from __future__ import annotations`: TypedDict reads NotRequired from evaluated annotations.
import json
from typing import Literal, NotRequired, TypedDict

# What new records carry. Readers also accept the versions in READABLE_VERSIONS: 1.1.0 only added
# optional per-turn fields.
SCHEMA_VERSION = "1.1.0"
READABLE_VERSIONS = ("1.0.0", SCHEMA_VERSION)


class Turn(TypedDict):
    role: Literal["system", "user", "assistant"]
    content: str
    loss: bool
    thought: str | None
    action: str | None
    reasoning: str | None
    dialect: str | None
    # Set by the critical-step annotation (pipeline.quality.critical_steps) only.
    critical: NotRequired[bool | None]
    critical_category: NotRequired[str | None]
    critical_reason: NotRequired[str | None]


class TrajectoryRecord(TypedDict):
    id: str
    schema_version: str
    source: str
    source_id: str
    source_file: str
    license: str
    domain: str
    env: str
    kind: Literal["positive", "negative"]
    negative_type: str | None
    parent_id: str | None
    rendering: Literal["native", "react"]
    loss_flags: Literal["upstream", "inferred"]
    demo_turns: int
    task: str
    answer: str | None
    reward: float | None
    success: bool | None
    conversations: list[Turn]
    meta: str  # JSON text: free-form provenance (source index, generator, sampling, ...)


# The one encoder of `meta` (json.dumps would make one per call).
_META_ENCODER = json.JSONEncoder(sort_keys=True, ensure_ascii=False)


def new_record(*, id: str, source: str, source_id: str, source_file: str, license: str, domain: str, env: str,
               task: str, conversations: list[Turn], meta: dict | str, negative_type: str | None = None,
               rendering: str = "native", loss_flags: str = "inferred", demo_turns: int = 0,
               answer: str | None = None, reward: float | None = None, success: bool | None = None) -> TrajectoryRecord:
    """A record of the current schema version; a record with a `negative_type` is a negative. `meta` is a
    dict, or already its JSON text as `json.dumps(meta, sort_keys=True, ensure_ascii=False)` writes it."""
    return {
        "id": id,
        "schema_version": SCHEMA_VERSION,
        "source": source,
        "source_id": source_id,
        "source_file": source_file,
        "license": license,
        "domain": domain,
        "env": env,
        "kind": "negative" if negative_type else "positive",
        "negative_type": negative_type,
        "parent_id": None,
        "rendering": rendering,
        "loss_flags": loss_flags,
        "demo_turns": demo_turns,
        "task": task,
        "answer": answer,
        "reward": reward,
        "success": success,
        "conversations": conversations,
        "meta": meta if isinstance(meta, str) else _META_ENCODER.encode(meta),
    }
