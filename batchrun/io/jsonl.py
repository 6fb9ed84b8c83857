"""Stream JSONL input (plain or gzip) as numbered rows, never holding the file in memory.

Every non-blank line becomes exactly one RawRow: a parsed value, or the reason it could not be
parsed. Blank lines are skipped but still counted, so `line` is the 1-based line in the file.
"""

from __future__ import annotations

import gzip
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


def open_binary(path: str | Path):
    path = Path(path)
    if path.name.endswith(".gz"):
        return gzip.open(path, "rb")
    return open(path, "rb")


def read_jsonl(path: str | Path, start: int = 0) -> Iterator[RawRow]:
    """Rows from index `start` on; earlier rows are skipped without being parsed."""
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
