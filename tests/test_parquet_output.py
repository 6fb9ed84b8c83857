"""Parquet output: every input row once and in order, every column of any row with one type,
row groups written as the job commits, the same file whether or not the job was resumed."""

import gzip
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import jsonl, run

from batchrun.io.parquet import BATCH_ROWS
from batchrun.io.parquet_output import ParquetOutput, write_parquet_output

# -- hand-written job files ------------------------------------------------------------------


def lines(rows: list) -> bytes:
    """JSONL: a bytes item is written as it is (a bad line), anything else as JSON."""
    return b"".join((r if isinstance(r, bytes) else orjson.dumps(r)) + b"\n" for r in rows)


def result(i: int, text: str | None = None) -> dict:
    return {"custom_id": str(i), "index": i, "text": text or f"answer {i}",
            "finish_reason": "stop",
            "usage": {"prompt_tokens": 10 + i, "completion_tokens": 3, "cached_tokens": 0}}


def error(i: int, code: str = "invalid_row", message: str = "bad row") -> dict:
    return {"custom_id": str(i), "index": i, "line": i + 1,
            "error": {"code": code, "message": message}}


class Job:
    """An input file and the ordered results and errors files a job would have written."""

    def __init__(self, tmp_path: Path, rows: list, errors: dict[int, dict] | None = None,
                 name: str = "in.jsonl"):
        self.input = tmp_path / name
        self.input.write_bytes(lines(rows))
        self.results = tmp_path / "results.jsonl"
        self.errors = tmp_path / "errors.jsonl"
        self.out = tmp_path / "out.parquet"
        errors = errors or {}
        self.results.write_bytes(lines([result(i) for i in range(len(rows)) if i not in errors]))
        self.errors.write_bytes(lines([errors[i] for i in sorted(errors)]))

    def output(self) -> ParquetOutput:
        return ParquetOutput(self.input, self.out, self.results, self.errors)

    def write(self) -> pa.Table:
        write_parquet_output(self.input, self.results, self.errors, self.out)
        return pq.read_table(self.out)


def input_columns(table: pa.Table) -> list[str]:
    return table.schema.names[: table.schema.names.index("text")]


# -- rows and columns ------------------------------------------------------------------------


def test_a_bad_first_line_keeps_every_row_and_marks_it(tmp_path):
    job = Job(tmp_path, [b'{"prompt": "oops', {"prompt": "a", "k": 1}, [1, 2], "str", None,
                         {"prompt": "b", "k": 2}],
              errors={0: error(0, "invalid_json", "the line is not valid JSON"),
                      2: error(2), 3: error(3), 4: error(4)})
    rows = job.write().to_pylist()
    assert [r["prompt"] for r in rows] == [None, "a", None, None, None, "b"]
    assert [r["k"] for r in rows] == [None, 1, None, None, None, 2]
    assert rows[0]["error"] == "invalid_json: the line is not valid JSON"
    assert rows[0]["text"] is None and rows[0]["prompt_tokens"] is None
    assert [r["error"] is None for r in rows] == [False, True, False, False, False, True]
    assert [r["text"] for r in rows] == [None, "answer 1", None, None, None, "answer 5"]
    assert rows[5]["prompt_tokens"] == 15


def test_every_column_of_any_row_in_order_of_first_appearance(tmp_path):
    rows = [{"prompt": "a", "x": 1}, {"prompt": "b"}, {"y": "only here", "prompt": "c"},
            *({"prompt": "p"} for _ in range(BATCH_ROWS + 5)), {"late": True, "prompt": "z"}]
    table = Job(tmp_path, rows).write()
    assert input_columns(table) == ["prompt", "x", "y", "late"]
    assert table.num_rows == len(rows)
    assert table.column("y").to_pylist()[:4] == [None, None, "only here", None]
    assert table.column("late").to_pylist()[-1] is True  # in the second row group only
    assert table.schema.field("late").type == pa.bool_()


