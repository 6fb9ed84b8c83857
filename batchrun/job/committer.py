"""Commits whose disk work runs beside the engine.

A commit fsyncs the job's files and writes state.json and report.json: on a network disk that
took 1.3-2.3 s (measured on the H200 host), time the engine stood still. The job loop takes a
snapshot of its progress (cheap, on its own thread) and hands the disk work to one background
thread; at most one commit is in flight, and the loop settles it (cuts an emptied spill, writes
Parquet row groups) once it has finished. A failed commit is raised in the loop.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class BackgroundCommits:
    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._then: Callable[[float], None] | None = None
        self._took = 0.0

    @property
    def busy(self) -> bool:
        return self._thread is not None

    def start(self, work: Callable[[], None], then: Callable[[float], None]) -> None:
        """Run `work` on the commit thread; `then(seconds it took)` runs in `poll` or `wait`."""
        if self._thread is not None:
            raise RuntimeError("a commit is already in flight")

        def run() -> None:
            start = time.perf_counter()
            try:
                work()
            except BaseException as e:  # handed to the job loop by poll/wait
                self._error = e
            self._took = time.perf_counter() - start

        self._then = then
        self._thread = threading.Thread(target=run, name="batchrun-commit", daemon=True)
        self._thread.start()

    def poll(self) -> None:
        """Settle the commit in flight if it has finished."""
        if self._thread is not None and not self._thread.is_alive():
            self.wait()

    def wait(self) -> None:
        """Wait for the commit in flight and settle it; raises the error it met."""
        if self._thread is None:
            return
        self._thread.join()
        self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error
        then, self._then = self._then, None
        then(self._took)
