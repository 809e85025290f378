"""The same build on every task runner: identical bytes, on a generated corpus of a few thousand
trajectories (bench/bench_build.py's generator: the real fixture rows in their upstream layouts,
varied free text, planted exact and near copies), cut into several shards so that shard bounds fall
inside units. The reference is the build's plain functions in this process, without Prefect."""
from __future__ import annotations

import importlib.util
from dataclasses import replace

import pytest

from bench.bench_build import generate
from trajforge.pipeline.build import BuildConfig, finalize, process_unit
from trajforge.pipeline.publish.manifest import read_manifest
from trajforge.pipeline.publish.shards import ShardConfig
from trajforge.sources import get_source

pytestmark = pytest.mark.slow

TRAJECTORIES = 2000
SHARD_ROWS = 400


def published(out) -> dict[str, bytes]:
    return {rel: (out / rel).read_bytes() for rel in sorted(read_manifest(out)["files"])}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, raw_dir):
    folder = tmp_path_factory.mktemp("generated")
    planted = generate(raw_dir, TRAJECTORIES, folder)
    assert planted["exact"] and planted["near"]
    return {d.name: str(d) for d in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("in_process")
    config = replace(BuildConfig(), shards=ShardConfig(max_rows=SHARD_ROWS))
    units = [process_unit(name, f, out / ".staging", config)
             for name, location in corpus.items() for f in get_source(name).files(location)]
    finalize(units, out, config)
    return out


def _with_extra(runner: str, module: str):
    """A runner that comes with an extra (module): its case skips, saying so, where the extra is absent."""
    missing = importlib.util.find_spec(module) is None
    return pytest.param(runner, marks=pytest.mark.skipif(
        missing, reason=f"the {runner} runner needs the `{runner}` extra"))


@pytest.mark.parametrize("runner", ["processes", "threads", _with_extra("dask", "prefect_dask"),
                                    _with_extra("ray", "prefect_ray")])
def test_runner_builds_the_generated_corpus_byte_identical(runner, corpus, reference, tmp_path, monkeypatch):
    from trajforge.flows.build import build_dataset

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    out = tmp_path / runner
    # Two workers: a 2-core machine, and several units in flight on each cluster.
    report = build_dataset(sources=corpus, out=str(out), runner=runner, workers=2, shard_rows=SHARD_ROWS)
    assert report["total"]["read"] == TRAJECTORIES
    assert report["total"]["duplicates"] > TRAJECTORIES * 0.08
    assert len(report["outputs"]["sft"]) > 2
    assert read_manifest(out) == read_manifest(reference)
    assert published(out) == published(reference)
    # Unit results were persisted by Prefect, from the cluster's workers too.
    assert len(list((out / ".staging" / "results").iterdir())) == len(list(
        (out / ".staging" / "markers" / "units").iterdir()))


def test_a_dask_cluster_at_an_address_builds_byte_identical(corpus, reference, tmp_path):
    # The second half's steps are as many tasks as the cluster's workers (flows/build.py: cluster_workers).
    distributed = pytest.importorskip("distributed")
    pytest.importorskip("prefect_dask")
    from trajforge.flows.build import build_dataset

    out = tmp_path / "dask_at_address"
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                                  dashboard_address=None) as cluster:
        build_dataset(sources=corpus, out=str(out), runner="dask", address=cluster.scheduler_address,
                      shard_rows=SHARD_ROWS)
    assert published(out) == published(reference)
