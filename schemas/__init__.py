"""The JSON Schema files are the single source of truth for every record kind.

The Arrow schema used for Parquet is derived from them here, so the two cannot drift.
"""
from __future__ import annotations

import copy
import functools
import json
from pathlib import Path

import fastjsonschema
import pyarrow as pa
from jsonschema import Draft202012Validator

SCHEMA_DIR = Path(__file__).parent


@functools.cache
def load_schema(name: str) -> dict:
    """Load `schemas/<name>.schema.json`."""
    path = SCHEMA_DIR / f"{name}.schema.json"
    if not path.exists():
        raise KeyError(f"no schema named {name!r} in {SCHEMA_DIR}")
    schema = json.loads(path.read_text())
    Draft202012Validator.check_schema(schema)
    return schema


@functools.cache
def validator(name: str) -> Draft202012Validator:
    return Draft202012Validator(load_schema(name))


@functools.cache
def _compiled(name: str):
    return fastjsonschema.compile(load_schema(name))


@functools.cache
def _compiled_outline(name: str):
    """Schema `name`'s compiled check less its arrays' item schemas (their own length bounds stay)."""
    schema = copy.deepcopy(load_schema(name))
    for node in schema["properties"].values():
        node.pop("items", None)
    return fastjsonschema.compile(schema)


def first_error(name: str, record: dict, items_built: bool = False) -> str | None:
    """None when `record` is valid against schema `name`, else the first error as "path: message".

    fastjsonschema (compiled to Python) decides, ~20x faster than jsonschema's interpreter on
    our records, which is most of the ingest time; jsonschema, the reference implementation,
    explains a failure. `items_built`: the caller built each item of the record's arrays to its
    item schema (normalize's turns), so only the rest is checked; a failure is explained in full.
    """
    try:
        (_compiled_outline(name) if items_built else _compiled(name))(record)
        return None
    except fastjsonschema.JsonSchemaValueException:
        errors = sorted(validator(name).iter_errors(record), key=lambda e: list(e.absolute_path))
        if not errors:
            return "<record>: rejected by the compiled validator only"
        path = "/".join(str(p) for p in errors[0].absolute_path)
        return f"{path or '<record>'}: {errors[0].message}"


def _arrow_type(node: dict) -> pa.DataType:
    types = node.get("type")
    if isinstance(types, list):
        non_null = [t for t in types if t != "null"]
        if len(non_null) != 1:
            raise ValueError(f"cannot map union type {types} to Arrow")
        types = non_null[0]
    if types == "string":
        return pa.string()
    if types == "integer":
        return pa.int64()
    if types == "number":
        return pa.float64()
    if types == "boolean":
        return pa.bool_()
    if types == "array":
        return pa.list_(_arrow_type(node["items"]))
    if types == "object":
        props = node.get("properties")
        if not props:
            raise ValueError("free-form objects have no Arrow type; store them as JSON text")
        return pa.struct([_arrow_field(k, v, k in node.get("required", [])) for k, v in props.items()])
    raise ValueError(f"unsupported JSON Schema node {node}")


def _arrow_field(name: str, node: dict, required: bool) -> pa.Field:
    types = node.get("type")
    nullable = (not required) or (isinstance(types, list) and "null" in types)
    return pa.field(name, _arrow_type(node), nullable=nullable)


@functools.cache
def arrow_schema(name: str) -> pa.Schema:
    """Arrow schema derived from a JSON Schema, field order as declared."""
    schema = load_schema(name)
    required = set(schema.get("required", []))
    return pa.schema([_arrow_field(k, v, k in required) for k, v in schema["properties"].items()],
                     metadata={"json_schema": name, "json_schema_version": schema.get("version", "")})
