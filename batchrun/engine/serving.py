"""The engine shared by many callers: its steps on a thread of its own, callers waiting for
their requests (blocking, or awaiting in an event loop), and streams of a request's text as its
tokens arrive. What vllm-mlx's `BatchedEngine` offers as `generate`, `chat`, `stream_generate`
and `stream_chat`, on batchrun's engine (`Engine` delegates here).

One lock guards the engine: the serving thread holds it for a step, a caller for adding or
aborting a request. A caller is told of its request from the serving thread: a threading event
for one that blocks, the event loop's own future (`call_soon_threadsafe`) for one that awaits,
so an awaiting caller never blocks its loop.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from batchrun.engine.types import FinishReason, Output


@dataclass(slots=True)
class StreamOutput:
    """A request's progress: its text so far and what this step added; the last one a stream
    gives is `finished`, with the whole Output."""

    request_id: int
    text: str
    new_text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: FinishReason | None = None
    output: Output | None = None
    prompt_tokens: int = 0

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


class EngineStopped(RuntimeError):
    """A call on an engine after stop() (or close())."""


class Serving:
    def __init__(self, engine: Any):
        self.engine = engine
        self.lock = threading.RLock()
        self._wake = threading.Condition(self.lock)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._done: dict[int, list[Callable[[Output], None]]] = {}
        self._watched: dict[int, list[Callable[[int], None]]] = {}  # told after every step
        self.failure: BaseException | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        with self.lock:
            if self.running:
                return
            self._stopping = False
            self._thread = threading.Thread(target=self._serve, name="batchrun-engine",
                                            daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop stepping; requests still running are aborted, their callers told."""
        with self.lock:
            self._stopping = True
            self._wake.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None
        with self.lock:
            for request_id in list(self._done):
                self.engine.abort(request_id)
            self._deliver(self.engine.run())

    def submit(self, add: Callable[[], int], on_done: Callable[[Output], None],
               on_step: Callable[[int], None] | None = None) -> int:
        """Add a request (`add` queues it, returns its id) whose Output goes to `on_done`;
        `on_step` is called with its id after every step."""
        with self.lock:
            if self.failure is not None:
                raise EngineStopped(f"the engine's thread failed: {self.failure}")
            request_id = add()
            self._done.setdefault(request_id, []).append(on_done)
            if on_step is not None:
                self._watched.setdefault(request_id, []).append(on_step)
            self._wake.notify_all()
        return request_id

    def _serve(self) -> None:
        try:
            while True:
                with self.lock:
                    while not self._stopping and not self.engine.has_work():
                        self._wake.wait()
                    if self._stopping:
                        return
                    finished = self.engine.step()
                    for request_id, watchers in list(self._watched.items()):
                        for watch in watchers:
                            # its caller gone: nobody reads it on
                            if not _told(watch, request_id):
                                self.engine.abort(request_id)
                    self._deliver(finished)
        except BaseException as e:  # every waiting caller hears of it, none waits forever
            with self.lock:
                self.failure = e
                for request_id in list(self._done):
                    self._fail(request_id, e)

    def _deliver(self, finished: list[Output]) -> None:
        for out in finished:
            self._watched.pop(out.request_id, None)
            for tell in self._done.pop(out.request_id, []):
                _told(tell, out)

    def _fail(self, request_id: int, error: BaseException) -> None:
        self._watched.pop(request_id, None)
        for tell in self._done.pop(request_id, []):
            _told(tell, Output(request_id, "", [], FinishReason.ERROR, 0,
                               error=f"the engine's thread failed: {error}"))

    def abandon(self, request_id: int) -> None:
        """The caller of a request went away (a stream closed early, an awaiting task
        cancelled): it is aborted, nobody is told."""
        with self.lock:
            self._watched.pop(request_id, None)
            self._done.pop(request_id, None)
            self.engine.abort(request_id)

    # -- waiting for one request ----------------------------------------------------------------

    def wait(self, add: Callable[[], int]) -> Output:
        """Block until the request is done (the serving thread runs it)."""
        box: list[Output] = []
        event = threading.Event()

        def done(out: Output) -> None:
            box.append(out)
            event.set()

        self.submit(add, done)
        event.wait()
        return box[0]

    async def wait_async(self, add: Callable[[], int]) -> Output:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Output] = loop.create_future()

        def done(out: Output) -> None:
            loop.call_soon_threadsafe(_settle, future, out)

        request_id = self.submit(add, done)
        try:
            return await future
        except asyncio.CancelledError:
            self.abandon(request_id)
            raise

    # -- streams ---------------------------------------------------------------------------------

    def stream(self, add: Callable[[], int]) -> Stream:
        return Stream(self, add)


