"""A pool of daemon threads for plain-function handlers.

The standard ThreadPoolExecutor joins its threads at interpreter exit, so one
hung handler (a socket with no timeout) would keep a stopped relay process
alive forever. The relay has already recorded such an attempt as a timeout;
these threads are daemons, so the process can still exit.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

__all__ = ["DaemonPool"]

T = TypeVar("T")

_Job = tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class DaemonPool(Executor):
    def __init__(self, max_workers: int, name: str = "outbox-handler") -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._max = max_workers
        self._name = name
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        future: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("pool is shut down")
            self._jobs.put((future, fn, args, kwargs))
            if self._idle == 0 and len(self._threads) < self._max:
                thread = threading.Thread(
                    target=self._work, name=f"{self._name}-{len(self._threads)}", daemon=True
                )
                self._threads.append(thread)
                thread.start()
            else:
                self._idle -= 1 if self._idle else 0
        return future

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future, fn, args, kwargs = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as exc:  # SystemExit too: the attempt records it as a failure
                    future.set_exception(exc)
            del job, future, fn, args, kwargs
            with self._lock:
                self._idle += 1

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        for _ in threads:
            self._jobs.put(None)
        if wait:
            for thread in threads:
                thread.join()
