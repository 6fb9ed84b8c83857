"""CSV and TSV input: quoted delimiters and newlines, typed columns, a bad record as its row's
error while the job goes on, and Parquet piped to stdin recognised by its first bytes."""

import io
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from helpers import jsonl, run

from batchrun.cli import cli
from batchrun.io.jsonl import InputError
from batchrun.io.readers import count_rows, read_rows

REVIEWS = (b'id,review,stars,verified\n'
           b'007,"Great, really\ngood",5,true\n'
           b'8,too,many,fields,here\n'
           b'9,"Awful ""value""",1,false\n'
           b'10,,,\n')


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_rows_are_read_with_quoted_newlines_typed_columns_and_bad_records(tmp_path):
    path = write(tmp_path / "reviews.csv", REVIEWS)
    assert count_rows(path) == 4
    rows = list(read_rows(path))
    assert [r.index for r in rows] == [0, 1, 2, 3]
    assert [r.line for r in rows] == [2, 3, 4, 5]  # a spreadsheet's row numbers
    assert rows[0].value == {"id": "007", "review": "Great, really\ngood", "stars": 5,
                             "verified": True}
    assert rows[1].code == "invalid_row"
    assert rows[1].value["id"] == "8"  # its fields, for its error record's id
    assert rows[1].error == "record 3 has 5 fields where the header has 4"
    assert rows[2].value == {"id": "9", "review": 'Awful "value"', "stars": 1,
                             "verified": False}
    # an empty cell: "" in a text column, null in a typed one
    assert rows[3].value == {"id": "10", "review": "", "stars": None, "verified": None}
    assert [r.index for r in read_rows(path, start=1)] == [1, 2, 3]  # a resume's read


@pytest.mark.parametrize("values,kind", [
    ([b"1", b"-20", b""], int), ([b"1", b"2.5", b"1e3"], float), ([b"True", b"false"], bool),
    ([b"1", b"007"], str), ([b"1", b"x"], str), ([b"99999999999999999999"], float),
])
def test_a_column_has_one_type_over_the_whole_file(tmp_path, values, kind):
    path = write(tmp_path / "t.csv", b"v,w\n" + b"".join(v + b",x\n" for v in values))
    got = [r.value["v"] for r in read_rows(path)]
    assert all(v is None or type(v) is kind for v in got) and len(got) == len(values)


def test_a_header_naming_a_column_twice_is_one_clear_error(tmp_path):
    path = write(tmp_path / "t.csv", b"a,b,a\n1,2,3\n")
    with pytest.raises(InputError, match=r"names a column twice \(a\)"):
        count_rows(path)


def test_a_csv_job_gives_each_row_one_result_or_error_and_goes_on(tmp_path):
    path = write(tmp_path / "reviews.csv", REVIEWS)
    job = tmp_path / "job"
    run(path, "--job-dir", job, "--prompt-template", "Review: {review}", "--id-column", "id",
        "--max-tokens", "2", "--keep-columns", "stars")
    results, errors = jsonl(job / "results.jsonl"), jsonl(job / "errors.jsonl")
    assert sorted(r["index"] for r in results + errors) == [0, 1, 2, 3]
    assert [r["custom_id"] for r in results] == ["007", "9", "10"]
    assert [r["columns"] for r in results] == [{"stars": 5}, {"stars": 1}, {"stars": None}]
    (error,) = errors
    assert error["index"] == 1 and error["line"] == 3 and error["custom_id"] == "8"
    assert error["error"]["code"] == "invalid_row" and "record 3" in error["error"]["message"]


def test_tsv_by_its_suffix_and_any_file_by_format(tmp_path):
    tsv = write(tmp_path / "rows.tsv", b"prompt\tn\nSay hi\t1\nSay, bye\t2\n")
    run(tsv, "--job-dir", tmp_path / "a", "--max-tokens", "2")
    assert len(jsonl(tmp_path / "a" / "results.jsonl")) == 2
    txt = write(tmp_path / "rows.txt", b"prompt,n\nSay hi,1\n")
    run(txt, "--job-dir", tmp_path / "b", "--max-tokens", "2", "--format", "csv")
    assert len(jsonl(tmp_path / "b" / "results.jsonl")) == 1


def test_parquet_on_stdin_is_read_as_parquet(tmp_path):
    buffer = io.BytesIO()
    pq.write_table(pa.table({"prompt": ["Say hi", "Say bye"], "id": ["a", "b"]}), buffer)
    job = tmp_path / "job"
    result = CliRunner().invoke(cli, ["run", "-", "--job-dir", str(job), "--quiet",
                                      "--max-tokens", "2", "--id-column", "id"],
                                input=buffer.getvalue())
    assert result.exit_code == 0, result.output
    assert [r["custom_id"] for r in jsonl(job / "results.jsonl")] == ["a", "b"]


def test_a_template_column_the_csv_lacks_is_refused_before_the_model_loads(tmp_path):
    path = write(tmp_path / "reviews.csv", REVIEWS)
    result = run(path, "--job-dir", tmp_path / "job", "--prompt-template", "Review: {text}",
                 code=2)
    assert "text" in result.output and "review" in result.output and "stars" in result.output
    assert not (tmp_path / "job" / "results.jsonl").exists()


def test_a_csv_job_writes_parquet_with_every_row_and_column(tmp_path):
    path = write(tmp_path / "reviews.csv", REVIEWS)
    out = tmp_path / "labels.parquet"
    run(path, "--job-dir", tmp_path / "job", "--prompt-template", "Review: {review}",
        "-o", out, "--max-tokens", "2")
    table = pq.read_table(out)
    assert table.num_rows == 4
    assert table.column("id").to_pylist() == ["007", None, "9", "10"]
    assert table.schema.field("stars").type == pa.int64()
    assert table.column("stars").to_pylist() == [5, None, 1, None]
    assert [e is None for e in table.column("error").to_pylist()] == [True, False, True, True]


@pytest.mark.parametrize("flag", ["--keep-columns", "--expected-column"])
def test_a_column_flag_naming_no_column_is_refused_before_the_model_loads(tmp_path, flag):
    path = write(tmp_path / "reviews.csv", REVIEWS)
    result = run(path, "--job-dir", tmp_path / "job", "--prompt-template", "Review: {review}",
                 flag, "strs", code=2)
    assert f"{flag} names column 'strs'" in result.output and "'stars'" in result.output
    assert not (tmp_path / "job" / "results.jsonl").exists()


def test_csv_on_stdin_without_format_is_refused_naming_it(tmp_path):
    result = CliRunner().invoke(cli, ["run", "-", "--job-dir", str(tmp_path / "job"), "--quiet",
                                      "--prompt-template", "Review: {review}"], input=REVIEWS)
    assert result.exit_code == 2, result.output
    assert "reads like a CSV header: pass --format csv" in result.output


def test_a_record_longer_than_a_megabyte_is_a_row_like_any_other(tmp_path):
    path = write(tmp_path / "long.csv", b"id,text\n1,ok\n2," + b"x" * 3_000_000 + b"\n3,fine\n")
    assert count_rows(path) == 3
    rows = list(read_rows(path))
    assert [r.error for r in rows] == [None] * 3 and len(rows[1].value["text"]) == 3_000_000