def _settle(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _told(tell: Callable, *args: Any) -> bool:
    """Tell a caller; False if it cannot be told (its event loop closed, say): one caller's
    going away never stops the engine's thread for the others."""
    try:
        tell(*args)
    except Exception:  # noqa: BLE001  (any caller's failure is that caller's)
        return False
    return True


class Stream:
    """A request's StreamOutputs, iterated (`for`) or awaited (`async for`); the request is
    added when iteration begins."""

    def __init__(self, serving: Serving, add: Callable[[], int]):
        self._serving = serving
        self._add = add

    def _submit(self, post: Callable[[tuple], None]) -> int:
        """Add the request; each step's progress (read on the serving thread, which holds
        the engine's lock: the tokens of that very step) and the last output go to `post`."""
        progress = _Progress(self._serving.engine)

        def on_step(request_id: int) -> None:
            update = progress.update(request_id)
            if update is not None:
                post(("step", update))

        def on_done(out: Output) -> None:
            post(("done", progress.update(out.request_id, out)))

        return self._serving.submit(self._add, on_done, on_step)

    def __iter__(self) -> Iterator[StreamOutput]:
        events: queue.Queue = queue.Queue()
        request_id = self._submit(events.put)
        finished = False
        try:
            while True:
                kind, update = events.get()
                if update is not None:
                    yield update
                if kind == "done":
                    finished = True
                    return
        finally:
            if not finished:  # the caller stopped reading: the request stops too
                self._serving.abandon(request_id)

    def __aiter__(self) -> AsyncIterator[StreamOutput]:
        return self._async()

    async def _async(self) -> AsyncIterator[StreamOutput]:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        request_id = self._submit(
            lambda item: loop.call_soon_threadsafe(events.put_nowait, item))
        finished = False
        try:
            while True:
                kind, update = await events.get()
                if update is not None:
                    yield update
                if kind == "done":
                    finished = True
                    return
        finally:
            if not finished:  # closed early or cancelled: the request stops too
                self._serving.abandon(request_id)


class _Progress:
    """A request's text as its tokens arrive (decoded whole each time: a token may complete a
    character the one before began)."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.text = ""
        self.tokens = 0
        self.prompt_tokens = 0

    def update(self, request_id: int, out: Output | None = None) -> StreamOutput | None:
        if out is not None:
            new = out.text[len(self.text):] if out.text.startswith(self.text) else out.text
            return StreamOutput(request_id, out.text, new, list(out.token_ids), True,
                                out.finish_reason, out, out.prompt_tokens)
        with self.engine.serving.lock:
            seq = self.engine.scheduler.find(request_id)
            if seq is None or len(seq.tokens) == self.tokens:
                return None
            tokens, self.prompt_tokens = list(seq.tokens), len(seq.prompt)
        # A character whose bytes are not all in yet decodes as U+FFFD: the text stops before
        # it until a later step completes it (or the last output says what it is).
        text = self.engine.tokenizer.decode(tokens).rstrip("\ufffd")
        if len(text) <= len(self.text) and text == self.text:
            return None
        new = text[len(self.text):] if text.startswith(self.text) else text
        self.text, self.tokens = text, len(tokens)
        return StreamOutput(request_id, text, new, tokens, prompt_tokens=self.prompt_tokens)
