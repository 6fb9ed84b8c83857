"""CSV and TSV input: a header row, then a row a record, read a block at a time by pyarrow's
streaming CSV reader (quoted fields may hold delimiters and newlines; .gz and other
compressions by suffix).

A record whose number of fields is not the header's, or whose text is not UTF-8, is its own
row's error; the rows around it are read as usual. Every column is read as bytes first (so no
value can fail a whole block's conversion), then typed a column at a time over the whole file:
a column whose every non-empty value is an integer (no leading zeros: an id like 007 stays text)
is read as integers, else one of numbers as floats, else one of true/false as booleans, else
text. An empty cell is null in a typed column and "" in a text one. The types are worked out
by the same pass that counts the rows, so every read of the file (count, resume, run) agrees.

A row's `line` is its record's number as a spreadsheet shows it (the header is 1).
"""

from __future__ import annotations

import contextlib
import csv
import io
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.csv as pacsv

from batchrun.io.jsonl import MAX_LINE_BYTES, InputError, RawRow

# A block pyarrow parses at once; a record must fit in one: the row-bytes limit's default
BLOCK_BYTES = MAX_LINE_BYTES
DELIMITERS = {"csv": ",", "tsv": "\t"}
_INTEGER = re.compile(rb"[+-]?(0|[1-9][0-9]*)")
_LEADING_ZERO = re.compile(rb"[+-]?0[0-9]")  # 007, 0123.5: codes, kept as text
_BOOLEANS = {b"true": True, b"false": False}
# (rows, column types) by (path, size, mtime, format): worked out once a process for a file.
_scanned: dict[tuple, tuple[int, dict[str, str]]] = {}


