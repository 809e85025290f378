"""The `processes` runner forks its workers from the fork server (flows/workers.py)."""
from __future__ import annotations

import multiprocessing.forkserver
from concurrent.futures import ProcessPoolExecutor

import pytest

from trajforge.flows.build import ForkedProcessPoolTaskRunner, make_task_runner
from trajforge.flows.workers import fork_server_available, start_fork_server


@pytest.mark.skipif(not fork_server_available(), reason="no fork server on this platform")
def test_processes_runner_and_its_copies_fork_their_workers_from_the_fork_server():
    runner = make_task_runner("processes", workers=2)
    copy = runner.duplicate()  # what a flow run enters (and each task run in a worker)
    assert isinstance(copy, ForkedProcessPoolTaskRunner)
    server = multiprocessing.forkserver._forkserver._forkserver_pid
    with copy as entered:
        assert entered._executor._mp_context.get_start_method() == "forkserver"
        assert entered._executor._max_workers == runner._max_workers
    # Entering starts nothing: only a first submit starts the fork server and its workers.
    assert multiprocessing.forkserver._forkserver._forkserver_pid == server


def _loops_loaded() -> list[int]:
    from trajforge.pipeline.quality import keys_kernel, sketch_screen

    return [len(loop.signatures) for loop in (keys_kernel.tokens, keys_kernel.signatures_and_sketches,
                                              sketch_screen.pairs_within, sketch_screen.pairs_across)]


@pytest.mark.skipif(not fork_server_available(), reason="no fork server on this platform")
def test_a_forked_worker_starts_with_the_compiled_loops_loaded():
    """The fork server loaded the compiled loops (flows/worker_preload.py): a worker has them
    before its first key batch and its first screen."""
    start_fork_server()
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("forkserver")) as pool:
        assert pool.submit(_loops_loaded).result() == [1, 1, 1, 1]


def _collections_loaded() -> bool:
    from prefect._internal.plugins import collections

    return collections._collections is not None


@pytest.mark.skipif(not fork_server_available(), reason="no fork server on this platform")
def test_a_forked_worker_starts_with_prefects_collections_loaded():
    """The fork server loaded Prefect's installed collections (flows/worker_preload.py): a worker's
    first task does not import them (Prefect loads them where a task's context names a block)."""
    start_fork_server()
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("forkserver")) as pool:
        assert pool.submit(_collections_loaded).result()


def _frozen_and_private_growth() -> tuple[int, int]:
    """(objects the worker's collector leaves alone as frozen, bytes of private memory a full collection adds)."""
    import gc

    import psutil

    me = psutil.Process()
    before = me.memory_full_info().uss
    gc.collect()
    return gc.get_freeze_count(), me.memory_full_info().uss - before


@pytest.mark.skipif(not fork_server_available(), reason="no fork server on this platform")
def test_a_forked_worker_leaves_what_the_fork_server_loaded_to_it():
    """The fork server froze what it loaded (flows/worker_preload.py): a worker's full collection
    neither walks those objects nor copies their pages (unfrozen, ~72 MiB a worker)."""
    start_fork_server()
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("forkserver")) as pool:
        frozen, grown = pool.submit(_frozen_and_private_growth).result()
    assert frozen > 100_000
    assert grown < 32 * 2**20
