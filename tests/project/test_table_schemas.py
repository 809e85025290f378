"""Every Parquet table gets its Arrow schema from a JSON Schema in schemas/ (`schemas.arrow_schema`).

The job tables (synthesis failures, salvage outcomes, selection failures, evaluation episodes and
results) were once declared inline with `pa.schema`; the layouts below are those declarations, kept
as the oracle: the derived schema must give the same columns, types and nullability, so files read
by earlier code (a results table appended to across versions, a failures file fed to salvage) keep
their layout. The one difference is the schema's own metadata, which names its JSON Schema as every
other output's does."""
from __future__ import annotations

import ast

import pyarrow as pa
import pytest

from tests.support.paths import REPO
from trajforge.pipeline.synth.folder import USAGE_KEYS
from trajforge.schemas import arrow_schema, load_schema

PRODUCTION = ("pipeline", "flows", "sources", "training")

INLINE_LAYOUTS = {
    "select_failures": [("id", pa.string()), ("env", pa.string()), ("source_file", pa.string()),
                        ("reason", pa.string()), ("detail", pa.string())],
    "synth_failures": [
        ("id", pa.string()), ("task_id", pa.string()), ("sample", pa.int64()), ("env", pa.string()),
        ("reason", pa.string()), ("detail", pa.string()), ("reward", pa.float64()), ("answer", pa.string()),
        ("model", pa.string()), ("conversations", pa.string()), ("steps", pa.string()),
        ("usage", pa.struct([(k, pa.int64()) for k in
                             ("prompt_tokens", "completion_tokens", "reasoning_tokens", "total_tokens")])),
        ("rejected", pa.string()),
    ],
    "eval_episodes": [
        ("policy", pa.string()), ("env", pa.string()), ("task_id", pa.string()), ("sample", pa.int64()),
        ("outcome", pa.string()), ("reason", pa.string()), ("detail", pa.string()), ("score", pa.float64()),
        ("turns", pa.int64()), ("refused_actions", pa.int64()), ("total_tokens", pa.int64()),
    ],
    "eval_results": [
        ("run", pa.string()), ("finished", pa.string()), ("model", pa.string()), ("label", pa.string()),
        ("policy", pa.string()), ("env", pa.string()), ("split", pa.string()), ("split_fingerprint", pa.string()),
        ("tasks", pa.int64()), ("episodes", pa.int64()), ("samples_per_task", pa.int64()),
        ("success_rate", pa.float64()), ("success_ci_low", pa.float64()), ("success_ci_high", pa.float64()),
        ("mean_score", pa.float64()), ("score_ci_low", pa.float64()), ("score_ci_high", pa.float64()),
        ("pass_at_1", pa.float64()), ("pass_at_n", pa.float64()), ("mean_turns", pa.float64()),
        ("mean_tokens", pa.float64()), ("outcomes", pa.string()), ("oracle_success", pa.float64()),
        ("random_success", pa.float64()), ("training_overlap", pa.int64()), ("eval_dir", pa.string()),
    ],
    "salvage_outcomes": [
        ("id", pa.string()), ("task_id", pa.string()), ("env", pa.string()), ("failure_reason", pa.string()),
        ("outcome", pa.string()), ("detail", pa.string()), ("steps", pa.int64()), ("prefixes_tried", pa.int64()),
        ("prefix_steps", pa.int64()), ("record_id", pa.string()), ("dropped_steps", pa.int64()),
        ("replay_mismatch", pa.string()),
    ],
}


@pytest.mark.parametrize("name", sorted(INLINE_LAYOUTS))
def test_derived_schema_keeps_the_inline_layout(name):
    derived, inline = arrow_schema(name), pa.schema(INLINE_LAYOUTS[name])
    assert derived.names == inline.names
    for got, want in zip(derived, inline, strict=True):
        # Field equality covers type, nullability (nested struct fields too) and field metadata.
        assert got.equals(want, check_metadata=True), (name, got, want)
    assert derived.metadata == {b"json_schema": name.encode(),
                                b"json_schema_version": load_schema(name)["version"].encode()}


def test_usage_struct_holds_the_counted_token_kinds():
    # usage_totals fills the struct by USAGE_KEYS; a key the schema lacks would be dropped on write.
    usage = load_schema("synth_failures")["properties"]["usage"]["properties"]
    assert tuple(usage) == USAGE_KEYS


def _inline_arrow_schemas(path) -> list[int]:
    """Lines of `pa.schema(...)` / `pyarrow.schema(...)` calls in a module."""
    tree = ast.parse(path.read_text(), str(path))
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "schema"
            and isinstance(node.func.value, ast.Name) and node.func.value.id in ("pa", "pyarrow")]


def test_no_production_module_declares_an_arrow_schema_inline():
    inline = {str(path.relative_to(REPO)): lines for package in PRODUCTION
              for path in sorted((REPO / package).rglob("*.py")) if (lines := _inline_arrow_schemas(path))}
    assert inline == {}, "declare the table in schemas/<name>.schema.json and use schemas.arrow_schema(name)"