def test_a_column_that_changes_type_is_stored_as_text(tmp_path):
    values = {
        "score": [3, "high", 2.5, True, {"a": 1}, None],  # mixed: text
        "num": [1, 2.5, None, 4, 5, 6],  # int and float: float64
        "flag": [True, False, None, True, True, False],  # bool stays bool
        "bool_int": [True, 1, 0, False, None, 2],  # bool is not an int: text
        "count": [1, None, 3, 4, 5, 2**62],  # int64
        "huge": [2**64 - 1, 1, 2, 3, 4, 5],  # beyond int64: text
        "inexact": [2**53 + 1, 0.5, 1, 2, 3, 4],  # beyond +-2**53 with floats: text
        "big": [2**60, 0.5, None, 1, 2, 3],  # (even where float64 happens to be exact)
        "nested": [[1, 2], {"b": [3]}, None, [], {}, [None]],  # objects and lists: JSON text
        "nothing": [None] * 6,
    }
    rows = [{name: column[i] for name, column in values.items()} for i in range(6)]
    table = Job(tmp_path, rows).write()
    types = {name: table.schema.field(name).type for name in values}
    assert types == {"score": pa.string(), "num": pa.float64(), "flag": pa.bool_(),
                     "bool_int": pa.string(), "count": pa.int64(), "huge": pa.string(),
                     "inexact": pa.string(), "big": pa.string(), "nested": pa.string(),
                     "nothing": pa.string()}
    column = {name: table.column(name).to_pylist() for name in values}
    assert column["score"] == ["3", "high", "2.5", "true", '{"a":1}', None]
    assert column["num"] == [1.0, 2.5, None, 4.0, 5.0, 6.0]
    assert column["bool_int"] == ["true", "1", "0", "false", None, "2"]
    assert column["count"][-1] == 2**62
    assert column["huge"][0] == str(2**64 - 1)
    assert column["inexact"][:2] == [str(2**53 + 1), "0.5"]
    assert column["big"][:2] == [str(2**60), "0.5"]
    assert column["nested"] == ["[1,2]", '{"b":[3]}', None, "[]", "{}", "[null]"]


def test_input_columns_named_like_result_columns_get_a_prefix(tmp_path):
    table = Job(tmp_path, [{"prompt": "a", "text": "mine", "error": 0}]).write()
    row = table.to_pylist()[0]
    assert row["text"] == "mine" and row["result_text"] == "answer 0"
    assert row["error"] == 0 and row["result_error"] is None


