"""WriteBehind: shared-tier writes (Redis, disk) run in FIFO order on one background thread, so a put never
waits on I/O and the store's lock is never held across it."""

from __future__ import annotations

import atexit
import threading
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from promptcache.cache_store.errors import logger

EXIT_FLUSH_TIMEOUT_S = 30.0  # how long interpreter exit waits for queued shared writes


@dataclass(slots=True, eq=False)
class _Job:
    key: str
    nbytes: int
    run: Callable[[], object]
    is_cancelled: bool = False


class WriteBehind:
    """Runs shared-tier writes (and, behind them, other operations on the same key) in FIFO order on one thread,
    started by the first job and gone after `idle_exit_s` idle. A write that would take the queue past
    `max_bytes` is dropped and counted (it is a cache); at interpreter exit the queue is flushed (bounded)."""

    def __init__(self, max_bytes: int, idle_exit_s: float = 2.0) -> None:
        self.max_bytes = max_bytes
        self.idle_exit_s = idle_exit_s
        self.num_dropped = self.pending_bytes = 0
        self._cond = threading.Condition()
        self._jobs: deque[_Job] = deque()
        self._queued: dict[str, list[_Job]] = {}  # key -> its live queued jobs, oldest first
        self._running: _Job | None = None
        self._thread: threading.Thread | None = None
        self._exit_hook: Callable[[], None] | None = None
        self._is_closing = False

    @property
    def num_pending(self) -> int:
        with self._cond:
            return sum(map(len, self._queued.values())) + (self._running is not None)

    def submit(self, key: str, nbytes: int, run: Callable[[], object]) -> bool:
        with self._cond:
            if nbytes and self.pending_bytes + nbytes > self.max_bytes:
                self.num_dropped += 1
                return False
            job = _Job(key, nbytes, run)
            self._jobs.append(job)
            self._queued.setdefault(key, []).append(job)
            self.pending_bytes += nbytes
            if self._thread is None:
                self._start()
            self._cond.notify_all()
            return True

    def cancel(self, key: str) -> bool:
        """Drop the queued jobs of `key`; True if one of its jobs is running right now."""
        with self._cond:
            for job in self._queued.pop(key, ()):
                job.is_cancelled = True
                self.pending_bytes -= job.nbytes
            return self._running is not None and self._running.key == key

    def has_pending(self, key: str) -> bool:
        with self._cond:
            return key in self._queued or (self._running is not None and self._running.key == key)

    def flush(self, timeout_s: float | None = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: not self._queued and self._running is None, timeout_s)

    def close(self, timeout_s: float | None) -> bool:
        """Flush (bounded), drop what is left (counted), stop the thread. A later submit restarts it."""
        is_flushed = self.flush(timeout_s)
        with self._cond:
            for key in list(self._queued):
                self.num_dropped += len(self._queued[key])
                self.cancel(key)
            self._is_closing = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
        with self._cond:
            self._is_closing = False
        if self._exit_hook is not None:
            atexit.unregister(self._exit_hook)
            self._exit_hook = None
        return is_flushed

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="promptcache-write-behind", daemon=True)
        self._thread.start()
        if self._exit_hook is None:
            ref = weakref.ref(self)  # the hook must not keep the writer (and its store) alive

            def flush_at_exit() -> None:
                writer = ref()
                if writer is not None and not writer.flush(EXIT_FLUSH_TIMEOUT_S):
                    logger.warning("exiting with %d shared-tier writes not done", writer.num_pending)

            self._exit_hook = flush_at_exit
            atexit.register(flush_at_exit)

    def _loop(self) -> None:
        while True:
            with self._cond:
                job = self._next()
                if job is None:
                    self._thread = None
                    return
                self._running = job
            try:
                job.run()
            except Exception:  # a cache write must never kill the writer
                logger.exception("write-behind of %s failed", job.key[:12])
            finally:
                with self._cond:
                    self._running = None
                    self.pending_bytes -= job.nbytes
                    self._cond.notify_all()

    def _next(self) -> _Job | None:
        """With the lock held: the oldest live job, or None after `idle_exit_s` without one."""
        while True:
            while self._jobs:
                job = self._jobs.popleft()
                if job.is_cancelled:
                    continue
                same_key = self._queued[job.key]
                same_key.pop(0)  # FIFO: a key's oldest live job is the one leaving the queue
                if not same_key:
                    del self._queued[job.key]
                return job
            self._cond.notify_all()  # idle: wake flush()
            if self._is_closing or (not self._cond.wait(self.idle_exit_s) and not self._jobs):
                return None