@contextlib.contextmanager
def _reading(path: Path, fmt: str):
    """A file that cannot be read as CSV as a whole is one InputError naming it."""
    try:
        yield
    except (pa.ArrowException, OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "straddl" in first:  # pyarrow: a record longer than a block
            first = f"a record is over {BLOCK_BYTES >> 20} MiB"
        raise InputError(f"{path} is not a readable {fmt.upper()} file ({first[:200]})") \
            from None


def _records(path: Path, fmt: str, bad: list[tuple]) -> Iterator[pa.RecordBatch]:
    """The file's record batches, every column as bytes; records with the wrong number of
    fields are skipped into `bad` as (record number, reason, their fields by name)."""
    def invalid(row) -> str:
        # a number is always known to a reader on one thread; -1 keeps the row counted
        number = row.number if row.number is not None else -1
        bad.append((number, f"has {row.actual_columns} fields where the header has "
                            f"{row.expected_columns}", _salvaged(row.text, names, fmt)))
        return "skip"

    with pa.input_stream(str(path), compression="detect") as stream:
        head = pacsv.open_csv(
            stream, read_options=pacsv.ReadOptions(use_threads=False, block_size=BLOCK_BYTES),
            parse_options=pacsv.ParseOptions(delimiter=DELIMITERS[fmt], newlines_in_values=True,
                                             invalid_row_handler=lambda row: "skip"))
        names = head.schema.names
    if len(set(names)) != len(names):
        repeated = sorted({n for n in names if names.count(n) > 1})
        raise InputError(f"{path}: its header names a column twice ({', '.join(repeated)[:200]})")
    with pa.input_stream(str(path), compression="detect") as stream:
        reader = pacsv.open_csv(
            stream, read_options=pacsv.ReadOptions(use_threads=False, block_size=BLOCK_BYTES),
            parse_options=pacsv.ParseOptions(delimiter=DELIMITERS[fmt], newlines_in_values=True,
                                             invalid_row_handler=invalid),
            convert_options=pacsv.ConvertOptions(
                column_types={n: pa.binary() for n in names}, strings_can_be_null=False,
                quoted_strings_can_be_null=False))
        yield from reader


def _empty(path: Path) -> bool:
    with pa.input_stream(str(path), compression="detect") as stream:
        return not stream.read(4096).strip()


def column_kinds(path: str | Path, fmt: str) -> dict[str, str]:
    """Each column's type ("int", "float", "bool" or "str") over the whole file."""
    return _scan(Path(path), fmt)[1]


def _scan(path: Path, fmt: str) -> tuple[int, dict[str, str]]:
    """(rows, each column's type): one pass over the file, kept for the process while the
    file's size and time are the same (the count, a resume's read and the run's agree)."""
    kinds: dict[str, set[str]] = {}
    rows = 0
    bad: list[tuple] = []
    with _reading(path, fmt):
        st = os.stat(path)
        key = (os.path.abspath(path), st.st_size, st.st_mtime_ns, fmt)
        if key in _scanned:
            return _scanned[key]
        if _empty(path):
            return 0, {}
        for batch in _records(path, fmt, bad):
            rows += batch.num_rows
            for name, column in zip(batch.schema.names, batch.columns, strict=True):
                left = kinds.setdefault(name, {"int", "float", "bool"})
                for value in column.to_pylist():
                    if not left:
                        break
                    if value:
                        left &= _could_be(value)
    result = {name: next((k for k in ("int", "float", "bool") if k in left), "str")
              for name, left in kinds.items()}
    _scanned[key] = rows + len(bad), result
    return _scanned[key]


def _could_be(value: bytes) -> set[str]:
    kinds: set[str] = set()
    if _LEADING_ZERO.match(value):
        return kinds
    if _INTEGER.fullmatch(value) and -(1 << 63) <= int(value) < (1 << 63):
        kinds.add("int")
    with contextlib.suppress(ValueError):
        if math.isfinite(float(value)):
            kinds.add("float")
    if value.lower() in _BOOLEANS:
        kinds.add("bool")
    return kinds


def count_delimited(path: str | Path, fmt: str) -> int:
    """Rows in the file (records after the header, good or not)."""
    return _scan(Path(path), fmt)[0]


def read_delimited(path: str | Path, fmt: str, start: int = 0) -> Iterator[RawRow]:
    """Rows as dicts of typed values, from index `start` on; a record that cannot be a row is
    its row's error."""
    path = Path(path)
    kinds = column_kinds(path, fmt)
    if not kinds:
        return
    bad: list[tuple] = []
    index = 0
    with _reading(path, fmt):
        for batch in _records(path, fmt, bad):
            names = batch.schema.names
            for values in zip(*(c.to_pylist() for c in batch.columns), strict=True):
                index = yield from _bad_before(bad, index, start, len(kinds))
                if index >= start:
                    yield _row(index, names, values, kinds)
                index += 1
        yield from _bad_before(bad, index, start, len(kinds), every=True)


def _bad_before(bad: list[tuple], index: int, start: int, columns: int,
                every: bool = False):
    """Error rows for the skipped records numbered before row `index` (all of them with
    `every`); returns the index past them."""
    bad.sort(key=lambda entry: entry[0])
    while bad and (every or bad[0][0] - 2 <= index):
        number, reason, fields = bad.pop(0)
        if index >= start:
            yield RawRow(index, number, fields, f"record {number} {reason}", "invalid_row")
        index += 1
    return index


def _salvaged(text: str, names: list[str], fmt: str) -> dict[str, str] | None:
    """A bad record's fields by the header's names, as text (for its error record's id: a
    row's id column read as the good rows' are), or None if even that fails."""
    try:
        fields = next(csv.reader(io.StringIO(text), delimiter=DELIMITERS[fmt]), [])
    except (csv.Error, ValueError):
        return None
    return {name: value for name, value in zip(names, fields, strict=False)}


def _row(index: int, names: list[str], values: tuple, kinds: dict[str, str]) -> RawRow:
    row: dict[str, Any] = {}
    for name, value in zip(names, values, strict=True):
        kind = kinds.get(name, "str")
        if kind == "str":
            try:
                row[name] = value.decode("utf-8")
            except UnicodeDecodeError:
                return RawRow(index, index + 2, None, f"column {name!r} is not UTF-8 text",
                              "invalid_row")
        elif not value:
            row[name] = None
        elif kind == "int":
            row[name] = int(value)
        elif kind == "float":
            row[name] = float(value)
        else:
            row[name] = _BOOLEANS[value.lower()]
    return RawRow(index, index + 2, row)