def test_openai_shaped_results_map_to_the_result_columns(tmp_path):
    job = Job(tmp_path, [{"custom_id": f"c{i}", "url": "/v1/chat/completions"}
                         for i in range(3)])
    chat = {"id": "batch_req_1", "custom_id": "c0", "error": None, "response": {
        "status_code": 200, "request_id": "req_1", "body": {
            "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "yes"},
                         "finish_reason": "stop",
                         "choice_probs": {"yes": 0.75, "no": 0.25}}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 1, "total_tokens": 8,
                      "prompt_tokens_details": {"cached_tokens": 4}}}}}
    completion = {"id": "batch_req_3", "custom_id": "c2", "error": None, "response": {
        "status_code": 200, "request_id": "req_3", "body": {
            "object": "text_completion",
            "choices": [{"index": 0, "text": "one", "finish_reason": "length"},
                        {"index": 1, "text": "two", "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11,
                      "prompt_tokens_details": {"cached_tokens": 0}}}}}
    failed = {"id": "batch_req_2", **error(1, "unsupported_url", "url must be..."),
              "response": None}
    job.results.write_bytes(lines([chat, completion]))
    job.errors.write_bytes(lines([failed]))
    rows = job.write().to_pylist()
    assert [r["custom_id"] for r in rows] == ["c0", "c1", "c2"]
    assert rows[0]["text"] == "yes" and rows[0]["finish_reason"] == "stop"
    assert (rows[0]["prompt_tokens"], rows[0]["completion_tokens"],
            rows[0]["cached_tokens"]) == (7, 1, 4)
    assert dict(rows[0]["choice_probs"]) == {"yes": 0.75, "no": 0.25}
    assert rows[1]["error"] == "unsupported_url: url must be..." and rows[1]["text"] is None
    assert rows[2]["text"] == "one" and rows[2]["samples"] == ["one", "two"]
    assert rows[2]["finish_reason"] == "length"


def test_parquet_input_keeps_its_schema_and_values(tmp_path):
    n = 2 * BATCH_ROWS + 100
    source = pa.table({
        "id": pa.array(range(n), pa.int32()),
        "rating": pa.array([i % 5 for i in range(n)], pa.int8()),
        "tags": pa.array([[f"t{i}"] if i % 3 else None for i in range(n)],
                         pa.list_(pa.string())),
        "meta": pa.array([{"a": i, "b": "x"} for i in range(n)]),
        "text": pa.array([f"review {i}" for i in range(n)]),
    }).replace_schema_metadata({"origin": "test"})
    path = tmp_path / "in.parquet"
    pq.write_table(source, path, row_group_size=300)  # input groups that do not line up
    job = Job(tmp_path, [{}] * n)
    job.input = path
    table = job.write()
    assert table.schema.metadata == {b"origin": b"test"}
    for f in source.schema:
        assert table.schema.field(f.name).type == f.type
        assert table.column(f.name).equals(source.column(f.name))
    assert table.column("result_text").to_pylist()[:2] == ["answer 0", "answer 1"]
    assert pq.ParquetFile(job.out).metadata.num_row_groups == 3


def test_gzip_input_and_the_optional_columns_are_always_there(tmp_path):
    job = Job(tmp_path, [{"prompt": "a"}])
    gz = tmp_path / "in.jsonl.gz"
    gz.write_bytes(gzip.compress(job.input.read_bytes()))
    job.input = gz
    table = job.write()
    assert table.column("prompt").to_pylist() == ["a"]
    assert table.column("choice_probs").to_pylist() == [None]
    assert table.column("samples").to_pylist() == [None]


# -- written as the job goes -----------------------------------------------------------------


def test_row_groups_are_written_as_rows_are_committed(tmp_path, monkeypatch):
    n = 2 * BATCH_ROWS + 52
    job = Job(tmp_path, [{"prompt": f"p{i}"} for i in range(n)], errors={5: error(5)})
    written = []
    write_table = pq.ParquetWriter.write_table

    def spy(self, table, *args, **kwargs):
        written.append(table.num_rows)
        return write_table(self, table, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetWriter, "write_table", spy)
    output = job.output()
    output.advance(BATCH_ROWS - 1)
    assert written == [] and output.tmp is None
    output.advance(BATCH_ROWS + 500)
    assert written == [BATCH_ROWS]
    tmp = output.tmp
    size = tmp.stat().st_size
    output.advance(2 * BATCH_ROWS + 10)
    assert written == [BATCH_ROWS, BATCH_ROWS]
    assert tmp.stat().st_size > size > 0  # on disk, not held in memory
    assert not job.out.exists()
    output.finish()
    assert written == [BATCH_ROWS, BATCH_ROWS, 52]
    assert not tmp.exists()
    meta = pq.ParquetFile(job.out).metadata
    assert [meta.row_group(i).num_rows for i in range(3)] == [BATCH_ROWS, BATCH_ROWS, 52]
    rows = pq.read_table(job.out).to_pylist()
    assert [r["prompt"] for r in rows] == [f"p{i}" for i in range(n)]
    assert rows[5]["error"] == "invalid_row: bad row" and rows[6]["text"] == "answer 6"


def test_only_committed_whole_lines_are_read(tmp_path):
    """Past the committed rows the files may hold more lines, the last one half-written."""
    n = BATCH_ROWS + 10
    job = Job(tmp_path, [{"prompt": f"p{i}"} for i in range(n)])
    full_results = job.results.read_bytes()
    committed = b"".join(full_results.splitlines(keepends=True)[:BATCH_ROWS + 3])
    job.results.write_bytes(committed + full_results[len(committed):][:25])  # torn tail
    job.errors.write_bytes(orjson.dumps(error(BATCH_ROWS + 4))[:20])  # torn, uncommitted
    output = job.output()
    output.advance(BATCH_ROWS + 3)
    assert output.rows_written == BATCH_ROWS
    # The job goes on: the torn lines are completed, the rest is committed.
    job.results.write_bytes(lines([result(i) for i in range(n) if i != BATCH_ROWS + 4]))
    job.errors.write_bytes(lines([error(BATCH_ROWS + 4)]))
    output.advance(n)
    output.finish()
    rows = pq.read_table(job.out).to_pylist()
    assert [r["text"] for r in rows[BATCH_ROWS + 3:BATCH_ROWS + 6]] == [
        f"answer {BATCH_ROWS + 3}", None, f"answer {BATCH_ROWS + 5}"]
    assert rows[BATCH_ROWS + 4]["error"] == "invalid_row: bad row"


def test_a_resumed_output_is_the_same_file_as_one_pass(tmp_path):
    n = 3 * BATCH_ROWS + 7
    rows = [{"prompt": f"p{i}", **({"score": 1} if i % 2 else {"score": "x"})}
            for i in range(n)]
    job = Job(tmp_path, rows, errors={0: error(0), BATCH_ROWS + 1: error(BATCH_ROWS + 1)})
    output = job.output()
    output.advance(n)
    output.finish()
    output.close()  # harmless after finish
    one_pass = job.out.read_bytes()
    job.out.unlink()

    first = job.output()
    first.advance(BATCH_ROWS + 600)
    first.close()  # the run stops
    first.close()
    assert not first.tmp.exists() and not job.out.exists()
    resumed = job.output()  # a new run starts again at row 0
    resumed.advance(BATCH_ROWS + 600)
    resumed.advance(n)
    resumed.finish()
    assert job.out.read_bytes() == one_pass
    table = pq.read_table(job.out)
    assert table.num_rows == n and table.schema.field("score").type == pa.string()


def test_an_abandoned_output_leaves_the_old_file_alone(tmp_path):
    job = Job(tmp_path, [{"prompt": f"p{i}"} for i in range(BATCH_ROWS + 1)])
    job.out.write_bytes(b"the previous output")
    output = job.output()
    output.advance(BATCH_ROWS + 1)
    assert output.tmp.exists()
    output.close()
    assert not output.tmp.exists()
    assert job.out.read_bytes() == b"the previous output"


def test_a_missing_record_fails_instead_of_writing_a_short_file(tmp_path):
    job = Job(tmp_path, [{"prompt": "a"}, {"prompt": "b"}])
    job.results.write_bytes(lines([result(0)]))
    output = job.output()
    with pytest.raises(RuntimeError, match="row 1 has no committed record"):
        output.finish()
    output.close()
    assert not job.out.exists() and not list(tmp_path.glob(f".{job.out.name}*"))


# -- refused before any work -----------------------------------------------------------------


@pytest.mark.parametrize("case", ["missing", "bad gzip", "truncated gzip", "bad parquet",
                                  "no output folder"])
def test_problems_found_before_work_are_one_line_value_errors(tmp_path, case):
    job = Job(tmp_path, [{"prompt": "a"}] * 100)
    named = job.input
    if case == "missing":
        named = job.input = tmp_path / "missing.jsonl"
    elif case == "bad gzip":
        named = job.input = tmp_path / "in.jsonl.gz"
        job.input.write_bytes(b"not gzip at all\n")
    elif case == "truncated gzip":
        named = job.input = tmp_path / "in.jsonl.gz"
        job.input.write_bytes(gzip.compress(lines([{"prompt": "a" * 50}] * 100))[:-30])
    elif case == "bad parquet":
        named = job.input = tmp_path / "in.parquet"
        job.input.write_bytes(b"PAR1 not really")
    else:
        named = job.out = tmp_path / "nowhere" / "out.parquet"
    with pytest.raises(ValueError) as e:
        job.output()
    message = str(e.value)
    assert str(named) in message and "\n" not in message


# -- end to end ------------------------------------------------------------------------------


def test_cli_parquet_output_keeps_bad_rows_late_columns_and_mixed_types(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(lines([b'{"prompt": "broken', {"prompt": "one", "score": 3},
                            {"prompt": "two", "score": "high"},
                            {"prompt": "three", "score": 2.5, "note": {"k": [1]}},
                            [1, 2]]))
    out = tmp_path / "out.parquet"
    run(path, "-o", out, "--job-dir", tmp_path / "job", "--max-tokens", "4",
        "--no-prefix-cache")
    table = pq.read_table(out)
    rows = table.to_pylist()
    assert [r["prompt"] for r in rows] == [None, "one", "two", "three", None]
    assert table.schema.field("score").type == pa.string()
    assert [r["score"] for r in rows] == [None, "3", "high", "2.5", None]
    assert [r["note"] for r in rows] == [None, None, None, '{"k":[1]}', None]
    assert rows[0]["error"].startswith("invalid_json: ")
    assert rows[4]["error"].startswith("invalid_row: ")
    for row in rows[1:4]:
        assert row["error"] is None and isinstance(row["text"], str)
        assert 0 < row["completion_tokens"] <= 4
    assert not (tmp_path / ".out.parquet.partial").exists()


def test_the_temp_file_is_never_written_through_a_planted_link(tmp_path):
    job = Job(tmp_path, [{"prompt": f"p{i}"} for i in range(BATCH_ROWS + 3)])
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"keep me")
    for name in (f".{job.out.name}.partial", f".{job.out.name}.x1.partial"):
        (job.out.parent / name).symlink_to(victim)  # the old fixed name, and a stale-looking one
    output = job.output()
    output.advance(BATCH_ROWS)
    assert not output.tmp.is_symlink() and output.tmp.parent == job.out.parent
    output.finish()
    assert victim.read_bytes() == b"keep me"
    assert pq.read_table(job.out).num_rows == BATCH_ROWS + 3
    assert not list(job.out.parent.glob(f".{job.out.name}*partial"))  # stale links cleared


def test_a_glob_character_in_the_output_name_touches_no_other_outputs_temp_file(tmp_path):
    job = Job(tmp_path, [{"prompt": "a"}])
    other = tmp_path / ".a1.parquet.x1y2.partial"  # another job's live temp file
    other.write_bytes(b"in progress")
    ParquetOutput(job.input, tmp_path / "a[12].parquet", job.results, job.errors).close()
    assert other.read_bytes() == b"in progress"


def test_keep_columns_copies_input_columns_into_jsonl_results(tmp_path):
    """--keep-columns a,b (or all): the row's columns in its result as `columns`, a missing one
    null, a Parquet value JSON has no form for as text; part of the job's identity."""
    import decimal

    table = pa.table({"id": ["a", "b"], "review": ["fine", "bad"], "score": [1, 2],
                      "blob": [b"\x00\x01", b"\x02"],
                      "price": pa.array([decimal.Decimal("1.50"), None], pa.decimal128(5, 2))})
    data = tmp_path / "in.parquet"
    pq.write_table(table, data)
    job = tmp_path / "job"
    run(data, "--job-dir", job, "--prompt-template", "Review: {review}", "--max-tokens", "2",
        "--keep-columns", "score")
    assert [r["columns"] for r in jsonl(job / "results.jsonl")] == [{"score": 1}, {"score": 2}]
    # a column some rows lack is null in theirs (one no row has is refused: a typo)
    sparse = tmp_path / "sparse.jsonl"
    sparse.write_text('{"review": "fine", "extra": 1}\n{"review": "bad"}\n')
    run(sparse, "--job-dir", tmp_path / "sparse", "--prompt-template", "Review: {review}",
        "--max-tokens", "2", "--keep-columns", "extra")
    assert [r["columns"] for r in jsonl(tmp_path / "sparse" / "results.jsonl")] == [
        {"extra": 1}, {"extra": None}]
    every = tmp_path / "every"
    run(data, "--job-dir", every, "--prompt-template", "Review: {review}", "--max-tokens", "2",
        "--keep-columns", "all")
    first = jsonl(every / "results.jsonl")[0]["columns"]
    assert first == {"id": "a", "review": "fine", "score": 1, "blob": "0001", "price": "1.50"}
    # another set of kept columns is another job
    refused = run(data, "--job-dir", job, "--prompt-template", "Review: {review}",
                  "--max-tokens", "2", "--keep-columns", "id", code=2)
    assert "--keep-columns" in refused.output


def test_openai_error_lines_land_on_their_rows_in_parquet_output_and_results(tmp_path):
    """OpenAI's error lines carry no index, only their input line (blank lines counted):
    the Parquet output and the ordered records still put each on its own row."""
    from batchrun.io.readers import read_rows
    from batchrun.job.recovery import ordered_records

    def line(i, url="/v1/completions"):
        return orjson.dumps({"custom_id": f"c{i}", "method": "POST", "url": url,
                             "body": {"prompt": f"row {i}", "max_tokens": 2}}).decode()

    data = tmp_path / "batch.jsonl"
    data.write_text("\n".join([line(0), "", line(1, "/v1/embeddings"), line(2), "not json",
                               line(4)]) + "\n")
    out, job = tmp_path / "out.parquet", tmp_path / "job"
    run(data, "--job-dir", job, "-o", out)
    errors = [e is not None for e in pq.read_table(out).column("error").to_pylist()]
    assert errors == [False, True, False, True, False]
    merged = list(ordered_records(job / "results.jsonl", job / "errors.jsonl",
                                  read_rows(data)))
    assert [r["custom_id"] for r in merged] == ["c0", "c1", "c2", "3", "c4"]
    assert [r["response"] is None for r in merged] == errors
