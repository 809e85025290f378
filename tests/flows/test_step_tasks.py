"""How the build flow deals the calls of a second-half step into its tasks (flows/build.py: `deal`)."""
from __future__ import annotations

from trajforge.flows.build import deal


def test_calls_of_one_size_are_dealt_in_turn():
    assert deal([1] * 5, 2) == [[0, 2, 4], [1, 3]]


def test_the_largest_calls_go_first_into_the_task_with_the_least_work():
    sizes = [3, 9, 1, 7, 2, 8, 5]
    tasks = deal(sizes, 3)
    assert tasks == [[1, 4, 2], [5, 0], [3, 6]]
    # Dealt in turn, one task would get 3 + 7 + 5 = 15.
    assert max(sum(sizes[i] for i in task) for task in tasks) == 12


def test_fewer_calls_than_tasks_leave_tasks_empty_and_every_call_is_dealt_once():
    tasks = deal([4, 2], 3)
    assert tasks == [[0], [1], []]
    assert deal([], 2) == [[], []]
