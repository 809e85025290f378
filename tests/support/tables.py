"""Reading a Parquet table a job wrote, checked against the JSON Schema it is declared by."""
from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq

from trajforge.schemas import arrow_schema, validator


def declared_rows(path: Path, schema: str) -> list[dict]:
    """The rows of `path`; the file carries the Arrow schema derived from `schemas/<schema>.schema.json`
    (its metadata too) and every row is valid against the JSON Schema."""
    table = pq.read_table(path)
    assert table.schema.equals(arrow_schema(schema), check_metadata=True), (path, table.schema)
    rows = table.to_pylist()
    for row in rows:
        validator(schema).validate(row)
    return rows
