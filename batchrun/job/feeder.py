"""Read and build rows on background threads, ahead of the engine.

One thread reads rows; one dispatches them: it runs the sequential checks (`check`: duplicate
ids, which depend on input order) and hands the rows to `workers` build threads (chat-template
rendering, tokenization, the vision processor) while the engine computes (MLX releases the
GIL), so the engine's loop only takes ready Tasks. Rows travel between these threads in
batches: the reader wakes the dispatcher once CHUNK rows are read, the dispatcher also looks
every ROWS_POLL_S and takes every row read so far (so no row waits for more to be read, however
the input stalls), and a build thread hands back BUILD_PIECE rows at a time. Each handoff from
one thread to another is a GIL switch, and while the engine's thread runs Python a switch can
wait out the interpreter's switch interval (5 ms).

A row with images goes to a small pool of fetch threads that load them (each image within its
media deadline) and comes back to be built: a slow image holds up no other row, so rows may
come out of input order (the sink orders records by index). At most `lookahead` rows are inside
the feeder at once: memory stays flat however large the input is.

Stopping never waits on a fetch: take() waits at most its `timeout` (the caller's loop goes on
committing and sees Ctrl-C), and close() abandons fetch threads (daemons) stuck until their
deadline.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

from batchrun.io.jsonl import RawRow
from batchrun.job.rows import ImagesPending, RowError, Task, defer_images, images_loaded

FETCH_THREADS = 4  # image loads at once
POLL_S = 0.1  # how often the reader, waiting for room, looks for a stop
CLOSE_WAIT_S = 1.0  # close() waits at most this long for the reader and the builder
CHUNK = 32  # rows read that wake the dispatcher (it also looks every ROWS_POLL_S)
ROWS_POLL_S = 0.02
BUILD_PIECE = 8  # rows a build thread builds and hands back as one message
LINGER_CAP_S = 0.5  # the longest take() lingers for more rows once it has one

_DONE = object()


class Feeder:
    def __init__(self, rows: Iterator[RawRow], build: Callable[[RawRow], Task | RowError],
                 lookahead: int, fetch_threads: int = FETCH_THREADS,
                 check: Callable[[RawRow], RowError | None] | None = None, workers: int = 1):
        self._rows = rows
        self._build = build
        self._check = check
        self._workers = ThreadPoolExecutor(max(1, workers), "batchrun-build",
                                           initializer=defer_images)
        self._room = threading.Semaphore(max(1, lookahead))  # rows inside, until taken
        # The dispatcher's inbox: ("rows",), ("images", raw, loaded),
        # ("built", [(raw, item)]), ("end", error), ("stop",)
        self._inbox: queue.Queue = queue.Queue()
        self._fetches: queue.Queue = queue.Queue()  # (raw, ImagesPending); None: exit
        self._ready: queue.Queue = queue.Queue()  # built items, then _DONE
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._fetch_threads = max(1, fetch_threads)
        # Rows read, and rows ready or gone to fetch their images, each counted by one thread:
        # the difference is rows on their way (take() lingers for them).
        self._read_n = 0
        self._settled_n = 0
        self._rows_lock = threading.Lock()
        self._rows_read: list[RawRow] = []  # read, not yet taken by the dispatcher
        self._rows_signalled = False  # a ("rows",) message is on its way to the dispatcher
        self._fetchers_started = False
        self.exhausted = False
        self._reader = self._start(self._read, "batchrun-reader")
        self._builder = self._start(self._build_rows, "batchrun-feeder")

    @staticmethod
    def _start(target: Callable[[], None], name: str) -> threading.Thread:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        return thread

    def _read(self) -> None:
        error = None
        try:
            rows = iter(self._rows)
            while self._wait_for_room():
                raw = next(rows, _DONE)
                if raw is _DONE:
                    break
                self._read_n += 1
                with self._rows_lock:  # the dispatcher takes all rows read so far at once
                    self._rows_read.append(raw)
                    wake = not self._rows_signalled and len(self._rows_read) >= CHUNK
                    self._rows_signalled |= wake
                if wake:
                    self._inbox.put(("rows",))
        except BaseException as e:  # surfaced to the caller by take()
            error = e
        self._inbox.put(("end", error))

    def _wait_for_room(self) -> bool:
        while not self._room.acquire(timeout=POLL_S):
            if self._stop.is_set():
                return False
        return not self._stop.is_set()

    def _build_rows(self) -> None:
        busy = 0  # rows being built or fetching their images
        ended = False
        try:
            while not (ended and busy == 0):
                try:  # rows read but not yet signalled are looked for at least this often
                    message = self._inbox.get(timeout=ROWS_POLL_S)
                except queue.Empty:
                    message = ("rows",)
                if self._stop.is_set():
                    return
                kind = message[0]
                if kind in ("rows", "end"):  # the rows read so far, in input order
                    busy += self._dispatch()
                if kind == "end":
                    ended = True
                    if message[1] is not None:
                        raise message[1]
                elif kind == "built":
                    for raw, item, fetched in message[1]:
                        if not fetched:  # a row's first build: it is ready or goes to fetch
                            self._settled_n += 1
                        if isinstance(item, ImagesPending):  # fetched, then built again
                            self._start_fetchers()
                            self._fetches.put((raw, item))
                            continue
                        busy -= 1
                        if isinstance(item, BaseException):
                            raise item
                        self._ready.put(item)
                elif kind == "images":
                    self._workers.submit(self._build_many, [(message[1], message[2])])
        except BaseException as e:  # surfaced to the caller by take()
            self._error = e
        self._ready.put(_DONE)

    def _dispatch(self) -> int:
        """Check the rows read since the last call (in input order) and hand them to the build
        threads BUILD_PIECE at a time; the number handed."""
        with self._rows_lock:
            raws, self._rows_read = self._rows_read, []
            self._rows_signalled = False
        jobs = []
        for raw in raws:
            error = self._check(raw) if self._check is not None else None
            if error is not None:
                self._settled_n += 1
                self._ready.put(error)
            else:
                jobs.append((raw, None))
        for start in range(0, len(jobs), BUILD_PIECE):
            self._workers.submit(self._build_many, jobs[start:start + BUILD_PIECE])
        return len(jobs)

    def _build_many(self, jobs: list[tuple[RawRow, list | Exception | None]]) -> None:
        """On a build thread (images deferred there): each row's Task or RowError, its pending
        images, or the exception its build raised, back to the dispatcher in one message."""
        built = []
        for raw, loaded in jobs:
            try:
                if loaded is None:
                    item = self._build(raw)
                else:
                    with images_loaded(loaded):
                        item = self._build(raw)
            except ImagesPending as pending:
                item = pending
            except BaseException as e:
                item = e
            built.append((raw, item, loaded is not None))
        self._inbox.put(("built", built))

    def _start_fetchers(self) -> None:
        if not self._fetchers_started:
            self._fetchers_started = True
            for i in range(self._fetch_threads):
                self._start(self._fetch, f"batchrun-fetch-{i}")

    def _fetch(self) -> None:
        while True:
            job = self._fetches.get()
            if job is None or self._stop.is_set():
                return
            raw, pending = job
            try:
                loaded = pending.load()
            except Exception as e:  # the row's error (MediaError), raised where it is built
                loaded = e
            self._inbox.put(("images", raw, loaded))

    def take(self, n: int, block: bool, linger: float = 0.0,
             timeout: float | None = None) -> list[Task | RowError]:
        """Up to n ready items. With `block`, wait up to `timeout` seconds (None: until one
        comes) for the first one, then for more while rows read are still being built, or each
        comes within `linger` seconds of the one before (at most LINGER_CAP_S in all): an idle
        engine loses nothing by waiting while rows are being built, and rows admitted together
        are one prefill and let the engine see which of them share a prompt prefix. (A job's
        rows in two waves made batch shapes new to the machine: on the H200 a first step of
        such a shape compiled kernels for 4.4 s.)"""
        items: list[Task | RowError] = []
        first = None if timeout is None else time.monotonic() + timeout
        cap = None
        while len(items) < n and not self.exhausted:
            if items:
                now = time.monotonic()
                if cap is None:
                    cap = now + LINGER_CAP_S
                wait = min(cap, now + linger) - now if block else 0.0
            elif block:
                wait = None if first is None else first - time.monotonic()
            else:
                wait = 0.0
            try:
                item = self._ready.get(timeout=wait) if wait is None or wait > 0 else \
                    self._ready.get_nowait()
            except queue.Empty:
                if block and items and linger > 0 and self._read_n > self._settled_n \
                        and time.monotonic() < cap:
                    continue  # rows read and being built: they come soon
                break
            if item is _DONE:
                self.exhausted = True
                if self._error is not None:
                    raise self._error
                break
            self._room.release()
            items.append(item)
        return items

    def close(self) -> None:
        """Stop the threads. Waits a moment for the reader and the builder, never for a fetch:
        its thread is left to end at its deadline."""
        self._stop.set()
        self._inbox.put(("stop",))
        self._workers.shutdown(wait=False, cancel_futures=True)
        for _ in range(self._fetch_threads):
            self._fetches.put(None)
        deadline = time.monotonic() + CLOSE_WAIT_S
        for thread in (self._builder, self._reader):
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
