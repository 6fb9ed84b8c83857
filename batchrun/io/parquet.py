"""Parquet input read in streaming record batches, and Parquet output that keeps the input's
columns and types and adds the result columns."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from batchrun.io.jsonl import RawRow, read_jsonl

BATCH_ROWS = 1024
RESULT_COLUMNS = (
    ("text", pa.string()),
    ("finish_reason", pa.string()),
    ("prompt_tokens", pa.int64()),
    ("completion_tokens", pa.int64()),
    ("cached_tokens", pa.int64()),
    ("error", pa.string()),
)
# Added only when some result has them: choices rows and rows with n > 1 samples.
OPTIONAL_COLUMNS = (
    ("choice_probs", pa.map_(pa.string(), pa.float64())),
    ("samples", pa.list_(pa.string())),
)


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


def result_column_names(input_columns: list[str],
                        columns: tuple = RESULT_COLUMNS) -> dict[str, str]:
    """Result column -> output name; prefixed with `result_` where the input has the name."""
    taken = set(input_columns)
    return {name: f"result_{name}" if name in taken else name for name, _ in columns}


def write_parquet_output(input_path: Path, results: Path, errors: Path, out: Path) -> None:
    """Join the input rows with their results (both in input order) into one Parquet file."""
    parquet_input = input_path.name.endswith(".parquet")
    present = set()
    for r in _lines(results):
        present.update(name for name, _ in OPTIONAL_COLUMNS if flat_result(r).get(name))
    columns = RESULT_COLUMNS + tuple(c for c in OPTIONAL_COLUMNS if c[0] in present)
    results_by_index = _merge_in_order(results, errors)
    tmp = out.with_name(f".{out.name}.tmp")
    writer = None
    try:
        for batch in _input_batches(input_path, parquet_input):
            names = result_column_names(batch.schema.names, columns)
            values: dict[str, list] = {name: [] for name, _ in columns}
            for _ in range(batch.num_rows):
                record = next(results_by_index)
                for name, _type in columns:
                    values[name].append(record.get(name))
            for name, type_ in columns:
                batch = batch.append_column(pa.field(names[name], type_),
                                            pa.array(values[name], type_))
            if writer is None:
                writer = pq.ParquetWriter(tmp, batch.schema)
            writer.write_table(batch)
        if writer is None:
            raise ValueError(f"{input_path} has no rows")
        writer.close()
        tmp.replace(out)
    finally:
        if tmp.exists():
            tmp.unlink()


def _input_batches(path: Path, parquet_input: bool) -> Iterator[pa.Table]:
    if parquet_input:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=BATCH_ROWS):
            yield pa.Table.from_batches([batch])
        return
    # JSONL input: scalar fields keep their types; objects and lists become JSON strings.
    rows: list[dict] = []
    for raw in read_jsonl(path):
        value = raw.value if isinstance(raw.value, dict) else {}
        rows.append({k: v if _scalar(v) else orjson.dumps(v).decode() for k, v in value.items()})
        if len(rows) == BATCH_ROWS:
            yield pa.Table.from_pylist(rows)
            rows = []
    if rows:
        yield pa.Table.from_pylist(rows)


def _scalar(v) -> bool:
    return v is None or isinstance(v, (str, int, float, bool))


def _merge_in_order(results: Path, errors: Path) -> Iterator[dict]:
    """One flat record per input index: both files are in input order and errors carry their
    index, so index i is an error if the next error says so and a result otherwise."""
    res, err = _lines(results), _lines(errors)
    e = next(err, None)
    index = 0
    while True:
        if e is not None and e["index"] == index:
            yield {"error": f"{e['error']['code']}: {e['error']['message']}"}
            e = next(err, None)
        else:
            r = next(res, None)
            if r is None:
                return
            yield flat_result(r)
        index += 1


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
    else:
        text, finish, usage = r.get("text"), r.get("finish_reason"), r.get("usage") or {}
        probs = r.get("choice_probs")
        samples = [s["text"] for s in r["samples"]] if r.get("samples") else None
    return {"text": text, "finish_reason": finish, "prompt_tokens": usage.get("prompt_tokens"),
            "completion_tokens": usage.get("completion_tokens"),
            "cached_tokens": usage.get("cached_tokens"), "error": None,
            "choice_probs": list(probs.items()) if probs else None, "samples": samples}


def _lines(path: Path) -> Iterator[dict]:
    if not path.exists():
        return
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                yield orjson.loads(line)
