"""Torch's intra-op threads belong to the engine thread: one OpenMP team in the process.

Why: with torch's OpenMP backend (libgomp), every thread that starts a parallel region gets a team of worker
threads of its own, kept for as long as that thread lives. Once the process holds more such threads than
CPUs, libgomp stops letting idle workers spin ("throttled" spinning, a hundredth of the usual) and every
parallel region wakes its workers through the kernel. A decode step runs ~150 parallel regions (each matmul,
each attention call), so a second team anywhere cost each step that wake-up ~150 times: on 2 cores a
SmolLM2-135M bf16 decode step took 21 ms instead of 12.7 ms when the model had been loaded on a worker thread
of asyncio's default executor (which lives on) and the engine ran on its own thread.

So the server (1) loads the model and builds the service on a thread that exits afterwards, taking its
team with it (`run_in_passing_thread`), and (2) confines every other long-lived thread it runs torch ops on
(the event loop's, the default executor's workers) to itself (`confine_to_this_thread`): their ops run
serially on the calling thread and start no team. The engine thread keeps torch's setting.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch
from threadpoolctl import threadpool_limits

T = TypeVar("T")


def confine_to_this_thread() -> None:
    """Run the calling thread's torch ops on that thread alone: OpenMP's thread count for this thread only
    (an OpenMP setting is per thread) becomes 1. Other threads, the engine's included, keep theirs."""
    torch.get_num_threads()  # torch sets a thread's OpenMP count on its first use there: first, not after us
    threadpool_limits(1, user_api="openmp")


def confined_executor(thread_name_prefix: str = "promptcache-worker") -> ThreadPoolExecutor:
    """A thread pool (asyncio's default size) whose threads are confined as they start."""
    return ThreadPoolExecutor(thread_name_prefix=thread_name_prefix, initializer=confine_to_this_thread)


async def run_in_passing_thread(function: Callable[..., T], *args: object) -> T:
    """`function(*args)` on a new thread with torch's full thread count; the thread exits when it returns,
    and its OpenMP team with it (model loading: every core, then no second team left behind)."""
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="promptcache-passing")
    try:
        return await asyncio.get_running_loop().run_in_executor(executor, functools.partial(function, *args))
    finally:
        executor.shutdown(wait=False)  # its one thread exits once the function has returned
