"""One OpenMP team per process: confined threads start none, a passing thread's team leaves with it.

The oracle is the kernel's own list of the process's threads (/proc/self/task): an OpenMP team is worker
threads there. Each test first shows that the same op on an unconfined thread does start a team, so a
count that stays put means confinement, not an op too small to run in parallel.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
import torch

from promptcache.model_runtime import confine_to_this_thread, confined_executor, run_in_passing_thread

TASKS = "/proc/self/task"
pytestmark = pytest.mark.skipif(not os.path.isdir(TASKS), reason="counts threads in /proc (Linux)")


def num_tasks() -> int:
    return len(os.listdir(TASKS))


def parallel_work() -> torch.Tensor:
    """An op torch splits across its intra-op threads (far above any grain size)."""
    return torch.ones(4_000_000).cumsum(0)[-1] + torch.ones(2000, 2000).sum()


def threads_of_fresh_thread() -> int:
    seen: list[int] = []
    worker = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    worker.start()
    worker.join()
    return seen[0]


def settled_tasks(at_most: int | None = None) -> int:
    """The thread count once exiting threads (a finished thread's team leaves after it) are gone."""
    deadline, last = time.monotonic() + 5, -1
    while time.monotonic() < deadline:
        now = num_tasks()
        if now == last and (at_most is None or now <= at_most):
            return now
        last = now
        time.sleep(0.05)
    return num_tasks()


def tasks_added_while_alive(confine: bool) -> tuple[int, float]:
    """(threads the process gained while a new thread did parallel work and stayed alive, its result)."""
    started, release, out = threading.Event(), threading.Event(), {}

    def body() -> None:
        if confine:
            confine_to_this_thread()
        out["result"] = float(parallel_work())
        started.set()
        release.wait(10)

    before = settled_tasks()
    worker = threading.Thread(target=body)
    worker.start()
    started.wait(10)
    during = num_tasks()
    release.set()
    worker.join()
    return during - before - 1, out["result"]  # minus the worker itself


@pytest.fixture
def multithreaded():
    if threads_of_fresh_thread() < 2:
        pytest.skip("torch runs one intra-op thread here: no team to start")


def test_confined_thread_starts_no_team(multithreaded):
    added_free, expected = tasks_added_while_alive(confine=False)
    assert added_free >= 1, "the oracle: unconfined, the work starts a team of worker threads"
    added_confined, result = tasks_added_while_alive(confine=True)
    assert added_confined == 0
    assert result == expected


def test_confinement_is_per_thread(multithreaded):
    full = threads_of_fresh_thread()
    seen: list[int] = []

    def body() -> None:
        confine_to_this_thread()
        seen.append(torch.get_num_threads())
        seen.append(threads_of_fresh_thread())  # a thread started after, from the confined one

    worker = threading.Thread(target=body)
    worker.start()
    worker.join()
    assert seen == [1, full]


def test_confined_executor_threads_are_confined(multithreaded):
    with confined_executor() as executor:
        counts = list(executor.map(lambda _: torch.get_num_threads(), range(8)))
    assert counts == [1] * 8


def test_passing_thread_uses_every_thread_and_takes_its_team_along(multithreaded):
    expected, full = float(parallel_work()), threads_of_fresh_thread()  # this thread's team, if any, first
    before = settled_tasks()
    ran_on: list[threading.Thread] = []

    def load() -> tuple[int, float]:
        ran_on.append(threading.current_thread())
        return torch.get_num_threads(), float(parallel_work())

    num_threads, result = asyncio.run(run_in_passing_thread(load))
    assert num_threads == full and result == expected
    assert ran_on[0] is not threading.main_thread()
    ran_on[0].join(5)  # it has returned; its exit frees its team
    assert settled_tasks(at_most=before) <= before


def test_passing_thread_raises_what_the_function_raised():
    def fail() -> None:
        raise ValueError("no model here")

    with pytest.raises(ValueError, match="no model here"):
        asyncio.run(run_in_passing_thread(fail))
