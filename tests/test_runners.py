"""The same build flow on threads, a local Dask cluster and a local Ray cluster: identical bytes."""
from __future__ import annotations

import pytest

from conftest import FIXTURE_SOURCES
from trajforge.pipeline.publish.manifest import read_manifest

pytestmark = pytest.mark.slow


def published(out) -> dict[str, bytes]:
    return {rel: (out / rel).read_bytes() for rel in sorted(read_manifest(out)["files"])}


@pytest.mark.parametrize("runner", ["threads", "dask", "ray"])
def test_runner_builds_the_fixtures_byte_identical(runner, fixtures_build, tmp_path, monkeypatch):
    from trajforge.flows.build import build_dataset

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    out = tmp_path / runner
    # Two workers: a 2-core machine, and several units in flight on each cluster.
    report = build_dataset(sources=FIXTURE_SOURCES, out=str(out), runner=runner, workers=2)
    assert report["total"]["read"] > 150
    assert read_manifest(out) == read_manifest(fixtures_build)
    assert published(out) == published(fixtures_build)
    # Unit results were persisted by Prefect, from the cluster's workers too.
    assert len(list((out / ".staging" / "results").iterdir())) == len(list(
        (out / ".staging" / "markers" / "units").iterdir()))
