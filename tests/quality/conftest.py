"""Fixtures of the dedup tests."""
from __future__ import annotations

from collections import Counter

import pyarrow as pa
import pytest

from tests.support.paths import FIXTURE_SOURCES
from trajforge.pipeline.build import BuildConfig, process_unit
from trajforge.sources import get_source


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    """Every valid fixture record before dedup, a repeated id suffixed `~n` in build order (the
    build suffixes after dedup; the in-memory dedup only needs the ids unique)."""
    staging = tmp_path_factory.mktemp("staging")
    units = [process_unit(name, f, staging, BuildConfig())
             for name, location in FIXTURE_SOURCES.items() for f in get_source(name).files(location)]
    seen: Counter[str] = Counter()
    records = []
    for record in (r for u in units for r in pa.ipc.open_file(u.records_path).read_all().to_pylist()):
        seen[record["id"]] += 1
        records.append({**record, "id": f"{record['id']}~{seen[record['id']]}"} if seen[record["id"]] > 1 else record)
    return records
