"""Parquet input read in streaming record batches. Parquet output lives in parquet_output.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq

from batchrun.io.jsonl import RawRow

BATCH_ROWS = 1024


def count_parquet(path: str | Path) -> int:
    return pq.ParquetFile(path).metadata.num_rows


def read_parquet(path: str | Path, start: int = 0) -> Iterator[RawRow]:
    """Rows as dicts of Python values, from index `start` on, a record batch at a time."""
    index = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=BATCH_ROWS):
        if index + batch.num_rows <= start:
            index += batch.num_rows
            continue
        for row in batch.to_pylist():
            if index >= start:
                # Parquet has no lines; `line` is the 1-based row number.
                yield RawRow(index, index + 1, row)
            index += 1


def write_parquet_output(input_path: Path, results: Path, errors: Path, out: Path) -> None:
    """The whole output at the end of a job; runner.py's import until it drives
    parquet_output.ParquetOutput itself (imported here, not at the top: that module imports
    this one)."""
    from batchrun.io.parquet_output import write_parquet_output as write

    write(input_path, results, errors, out)
