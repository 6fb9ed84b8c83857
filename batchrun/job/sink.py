"""Make every finished row durable at once, and write the output in input order.

A finished row's record is appended to the spill (`spill.jsonl`) the moment it arrives,
whatever rows before it are still running, and held in memory until the rows before it are
done; then it is appended to the ordered results or errors file. `sync()` fsyncs all three, so
after a commit (job/state.py) every row finished before it survives a crash: from the ordered
files below the frontier, from the spill above it. A resumed job reads the spilled records back
(`recovered`) instead of computing those rows again.

The spill only ever holds rows that are also about to be, or already are, in the ordered files;
once no row is held it can be emptied (`spill_drained`). A long job at full concurrency may
always hold some row back, so after a commit a spill grown well past the rows it still holds is
rewritten with just those (`settle`): it stays as small as the rows held back.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import orjson

from batchrun.io.files import open_append, write_atomic
from batchrun.job.state import JobState, Progress, file_digest


@dataclass(slots=True)
class Record:
    """One row's finished line, and the token counts the report adds up."""

    index: int
    line: bytes
    is_error: bool
    tokens: tuple[int, int, int] = (0, 0, 0)  # prompt, cached, completion

    def spill_line(self) -> bytes:
        return orjson.dumps({"index": self.index, "error": self.is_error,
                             "tokens": list(self.tokens), "line": self.line.decode()}) + b"\n"

    @classmethod
    def from_spill(cls, raw: bytes) -> Record:
        """Parse one spill line; raises ValueError if it is not one."""
        d = orjson.loads(raw)
        if not (isinstance(d, dict) and type(d.get("index")) is int and d["index"] >= 0
                and isinstance(d.get("error"), bool) and isinstance(d.get("line"), str)
                and isinstance(d.get("tokens"), list) and len(d["tokens"]) == 3
                and all(type(t) is int and t >= 0 for t in d["tokens"])):
            raise ValueError("not a spill record")
        line = d["line"].encode()
        if not line.endswith(b"\n") or b"\n" in line[:-1]:
            raise ValueError("not one record line")
        return cls(d["index"], line, d["error"], tuple(d["tokens"]))


def tokens_of(outs) -> tuple[int, int, int]:
    """A row's (prompt, cached, completion) tokens from its outputs (one per sample)."""
    if not outs:
        return (0, 0, 0)
    return (outs[0].prompt_tokens, outs[0].cached_tokens, sum(o.completion_tokens for o in outs))


# A spill is rewritten once it is this many times the size of the rows it holds back, and
# over SPILL_SLACK bytes (a rewrite costs a write of the held rows and an fsync).
SPILL_GROWTH = 4
SPILL_SLACK = 64 << 10


