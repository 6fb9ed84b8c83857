"""Stream JSONL input (plain or gzip) as numbered rows, never holding the file in memory.

Every non-blank line becomes exactly one RawRow: a parsed value, or the reason it could not be
parsed. Blank lines are skipped but still counted, so `line` is the 1-based line in the file.
A file that cannot be read to its end (a truncated or corrupt .gz, an I/O error) raises
InputError, whose message names the file and the problem.

No line is held in memory past `max_line` bytes (a gzip file of a few MB can hold a line of
GBs): a longer line is skipped in pieces and becomes a row whose error gives its size. A value
nested deeper than MAX_DEPTH (which would exhaust Python's recursion when printed or compiled)
is its row's error too.
"""

from __future__ import annotations

import contextlib
import gzip
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson


@dataclass(slots=True)
class RawRow:
    index: int  # 0-based among non-blank lines: the row's position in the output
    line: int  # 1-based line number in the file
    value: Any = None  # with an error: None, or the row's top-level scalars (its id)
    error: str | None = None
    code: str = "invalid_json"  # the error record's code


def record_line(record: dict) -> int | None:
    """The input line an error record names: top level in batchrun's, in `error` in OpenAI's
    (its batch error file's shape)."""
    line = record.get("line")
    if line is None and isinstance(record.get("error"), dict):
        line = record["error"].get("line")
    return line if type(line) is int else None


def names_row(record: dict, index: int, line: int | None) -> bool:
    """Whether an error record is row `index`'s: by its index (batchrun's records), else by
    its input `line` (OpenAI's error lines carry no index)."""
    if "index" in record:
        return record["index"] == index
    return line is not None and record_line(record) == line


class InputError(Exception):
    """The input file as a whole cannot be read; str() names the file and the problem."""


GZIP_MAGIC = b"\x1f\x8b"
MAX_LINE_BYTES = 64 << 20  # a row's line, unless the job sets --limit row-bytes
MAX_DEPTH = 100  # levels of lists and objects in one row
_SKIP_CHUNK = 1 << 20


def open_binary(path: str | Path):
    """The file's bytes, decompressed when it is gzip: by its suffix, or by its first bytes
    (a file read as JSONL whatever its name, `--format jsonl`; JSON text never starts so)."""
    path = Path(path)
    if path.name.lower().endswith(".gz"):
        return gzip.open(path, "rb")
    with open(path, "rb") as f:
        gzipped = is_gzip_header(f.read(10))
    return gzip.open(path, "rb") if gzipped else open(path, "rb")


def is_gzip_header(head: bytes) -> bool:
    """A whole gzip member header: magic, deflate, no reserved flag bits (RFC 1952)."""
    return len(head) >= 10 and head[:3] == GZIP_MAGIC + b"\x08" and not head[3] & 0xE0


@contextlib.contextmanager
def _reading(path: Path):
    """Turn a damaged file's read errors into one InputError naming it."""
    try:
        yield
    except EOFError:
        raise InputError(f"{path} is damaged: the compressed data ends early (truncated?)") \
            from None
    except (gzip.BadGzipFile, zlib.error) as e:
        raise InputError(f"{path} is damaged: not valid gzip data ({e})") from None
    except OSError as e:
        raise InputError(f"{path} cannot be read: {e.strerror or e}") from None


def count_jsonl(path: str | Path, max_line: int = MAX_LINE_BYTES) -> int:
    """Non-blank lines: the rows of the file (a line over `max_line` bytes is one)."""
    with _reading(Path(path)), open_binary(path) as f:
        return sum(1 for raw, _ in _lines(f, max_line) if raw is None or raw.strip())


def read_jsonl(path: str | Path, start: int = 0,
               max_line: int = MAX_LINE_BYTES) -> Iterator[RawRow]:
    """Rows from index `start` on; earlier rows are skipped without being parsed."""
    with _reading(Path(path)):
        yield from _rows(path, start, max_line)


def _rows(path: str | Path, start: int, max_line: int) -> Iterator[RawRow]:
    index = 0
    with open_binary(path) as f:
        for line_no, (raw, size) in enumerate(_lines(f, max_line), start=1):
            if raw is not None and not raw.strip():
                continue
            if index < start:
                index += 1
                continue
            if raw is None:
                yield RawRow(index, line_no, error=f"the line is {size:,} bytes, over the limit "
                             f"of {max_line:,} (--limit row-bytes=N raises it)",
                             code="row_too_large")
            else:
                yield _parsed(index, line_no, raw)
            index += 1


def _lines(f, max_line: int) -> Iterator[tuple[bytes | None, int]]:
    """Each line and its size; None in place of a line over `max_line` bytes (never read
    whole)."""
    while raw := f.readline(max_line + 1):
        if len(raw) <= max_line or raw.endswith(b"\n"):
            yield raw, len(raw)
            continue
        size = len(raw)
        del raw
        while (piece := f.readline(_SKIP_CHUNK)) and not piece.endswith(b"\n"):
            size += len(piece)
        yield None, size + len(piece)


def _parsed(index: int, line_no: int, raw: bytes) -> RawRow:
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        return RawRow(index, line_no, error=_describe(e, raw))
    if too_deep(value):
        return too_deep_row(index, line_no, value)
    return RawRow(index, line_no, value)


def too_deep_row(index: int, line_no: int, value: Any) -> RawRow:
    """The error row of a value nested past MAX_DEPTH, keeping its top-level scalars (its id:
    the error record names the row as its other records would)."""
    scalars = {k: v for k, v in value.items() if not isinstance(v, (dict, list))} \
        if isinstance(value, dict) else None
    return RawRow(index, line_no, scalars, f"the row nests lists and objects more than "
                  f"{MAX_DEPTH} levels deep", "too_deep")


def too_deep(value: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether `value` nests lists and objects more than `limit` levels (walked without
    recursion, stopping at the first level past the limit)."""
    level = [value] if isinstance(value, (dict, list)) else []
    for _ in range(limit):
        below = []
        for item in level:
            children = item.values() if isinstance(item, dict) else item
            below.extend(c for c in children if isinstance(c, (dict, list)))
        if not below:
            return False
        level = below
    return True


def _describe(e: orjson.JSONDecodeError, raw: bytes) -> str:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as u:
        return f"the line is not valid UTF-8 (byte {u.start})"
    return f"the line is not valid JSON: {e.msg} at column {e.colno}"
