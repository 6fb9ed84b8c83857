"""Resume from the files, checking state.json against them rather than trusting it.

The ordered results and errors files, read together with the input, must hold one record per
row from row 0 up to a frontier, each naming its own row (its index where the record has one,
and its id). The spill must hold records of rows past that frontier, each naming its row.
state.json's byte sizes cut off whatever was written after the last commit (a torn tail, rows
not yet committed). Where state.json and the files disagree (a file cut short or edited, a
hand-edited or damaged state.json), the progress is rebuilt from what the files prove: a row
with no valid record is computed again, so no row is ever skipped, and none is written twice.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from batchrun.io.files import open_append
from batchrun.io.jsonl import RawRow, names_row
from batchrun.job.sink import Record
from batchrun.job.state import DIGESTS, DamagedFile, JobState, Progress


@dataclass(slots=True)
class Recovery:
    progress: Progress
    spilled: dict[int, Record] = field(default_factory=dict)  # finished rows past the frontier
    problems: list[str] = field(default_factory=list)  # how the files disagreed with state.json
    # Running SHA-256 of the results and errors files as kept (the sink goes on from them).
    digests: tuple = ()


def recover(state: JobState, rows: Iterator[RawRow], expected_id: Callable[[RawRow], str],
            on_done: Callable[[RawRow], None]) -> Recovery:
    """Check the job folder's files against state.json and the input, cut them back to what is
    proven, and return the progress to resume from. `on_done` sees every input row that already
    has a record (so later rows can still be checked for duplicate ids)."""
    problems: list[str] = []
    try:
        saved = state.saved()
    except DamagedFile as e:
        saved = None
        problems.append(str(e))
    committed = dataclasses.asdict(saved) if saved else {}
    paths = {"results_bytes": state.results_path, "errors_bytes": state.errors_path,
             "spill_bytes": state.spill_path}
    if saved is None and not problems and any(_size(p) for p in paths.values()):
        problems.append(f"{state.state_path} is missing")
    limits = {}
    for key, path in paths.items():
        size = _size(path)
        want = committed.get(key, size)
        if size < want and key != "spill_bytes":  # a spill shrinks when rewritten (sink.py)
            problems.append(f"{path.name} is shorter ({size:,} bytes) than committed "
                            f"({want:,} bytes)")
        limits[key] = min(size, want)

    results = _Lines(state.results_path, limits["results_bytes"])
    errors = _Lines(state.errors_path, limits["errors_bytes"])
    spill = _read_spill(state.spill_path, limits["spill_bytes"], problems)
    spill_order = list(spill)
    last_spilled = max(spill, default=-1)
    progress = Progress()
    kept: dict[int, Record] = {}
    in_order = True
    for raw in rows:
        if not in_order and raw.index > last_spilled:
            break
        want_id = expected_id(raw)
        if in_order:
            record = _next_in_order(raw, want_id, results, errors)
            if record is not None:
                spill.pop(raw.index, None)  # spilled, then written in order: no longer needed
                _count(progress, record)
                progress.next_index += 1
                on_done(raw)
                continue
            in_order = False
        found = spill.pop(raw.index, None)
        if found is not None and _names_row(found.line, raw, want_id):
            kept[raw.index] = found
            _count(progress, found)
            on_done(raw)
    if results.rest or errors.rest:
        problems.append(f"records past row {progress.next_index} in the ordered files do not "
                        "follow on from it")
    if spill:
        problems.append(f"{len(spill):,} spilled records do not belong to a pending row")
    progress.results_bytes = results.used
    progress.errors_bytes = errors.used
    progress.results_sha256 = results.digest.hexdigest()
    progress.errors_sha256 = errors.digest.hexdigest()
    if saved is not None:
        problems.extend(_edited(saved, progress, state))
    _cut(state.results_path, results.used)
    _cut(state.errors_path, errors.used)
    progress.spill_bytes = _rewrite_spill(state.spill_path, [kept[i] for i in spill_order
                                                             if i in kept], limits["spill_bytes"])
    if saved is not None and _counted(saved) != _counted(progress):
        problems.append(_difference(saved, progress))
    state.progress = progress
    return Recovery(progress, kept, problems, (results.digest, errors.digest))


class _Lines:
    """The lines of the first `limit` bytes of a file, one at a time."""

    def __init__(self, path: Path, limit: int):
        self._f = open(path, "rb") if limit else None  # noqa: SIM115
        self._left = limit
        self.used = 0  # bytes of the lines taken
        self.digest = hashlib.sha256()  # of the lines taken
        self._peeked: bytes | None = None

    def peek(self) -> bytes | None:
        if self._peeked is None and self._f is not None and self._left > 0:
            line = self._f.readline(self._left)
            self._left -= len(line)
            self._peeked = line if line.endswith(b"\n") else None
            if self._peeked is None:
                self._close()
        return self._peeked

    def take(self) -> None:
        self.used += len(self._peeked)
        self.digest.update(self._peeked)
        self._peeked = None

    @property
    def rest(self) -> bool:
        """Whether lines are left that were not taken."""
        left = self.peek() is not None
        self._close()
        return left

    def _close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def _next_in_order(raw: RawRow, want_id: str, results: _Lines, errors: _Lines
                   ) -> Record | None:
    """The row's record if it is next in the errors or results file."""
    for lines, is_error in ((errors, True), (results, False)):
        line = lines.peek()
        if line is not None and _names_row(line, raw, want_id, is_error=is_error):
            lines.take()
            return Record(raw.index, line, is_error, (0, 0, 0) if is_error else _tokens(line))
    return None


