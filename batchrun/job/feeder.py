"""Read and tokenize rows on a background thread, ahead of the engine.

Reading, JSON parsing, chat-template rendering and tokenization run here while the engine
computes (MLX releases the GIL during evaluation), so the engine's loop only takes ready Tasks.
The queue is bounded: memory stays flat however large the input is.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator

from batchrun.io.jsonl import RawRow
from batchrun.job.rows import RowError, Task

_DONE = object()


class Feeder:
    def __init__(self, rows: Iterator[RawRow], build: Callable[[RawRow], Task | RowError],
                 lookahead: int):
        self._rows = rows
        self._build = build
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, lookahead))
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self.exhausted = False
        self._thread = threading.Thread(target=self._run, name="batchrun-feeder", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for raw in self._rows:
                item = self._build(raw)
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
        except BaseException as e:  # surfaced to the caller by take()
            self._error = e
        finally:
            self._queue.put(_DONE)

    def take(self, n: int, block: bool, linger: float = 0.0) -> list[Task | RowError]:
        """Up to n ready items. With `block`, wait for the first one, then up to `linger`
        seconds for more: an idle engine loses nothing by waiting, and rows admitted together
        let the engine see which of them share a prompt prefix."""
        items: list[Task | RowError] = []
        deadline = None
        while len(items) < n and not self.exhausted:
            if not items:
                wait, timeout = block, None
            else:
                if deadline is None:
                    deadline = time.monotonic() + (linger if block else 0.0)
                timeout = deadline - time.monotonic()
                wait = timeout > 0
            try:
                item = self._queue.get(block=wait, timeout=timeout if wait else None)
            except queue.Empty:
                break
            if item is _DONE:
                self.exhausted = True
                if self._error is not None:
                    raise self._error
                break
            items.append(item)
        return items

    def close(self) -> None:
        self._stop.set()
        while True:  # unblock a producer waiting on a full queue
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=5)
