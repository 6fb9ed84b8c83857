"""Parquet input read in streaming record batches. Parquet output lives in parquet_output.py."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from batchrun.io.jsonl import InputError, RawRow, too_deep, too_deep_row

BATCH_ROWS = 1024


@contextlib.contextmanager
def _reading(path: Path):
    """A damaged or unreadable Parquet file is one InputError naming it."""
    try:
        yield
    except (pa.ArrowException, OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError(f"{path} is not a readable Parquet file ({first[:200]})") from None


def count_parquet(path: str | Path) -> int:
    with _reading(Path(path)):
        return pq.ParquetFile(path).metadata.num_rows


def read_parquet(path: str | Path, start: int = 0) -> Iterator[RawRow]:
    """Rows as dicts of Python values, from index `start` on, a record batch at a time."""
    with _reading(Path(path)):
        yield from _rows(path, start)


def _rows(path: str | Path, start: int) -> Iterator[RawRow]:
    index = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=BATCH_ROWS):
        if index + batch.num_rows <= start:
            index += batch.num_rows
            continue
        for row in batch.to_pylist():
            if index >= start:
                # Parquet has no lines; `line` is the 1-based row number.
                yield too_deep_row(index, index + 1, row) if too_deep(row) \
                    else RawRow(index, index + 1, row)
            index += 1