def _names_row(line: bytes, raw: RawRow, want_id: str, is_error: bool = False) -> bool:
    """A whole record of the row: valid JSON, its id, and its index where it has one, else for
    an error record its input line (OpenAI's error lines carry the line, in `error`; its result
    lines neither: one whose id is the row's is its, in order)."""
    try:
        d = orjson.loads(line)
    except orjson.JSONDecodeError:
        return False
    if not isinstance(d, dict) or d.get("custom_id") != want_id:
        return False
    if "index" in d or is_error or "response" in d and d.get("response") is None:
        return names_row(d, raw.index, raw.line)
    return True


def _tokens(line: bytes) -> tuple[int, int, int]:
    """(prompt, cached, completion) tokens of a result line, native or OpenAI-shaped."""
    d = orjson.loads(line)
    if "response" in d:
        usage = ((d.get("response") or {}).get("body") or {}).get("usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    else:
        usage = d.get("usage") or {}
        cached = usage.get("cached_tokens")
    return tuple(v if type(v) is int else 0 for v in
                 (usage.get("prompt_tokens"), cached, usage.get("completion_tokens")))


def _count(progress: Progress, record: Record) -> None:
    if record.is_error:
        progress.rows_failed += 1
        return
    progress.rows_done += 1
    progress.prompt_tokens += record.tokens[0]
    progress.cached_tokens += record.tokens[1]
    progress.completion_tokens += record.tokens[2]


def _read_spill(path: Path, limit: int, problems: list[str]) -> dict[int, Record]:
    """The spill's records by row (the first of each); stops at the first damaged line."""
    out: dict[int, Record] = {}
    if not limit:
        return out
    lines = _Lines(path, limit)
    while (line := lines.peek()) is not None:
        try:
            record = Record.from_spill(line)
        except ValueError:
            problems.append(f"{path.name} is damaged after {lines.used:,} bytes")
            break
        lines.take()
        out.setdefault(record.index, record)
    lines.rest  # noqa: B018  (closes the file)
    return out


def _rewrite_spill(path: Path, kept: list[Record], limit: int) -> int:
    """Leave the spill holding exactly `kept`, in its order (cut to `limit`, or rewritten if
    that is not the same); returns its size."""
    data = b"".join(r.spill_line() for r in kept)
    if limit == len(data) and (not limit or _head(path, limit) == data):
        _cut(path, limit)
        return limit
    from batchrun.io.files import write_atomic

    write_atomic(path, data)
    return len(data)


def _head(path: Path, n: int) -> bytes:
    with open(path, "rb") as f:
        return f.read(n)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _cut(path: Path, size: int) -> None:
    """Truncate `path` to `size` bytes (creating it empty if absent), durably."""
    with open_append(path) as f:
        if f.seek(0, os.SEEK_END) != size:
            f.truncate(size)
            f.flush()
            os.fsync(f.fileno())


def _counted(progress: Progress) -> dict:
    """What state.json must agree with the files on (the spill is compacted on resume: rows
    it held that reached the ordered files are dropped from it; digests: `_edited`)."""
    return {k: v for k, v in dataclasses.asdict(progress).items()
            if k != "spill_bytes" and k not in DIGESTS}


def _edited(saved: Progress, found: Progress, state: JobState) -> list[str]:
    """The ordered files whose committed bytes were changed in place (records that still read
    as records: kept, but said). Only where state.json has a digest and the sizes agree."""
    out = []
    for path, size, digest in ((state.results_path, "results_bytes", "results_sha256"),
                               (state.errors_path, "errors_bytes", "errors_sha256")):
        want = getattr(saved, digest)
        if want and getattr(saved, size) == getattr(found, size) \
                and want != getattr(found, digest):
            out.append(f"{path.name} was changed after it was written (its records still read "
                       "as this job's)")
    return out


def _difference(saved: Progress, found: Progress) -> str:
    a, b = _counted(saved), _counted(found)
    changed = ", ".join(f"{k} {a[k]:,} -> {b[k]:,}" for k in a if a[k] != b[k])
    return f"state.json disagreed with the files ({changed})"


def ordered_records(results: Path, errors: Path, rows: Iterator[RawRow] | None = None
                    ) -> Iterator[dict]:
    """Every written row's record in input order, merging the ordered results and errors
    files: an error record names its row's index, or (OpenAI's error lines) its input line,
    matched against the input's `rows` as they go by; the rows between are results."""
    res, err = _records(results), _records(errors)
    pending_error = next(err, None)
    positions = ((raw.index, raw.line) for raw in rows) if rows is not None else \
        ((i, None) for i in itertools.count())
    for index, line in positions:
        if pending_error is not None and names_row(pending_error, index, line):
            yield pending_error
            pending_error = next(err, None)
            continue
        record = next(res, None)
        if record is None:
            return
        yield record


def _records(path: Path) -> Iterator[dict]:
    if not path.exists():
        return
    with open(path, "rb") as f:
        for line in f:
            if line.endswith(b"\n"):
                yield orjson.loads(line)
