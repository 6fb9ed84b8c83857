"""An input file as numbered rows, whatever its format (JSONL, .jsonl.gz, Parquet)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from batchrun.io.jsonl import RawRow, count_jsonl, read_jsonl
from batchrun.io.parquet import count_parquet, read_parquet


def is_parquet(path: Path) -> bool:
    return Path(path).name.lower().endswith(".parquet")


def count_rows(path: Path) -> int:
    """Rows in the input; raises InputError if it is damaged (truncated, not the format)."""
    return count_parquet(path) if is_parquet(path) else count_jsonl(path)


def read_rows(path: Path, start: int = 0) -> Iterator[RawRow]:
    """Rows from index `start` on; raises InputError if the file turns out damaged."""
    return read_parquet(path, start) if is_parquet(path) else read_jsonl(path, start)
