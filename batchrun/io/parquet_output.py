"""Parquet output written as the job goes: every input row exactly once, in input order, with
every column seen in any row.

The schema is fixed before any compute. Parquet input keeps its own; JSONL input is pre-scanned
(streaming) for the union of its columns in order of first appearance, one type per column:
a column whose values change type is a string column. Row groups of BATCH_ROWS rows are appended
to a temp file beside the output (created exclusively under a random name, never through a
link) as the committed prefix of the job's ordered results and errors
files grows; `finish` replaces the output with it atomically. A resumed job starts a new
ParquetOutput from row 0, so the file never depends on where earlier runs stopped.
"""

from __future__ import annotations

import glob
import os
import stat
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import IO

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from batchrun.io.files import fsync_folder, temp_beside
from batchrun.io.jsonl import InputError, names_row
from batchrun.io.parquet import BATCH_ROWS  # rows per row group: the most rows held at once
from batchrun.io.readers import is_parquet, read_rows

RESULT_COLUMNS = (
    ("text", pa.string()),
    ("finish_reason", pa.string()),
    ("prompt_tokens", pa.int64()),
    ("completion_tokens", pa.int64()),
    ("cached_tokens", pa.int64()),
    ("error", pa.string()),
)
# Always present (null where unused): any row may ask for choices or n > 1 itself, and the
# schema must be fixed before the first row group is written.
OPTIONAL_COLUMNS = (
    ("choice_probs", pa.map_(pa.string(), pa.float64())),
    ("samples", pa.list_(pa.string())),
    ("reasoning", pa.string()),  # a reasoning model's thinking block
    ("tool_calls", pa.string()),  # JSON: [{"name", "arguments"}], arguments as JSON text
)
OUTPUT_COLUMNS = RESULT_COLUMNS + OPTIONAL_COLUMNS

INT64_MAX = 2**63 - 1
EXACT_FLOAT_INT = 2**53  # every int of at most this size is exact as a float64


class ParquetOutput:
    """The input rows joined with their result or error records, one row group at a time.

    `results` and `errors` are the job's ordered JSONL files: appended in input order, holding
    at least the committed prefix of rows. Construct before any work (it pre-scans the input
    and raises ValueError with a one-line message), `advance` after each commit, `finish` at the
    end, `close` on failure.
    """

    def __init__(self, input_path: Path, out: Path, results: Path, errors: Path):
        self.out = Path(out)
        if self.out.is_dir():
            raise ValueError(f"cannot write {self.out}: it is a folder")
        if not self.out.parent.is_dir():
            raise ValueError(f"cannot write {self.out}: folder {self.out.parent} does not exist")
        self.tmp: Path | None = None  # created with the first row group
        self._tmp_file: IO[bytes] | None = None
        _remove_stale_partials(self.out)
        if is_parquet(input_path):
            self._input: _ParquetRows | _JsonlRows = _ParquetRows(Path(input_path))
        else:
            self._input = _JsonlRows(Path(input_path))
        source = self._input.schema
        names = result_column_names(source.names)
        self.schema = pa.schema([*source, *(pa.field(names[n], t) for n, t in OUTPUT_COLUMNS)],
                                metadata=source.metadata)
        self._records = _CommittedRecords(Path(results), Path(errors))
        self._writer: pq.ParquetWriter | None = None
        self.rows_written = 0
        self._closed = False

    def advance(self, committed_rows: int) -> None:
        """Write every whole row group of the rows before `committed_rows`."""
        while committed_rows - self.rows_written >= BATCH_ROWS:
            if self._write_group() < BATCH_ROWS:
                raise RuntimeError(f"{committed_rows} rows are committed but the input has "
                                   f"only {self.rows_written}")

    def finish(self) -> None:
        """Write the remaining rows (all must be committed) and atomically replace `out`."""
        while self._write_group() == BATCH_ROWS:
            pass
        if self._writer is None:  # an input without rows: still a file with the schema
            self._open_writer()
        self._writer.close()
        self._writer = None
        self._tmp_file.flush()
        os.fsync(self._tmp_file.fileno())
        self._tmp_file.close()
        os.replace(self.tmp, self.out)
        self.tmp = None
        fsync_folder(self.out.parent)
        self.close()

    def close(self) -> None:
        """Abandon the output: release the files and remove the temp file. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._input.close()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._tmp_file is not None:
            self._tmp_file.close()
        if self.tmp is not None:
            self.tmp.unlink(missing_ok=True)

    def _open_writer(self) -> None:
        fd, name = temp_beside(self.out, PARTIAL)  # the umask's mode, as the other files
        self.tmp = Path(name)
        self._tmp_file = os.fdopen(fd, "wb")
        self._writer = pq.ParquetWriter(self._tmp_file, self.schema)

    def _write_group(self) -> int:
        """Append the next row group of up to BATCH_ROWS rows; returns how many it holds."""
        if self._closed:
            raise RuntimeError(f"the Parquet output {self.out} is already closed")
        rows = self._input.take(BATCH_ROWS)
        if rows.num_rows == 0:
            return 0
        records = self._records.take(rows.num_rows, self._input.lines)
        results = [pa.array([r.get(name) for r in records], type_)
                   for name, type_ in OUTPUT_COLUMNS]
        table = pa.Table.from_arrays([*rows.columns, *results], schema=self.schema)
        if self._writer is None:
            self._open_writer()
        self._writer.write_table(table, row_group_size=BATCH_ROWS)
        self.rows_written += table.num_rows
        return table.num_rows


def write_parquet_output(input_path: Path, results: Path, errors: Path, out: Path) -> None:
    """Join a finished job's input rows with their results into one Parquet file at once."""
    output = ParquetOutput(input_path, out, results, errors)
    try:
        output.finish()
    finally:
        output.close()


