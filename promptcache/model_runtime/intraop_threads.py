"""Torch's intra-op threads belong to the engine thread (one libgomp team: past one thread per CPU, idle workers stop
spinning and waking them cost 21 ms, not 12.7, per SmolLM2-135M step on 2 cores). So the model loads on a thread that
exits (`run_in_passing_thread`) and other torch threads are confined (`confine_to_this_thread`)."""

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