class OrderedSink:
    """Spills each finished row at once and writes records in input order; keeps the Progress
    that describes exactly what it has written (counts include spilled rows)."""

    def __init__(self, results: Path, errors: Path, spill: Path, progress: Progress,
                 recovered: dict[int, Record] | None = None, digests: tuple = ()):
        self.progress = dataclasses.replace(progress)
        self._spill_path = Path(spill)
        # Held open for the sink's life; close() closes them.
        self._results = open_append(results)
        self._errors = open_append(errors)
        self._spill = open_append(spill)
        # Running digests of what the ordered files hold (state.json records them): recovery's,
        # which read the files already, else read here.
        self._results_digest, self._errors_digest = (
            (d.copy() for d in digests) if digests else
            (file_digest(results, progress.results_bytes),
             file_digest(errors, progress.errors_bytes)))
        self._held: dict[int, Record] = dict(recovered or {})
        # The spill lines of held rows (a row next in order is never spilled), by row.
        self._spilled = {i: len(r.spill_line()) for i, r in self._held.items()}
        self._synced: tuple[int, int, int] | None = None  # the files' sizes at the last sync
        self._drain()

    def put(self, index: int, line: bytes, is_error: bool, outs=()) -> None:
        """Row `index` is finished: spill its line now, write it in order when it is next."""
        if index < self.progress.next_index or index in self._held:
            raise RuntimeError(f"row {index} would be written twice")
        record = Record(index, line, is_error, tokens_of(outs))
        p = self.progress
        if record.index != p.next_index:  # rows before it still run: make it durable now
            spilled = record.spill_line()
            self._spill.write(spilled)
            p.spill_bytes += len(spilled)
            self._spilled[record.index] = len(spilled)
        if is_error:
            p.rows_failed += 1
        else:
            p.rows_done += 1
            p.prompt_tokens += record.tokens[0]
            p.cached_tokens += record.tokens[1]
            p.completion_tokens += record.tokens[2]
        self._held[index] = record
        self._drain()

    def _drain(self) -> None:
        p = self.progress
        while p.next_index in self._held:
            record = self._held.pop(p.next_index)
            self._spilled.pop(record.index, None)
            if record.is_error:
                self._errors.write(record.line)
                self._errors_digest.update(record.line)
                p.errors_bytes += len(record.line)
            else:
                self._results.write(record.line)
                self._results_digest.update(record.line)
                p.results_bytes += len(record.line)
            p.next_index += 1

    @property
    def held(self) -> int:
        return len(self._held)

    @property
    def spill_drained(self) -> bool:
        """Every spilled row is in the ordered files: the spill can be emptied."""
        return not self._held and self.progress.spill_bytes > 0

    def sync(self) -> Progress:
        """Flush and fsync the files that grew since the last sync; returns the progress that
        is now durable."""
        pending = self.flush()
        self.fsync(pending)
        return dataclasses.replace(pending.progress)

    def flush(self) -> PendingCommit:
        """Hand what was written to the OS and take a snapshot of the progress it makes; the
        snapshot becomes durable with `fsync` (which may run on another thread while rows go on
        being written)."""
        for f in (self._results, self._errors, self._spill):
            f.flush()
        snapshot = dataclasses.replace(self.progress,
                                       results_sha256=self._results_digest.hexdigest(),
                                       errors_sha256=self._errors_digest.hexdigest())
        return PendingCommit(snapshot, self.spill_drained)

    def fsync(self, pending: PendingCommit) -> None:
        """fsync the files that grew since the last sync (an fsync can take a quarter of a
        second on a network disk)."""
        p = pending.progress
        sizes = (p.results_bytes, p.errors_bytes, pending.spilled_bytes)
        for i, f in enumerate((self._results, self._errors, self._spill)):
            if self._synced is None or sizes[i] != self._synced[i]:
                os.fsync(f.fileno())
        self._synced = sizes

    def settle(self, pending: PendingCommit) -> None:
        """After `pending` is recorded in state.json: empty the spill if that commit recorded it
        as empty and nothing was spilled since; else rewrite it with only the rows it still
        holds back if it has grown well past them. A crash before the next commit records the
        smaller spill finds it shorter than committed, and reads the records it holds."""
        if pending.spill_emptied and self.progress.spill_bytes == pending.spilled_bytes:
            self.empty_spill()
        elif self.progress.spill_bytes > max(SPILL_SLACK,
                                             SPILL_GROWTH * sum(self._spilled.values())):
            self._rewrite_spill()

    def _rewrite_spill(self) -> None:
        data = b"".join(self._held[i].spill_line() for i in sorted(self._held))
        self._spill.close()
        write_atomic(self._spill_path, data)
        self._spill = open_append(self._spill_path)
        self.progress.spill_bytes = len(data)
        if self._synced is not None:  # written durably: the next commit records its size
            self._synced = (*self._synced[:2], len(data))

    def empty_spill(self) -> None:
        """Cut the spill to nothing (after a commit that recorded it as empty)."""
        self._spill.truncate(0)
        self.progress.spill_bytes = 0
        if self._synced is not None:  # the cut is made durable by the next fsync
            self._synced = (*self._synced[:2], -1)

    def close(self) -> None:
        for f in (self._results, self._errors, self._spill):
            f.close()


@dataclass(slots=True)
class PendingCommit:
    """A snapshot of a sink's progress on its way into state.json. When no row was held the
    spill is recorded as empty (state.json first says so, so cutting it afterwards is safe)."""

    progress: Progress
    spill_emptied: bool
    spilled_bytes: int = 0  # the spill's size at the snapshot

    def __post_init__(self) -> None:
        self.spilled_bytes = self.progress.spill_bytes
        if self.spill_emptied:
            self.progress.spill_bytes = 0


def commit(sink: OrderedSink, state: JobState) -> Progress:
    """Make everything the sink wrote durable and record it in state.json, on this thread."""
    pending = sink.flush()
    make_durable(sink, state, pending)
    sink.settle(pending)
    return pending.progress


def make_durable(sink: OrderedSink, state: JobState, pending: PendingCommit) -> None:
    """fsync the sink's files, then record the snapshot in state.json (the part of a commit
    that waits for the disk, and may run on a thread of its own)."""
    sink.fsync(pending)
    state.commit(pending.progress)