def result_column_names(input_columns: list[str],
                        columns: tuple = OUTPUT_COLUMNS) -> dict[str, str]:
    """Result column -> output name; prefixed with `result_` where the input has the name."""
    taken = set(input_columns)
    return {name: f"result_{name}" if name in taken else name for name, _ in columns}


# -- input rows ------------------------------------------------------------------------------


class _ParquetRows:
    """Parquet input as tables of its own schema, exactly n rows at a time."""

    def __init__(self, path: Path):
        try:
            self._file = pq.ParquetFile(path)
        except (OSError, pa.ArrowException) as e:
            raise ValueError(f"cannot read {path}: {_one_line(e)}") from None
        self.schema = self._file.schema_arrow
        self._batches = self._file.iter_batches(batch_size=BATCH_ROWS)
        self._rest: pa.RecordBatch | None = None
        self._taken = 0
        self.lines: list[int] = []  # the last take's rows' line numbers (a row's is index + 1)

    def take(self, n: int) -> pa.Table:
        parts, have = [], 0
        while have < n:
            if self._rest is None or self._rest.num_rows == 0:
                self._rest = next(self._batches, None)
                if self._rest is None:
                    break
            part = self._rest.slice(0, n - have)
            self._rest = self._rest.slice(part.num_rows)
            parts.append(part)
            have += part.num_rows
        self.lines = list(range(self._taken + 1, self._taken + have + 1))
        self._taken += have
        return pa.Table.from_batches(parts, schema=self.schema)

    def close(self) -> None:
        self._file.close()


class _JsonlRows:
    """JSONL (or CSV, TSV) input as tables of the pre-scanned schema. A line that is not a
    JSON object (invalid JSON, a list, a number...), or a record that cannot be a row, is a row
    of nulls."""

    def __init__(self, path: Path):
        self.path = path
        self.schema = scan_jsonl_schema(path)
        self._rows = read_rows(path)
        self.lines: list[int] = []  # the last take's rows' lines

    def take(self, n: int) -> pa.Table:
        raws = list(islice(self._rows, n))
        self.lines = [r.line for r in raws]
        rows = [_row_value(r) for r in raws]
        arrays = []
        for f in self.schema:
            values = [row.get(f.name) for row in rows]
            if f.type == pa.string():
                values = [_text(v) for v in values]
            try:
                arrays.append(pa.array(values, f.type))
            except (pa.ArrowException, TypeError, OverflowError):
                raise ValueError(f"{self.path} changed while the job ran: column {f.name!r} "
                                 f"no longer holds {f.type} values; run the job again") from None
        return pa.Table.from_arrays(arrays, schema=self.schema)

    def close(self) -> None:
        self._rows.close()


@dataclass(slots=True)
class _Seen:
    """What one JSONL column held across the whole input."""

    types: set[type] = field(default_factory=set)
    wide_int: bool = False  # an int beyond int64 (up to uint64, as orjson reads it)
    big_int: bool = False  # an int beyond +-2**53, where float64 stops holding every int

    def arrow_type(self) -> pa.DataType:
        types = self.types - {type(None)}
        if types == {bool}:
            return pa.bool_()
        if types == {int} and not self.wide_int:
            return pa.int64()
        if types == {float} or (types == {int, float} and not self.big_int):
            return pa.float64()
        # Strings, objects and lists (JSON text), mixed types, and columns only ever null.
        return pa.string()


def _row_value(raw) -> dict:
    """A row's columns: none for a line that is not an object, nor for a CSV record that
    could not be a row (the fields read of it name its error record, they are not data)."""
    if type(raw.value) is not dict or (raw.error is not None and raw.code == "invalid_row"):
        return {}
    return raw.value


def scan_jsonl_schema(path: Path) -> pa.Schema:
    """Every column of any row, in order of first appearance, each with the one Arrow type
    that holds all its values; streams the file, keeping only per-column facts."""
    columns: dict[str, _Seen] = {}
    try:
        for raw in read_rows(path):
            for name, v in _row_value(raw).items():
                seen = columns.get(name)
                if seen is None:
                    seen = columns[name] = _Seen()
                t = type(v)
                seen.types.add(t)
                if t is int and not -EXACT_FLOAT_INT <= v <= EXACT_FLOAT_INT:
                    seen.big_int = True
                    seen.wide_int |= v > INT64_MAX
    except InputError as e:  # names the file and the problem in one line
        raise ValueError(str(e)) from None
    return pa.schema([pa.field(name, seen.arrow_type()) for name, seen in columns.items()])


