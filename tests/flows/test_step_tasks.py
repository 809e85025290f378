"""How the build flow's tasks share the calls of a second-half step (flows/build.py: `unit_step`):
each task reads the whole call list, largest first, and claims the calls one at a time."""
from __future__ import annotations

import threading
import time

import pytest

from trajforge.flows.build import StepCallsLost, _in_call_order, _step_file, claim, largest_first, unit_step


def test_the_largest_calls_go_first_and_ties_keep_their_order():
    assert largest_first([3, 9, 1, 7, 2, 8, 5]) == [1, 5, 3, 6, 0, 4, 2]
    assert largest_first([1] * 4) == [0, 1, 2, 3]
    assert largest_first([]) == []


def test_a_call_is_claimed_once(tmp_path):
    assert claim(str(tmp_path), 3)
    assert not claim(str(tmp_path), 3)
    assert claim(str(tmp_path), 4)


def _slow_square(x: int, seconds: float) -> int:
    time.sleep(seconds)
    return x * x


def test_tasks_that_share_a_step_run_each_call_once_and_the_idle_one_takes_the_next(tmp_path):
    # One long call and many short ones: the task that drew the long call takes no other.
    sizes = [1] * 12 + [50]
    calls = [(i, 0.5 if sizes[i] == 50 else 0.01) for i in range(len(sizes))]
    calls_file, claims = _step_file(tmp_path / "step", largest_first(sizes), calls)
    returned: list = [None, None]

    def task(t: int) -> None:
        returned[t] = unit_step.fn(_slow_square, calls_file, claims)

    threads = [threading.Thread(target=task, args=(t,)) for t in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    done = [pairs for pairs, _ in returned]
    assert _in_call_order("square", len(calls), done) == [i * i for i in range(len(calls))]
    long_task = next(pairs for pairs in done if any(i == 12 for i, _ in pairs))
    assert [i for i, _ in long_task] == [12]


def test_a_call_that_ran_twice_or_not_at_all_stops_the_step():
    with pytest.raises(StepCallsLost, match=r"1 of 3 calls did not run exactly once \(calls \[1\]"):
        _in_call_order("write-unit", 3, [[(0, "a")], [(2, "c")]])
    with pytest.raises(StepCallsLost, match=r"calls \[0\]: ran \[2\] times"):
        _in_call_order("write-unit", 2, [[(0, "a"), (1, "b")], [(0, "a")]])
    assert _in_call_order("write-unit", 2, [[(1, "b")], [(0, "a")]]) == ["a", "b"]


@pytest.mark.slow
def test_a_dask_cluster_at_an_address_says_how_many_tasks_a_step_has():
    distributed = pytest.importorskip("distributed")
    prefect_dask = pytest.importorskip("prefect_dask")
    from prefect import flow
    from prefect.context import FlowRunContext

    from trajforge.flows.build import cluster_workers

    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                                  dashboard_address=None) as cluster:
        @flow(task_runner=prefect_dask.DaskTaskRunner(address=cluster.scheduler_address))
        def probe() -> int | None:
            return cluster_workers(FlowRunContext.get().task_runner)

        assert probe() == 2


@pytest.mark.slow
def test_a_ray_cluster_says_how_many_tasks_a_step_has(monkeypatch):
    prefect_ray = pytest.importorskip("prefect_ray")
    from prefect import flow
    from prefect.context import FlowRunContext

    from trajforge.flows.build import cluster_workers

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")

    @flow(task_runner=prefect_ray.RayTaskRunner(init_kwargs={"num_cpus": 3, "include_dashboard": False}))
    def probe() -> int | None:
        return cluster_workers(FlowRunContext.get().task_runner)

    assert probe() == 3


def _cube(x: int) -> int:
    return x ** 3


@pytest.mark.parametrize("tasks", [2, None])
def test_a_step_on_the_task_runner_returns_the_results_in_call_order_and_leaves_no_claims(tasks, tmp_path):
    from prefect import flow
    from prefect.task_runners import ThreadPoolTaskRunner

    from trajforge.flows.build import on_task_runner

    @flow(task_runner=ThreadPoolTaskRunner(max_workers=2))
    def step() -> list:
        return on_task_runner(_cube, [(i,) for i in range(7)], [1, 5, 2, 9, 3, 3, 1], tasks=tasks,
                              claims=tmp_path / "claims")

    assert step() == [i ** 3 for i in range(7)]
    assert not list((tmp_path / "claims").iterdir())
