"""An input file as numbered rows, whatever its format (JSONL, .jsonl.gz, Parquet, CSV, TSV),
and rows read from stdin spooled into a file first (a job reads its input more than once: to
count, to check a resume against the files, to run).

The format comes from the file's suffix unless `declare_format` forced one for that file
(`--format`); a file with neither is Parquet if it starts with Parquet's magic bytes (rows piped
to stdin), else JSONL, read as gzip whenever its bytes are (jsonl.open_binary).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from batchrun.io.delimited import count_delimited, read_delimited
from batchrun.io.files import replace_new
from batchrun.io.jsonl import MAX_LINE_BYTES, RawRow, count_jsonl, read_jsonl
from batchrun.io.parquet import count_parquet, read_parquet

FORMATS = ("jsonl", "parquet", "csv", "tsv")
# Suffixes (lowercase) that name a format; anything else is JSONL where a format is not given.
SUFFIXES = {".parquet": "parquet", ".csv": "csv", ".tsv": "tsv", ".csv.gz": "csv",
            ".tsv.gz": "tsv"}
PARQUET_MAGIC = b"PAR1"
SPOOL_CHUNK = 1 << 20
# Input files whose format was given (--format), by absolute path: every reader of the file in
# this process (the job runner, the Parquet output's scan) then agrees on it.
_declared: dict[str, str] = {}


def declare_format(path: Path, fmt: str) -> None:
    """Read `path` as `fmt` (one of FORMATS) whatever its suffix."""
    if fmt not in FORMATS:
        raise ValueError(f"the input format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    _declared[_key(path)] = fmt


def input_format(path: Path) -> str:
    """One of FORMATS: the declared format, else the suffix's, else "jsonl"."""
    declared = _declared.get(_key(path))
    if declared is not None:
        return declared
    name = Path(path).name.lower()
    by_suffix = next((fmt for suffix, fmt in SUFFIXES.items() if name.endswith(suffix)), None)
    return by_suffix or sniff_format(path) or "jsonl"


def is_parquet(path: Path) -> bool:
    return input_format(path) == "parquet"


def count_rows(path: Path, max_line: int = MAX_LINE_BYTES) -> int:
    """Rows in the input; raises InputError if it is damaged (truncated, not the format).
    `max_line`: bytes past which a JSONL line is a row in error, whatever it holds."""
    fmt = input_format(path)
    if fmt in ("csv", "tsv"):
        return count_delimited(path, fmt)
    return count_parquet(path) if fmt == "parquet" else count_jsonl(path, max_line)


def read_rows(path: Path, start: int = 0, max_line: int = MAX_LINE_BYTES) -> Iterator[RawRow]:
    """Rows from index `start` on; raises InputError if the file turns out damaged."""
    fmt = input_format(path)
    if fmt in ("csv", "tsv"):
        return read_delimited(path, fmt, start)
    return read_parquet(path, start) if fmt == "parquet" else read_jsonl(path, start, max_line)


def sniff_format(path: Path) -> str | None:
    """"parquet" for a file that starts with Parquet's magic bytes (rows piped to stdin carry
    no name; JSON text never starts so), else None."""
    try:
        with open(path, "rb") as f:
            return "parquet" if f.read(4) == PARQUET_MAGIC else None
    except OSError:
        return None  # the reader that opens it next says why


def spool(stream: BinaryIO, path: Path) -> str:
    """Copy `stream` to `path` (created anew, never through a link, then fsynced) and return
    the SHA-256 of what was copied."""
    digest = hashlib.sha256()
    with replace_new(path) as f:
        while chunk := stream.read(SPOOL_CHUNK):
            digest.update(chunk)
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    return digest.hexdigest()


def _key(path: Path) -> str:
    return os.path.abspath(Path(path).expanduser())
