"""Stream JSONL input (plain or gzip) as numbered rows, never holding the file in memory.

Every non-blank line becomes exactly one RawRow: a parsed value, or the reason it could not be
parsed. Blank lines are skipped but still counted, so `line` is the 1-based line in the file.
A file that cannot be read to its end (a truncated or corrupt .gz, an I/O error) raises
InputError, whose message names the file and the problem.
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
    value: Any = None
    error: str | None = None


class InputError(Exception):
    """The input file as a whole cannot be read; str() names the file and the problem."""


GZIP_MAGIC = b"\x1f\x8b"


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


def count_jsonl(path: str | Path) -> int:
    """Non-blank lines: the rows of the file."""
    with _reading(Path(path)), open_binary(path) as f:
        return sum(1 for line in f if line.strip())


def read_jsonl(path: str | Path, start: int = 0) -> Iterator[RawRow]:
    """Rows from index `start` on; earlier rows are skipped without being parsed."""
    with _reading(Path(path)):
        yield from _rows(path, start)


def _rows(path: str | Path, start: int) -> Iterator[RawRow]:
    index = 0
    with open_binary(path) as f:
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            if index < start:
                index += 1
                continue
            try:
                yield RawRow(index, line_no, orjson.loads(raw))
            except orjson.JSONDecodeError as e:
                yield RawRow(index, line_no, error=_describe(e, raw))
            index += 1


def _describe(e: orjson.JSONDecodeError, raw: bytes) -> str:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as u:
        return f"the line is not valid UTF-8 (byte {u.start})"
    return f"the line is not valid JSON: {e.msg} at column {e.colno}"