def _text(v) -> str | None:
    """A string column's value: strings as they are, anything else as its JSON text."""
    if v is None or type(v) is str:
        return v
    return orjson.dumps(v).decode()


# -- result and error records ----------------------------------------------------------------


class _JsonlTail:
    """A JSONL file being appended to, read on from where the last read stopped; only whole
    lines (a line still being written is left for the next read)."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0
        self._f: IO[bytes] | None = None

    def __enter__(self) -> _JsonlTail:
        if self.path.exists():
            self._f = open(self.path, "rb")  # noqa: SIM115  (closed by __exit__)
            self._f.seek(self.offset)
        return self

    def __exit__(self, *exc) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

    def next(self) -> dict | None:
        while self._f is not None:
            line = self._f.readline()
            if not line.endswith(b"\n"):
                self._f.seek(self.offset)
                return None
            self.offset += len(line)
            if line.strip():
                return orjson.loads(line)
        return None


class _CommittedRecords:
    """Flat result records, one per input row in order, merged from the ordered results and
    errors files: row i is an error if the next error record's index is i, else the next
    result (OpenAI-shaped results carry no index)."""

    def __init__(self, results: Path, errors: Path):
        self._results = _JsonlTail(results)
        self._errors = _JsonlTail(errors)
        self._next_error: dict | None = None
        self.index = 0  # the next row to take

    def take(self, n: int, lines: list[int]) -> list[dict]:
        """The next n rows' records; `lines`, the rows' input lines, place error records
        that name a line instead of an index (OpenAI's)."""
        out = []
        with self._results, self._errors:
            for line in lines[:n]:
                out.append(self._next(line))
                self.index += 1
        return out

    def _next(self, line: int) -> dict:
        if self._next_error is None:
            self._next_error = self._errors.next()
        e = self._next_error
        if e is not None and names_row(e, self.index, line):
            self._next_error = None
            return {"error": f"{e['error']['code']}: {e['error']['message']}"}
        if e is not None and "index" in e and not (isinstance(e["index"], int)
                                                   and e["index"] > self.index):
            raise RuntimeError(f"{self._errors.path} is out of order: record "
                               f"{e.get('index')!r} where row {self.index} was expected")
        r = self._results.next()
        if r is None:
            raise RuntimeError(f"row {self.index} has no committed record in "
                               f"{self._results.path} or {self._errors.path}")
        return flat_result(r)


def flat_result(r: dict) -> dict:
    """text, finish_reason, usage (and choice_probs, samples) of a result line, native or
    OpenAI-shaped."""
    if "response" in r:
        body = (r.get("response") or {}).get("body") or {}
        choices = body.get("choices") or [{}]
        choice = choices[0]
        text = (choice.get("message") or {}).get("content", choice.get("text"))
        usage = body.get("usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        usage = {**usage, "cached_tokens": cached}
        finish = choice.get("finish_reason")
        probs = choice.get("choice_probs")
        samples = [(c.get("message") or {}).get("content", c.get("text")) for c in choices] \
            if len(choices) > 1 else None
        message = choice.get("message") or {}
        reasoning = message.get("reasoning", message.get("reasoning_content"))
        calls = [c.get("function") for c in message.get("tool_calls") or []] or None
    else:
        text, finish, usage = r.get("text"), r.get("finish_reason"), r.get("usage") or {}
        probs = r.get("choice_probs")
        samples = [s["text"] for s in r["samples"]] if r.get("samples") else None
        reasoning, calls = r.get("reasoning"), r.get("tool_calls")
    return {"text": text, "finish_reason": finish, "prompt_tokens": usage.get("prompt_tokens"),
            "completion_tokens": usage.get("completion_tokens"),
            "cached_tokens": usage.get("cached_tokens"), "error": None,
            "choice_probs": list(probs.items()) if probs else None, "samples": samples,
            "reasoning": reasoning,
            "tool_calls": orjson.dumps(calls).decode() if calls else None}


def _one_line(e: BaseException) -> str:
    text = (getattr(e, "strerror", None) or str(e)).strip()
    return text.splitlines()[0] if text else type(e).__name__


PARTIAL = ".partial"


def _remove_stale_partials(out: Path) -> None:
    """Temp files an earlier, killed run of this output's job left (the job owns the output and
    holds its lock, so no one else writes them)."""
    pattern = f".{glob.escape(out.name)}.*{PARTIAL[1:]}"  # also the old fixed name
    for path in out.parent.glob(pattern):
        try:
            if stat.S_ISREG(os.lstat(path).st_mode) or path.is_symlink():
                path.unlink()
        except OSError:
            pass  # not ours to remove after all; it does no harm

