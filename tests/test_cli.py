"""`batchrun run` end to end on the bundled sample data and demo model."""

import shutil
from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner

from batchrun.cli import cli

SAMPLE = Path(__file__).resolve().parents[1] / "sample_data" / "prompts.jsonl"


def read_jsonl(path):
    return [orjson.loads(line) for line in Path(path).read_bytes().splitlines() if line]


def run(*args):
    result = CliRunner().invoke(cli, ["run", *map(str, args), "--quiet"])
    assert result.exit_code == 0, result.output
    return result


def test_sample_prompts_give_one_ordered_result_per_row(tmp_path):
    result = run(SAMPLE, "--job-dir", tmp_path / "job", "--max-concurrency", "16")
    rows = read_jsonl(SAMPLE)
    results = read_jsonl(tmp_path / "job" / "results.jsonl")
    assert [r["index"] for r in results] == list(range(len(rows)))
    assert [r["custom_id"] for r in results] == [row["custom_id"] for row in rows]
    for row, res in zip(rows, results, strict=True):
        # The demo template lets the model open a reasoning block: it goes to `reasoning`.
        assert set(res) - {"reasoning"} == {"custom_id", "index", "text", "finish_reason",
                                            "usage"}
        assert res["finish_reason"] in ("stop", "length")
        assert res["usage"]["completion_tokens"] <= row["max_tokens"]
        assert 0 <= res["usage"]["cached_tokens"] < res["usage"]["prompt_tokens"]
    assert "BLAS:" in result.output and "device: cpu" in result.output
    assert f"{len(rows)} done, 0 failed" in result.output


def test_the_job_runs_with_what_came_before_it_left_out_of_garbage_collection(tmp_path,
                                                                              monkeypatch):
    """The modules, model and tokenizer loaded before the job are frozen for the cycle
    collector while the job runs (its full passes went through all of them), and thawed after:
    the job's own cyclic garbage is still collected."""
    import gc

    from batchrun.job.runner import JobRunner

    seen = {}
    real = JobRunner._run

    def spy(self, progress):
        seen["frozen"] = gc.get_freeze_count()
        garbage = []
        garbage.append(garbage)  # a cycle made during the job
        del garbage
        seen["collected"] = gc.collect()
        return real(self, progress)

    monkeypatch.setattr(JobRunner, "_run", spy)
    run(SAMPLE, "--job-dir", tmp_path / "job")
    assert seen["frozen"] > 10_000 and seen["collected"] >= 1
    assert gc.get_freeze_count() == 0
    # a process that froze its own objects keeps them frozen after the command
    mine = [object() for _ in range(10)]
    gc.freeze()
    try:
        run(SAMPLE, "--job-dir", tmp_path / "job2")
        assert gc.get_freeze_count() > 0 and mine  # not thawed by the command
    finally:
        gc.unfreeze()


def test_results_do_not_depend_on_concurrency(tmp_path):
    run(SAMPLE, "--job-dir", tmp_path / "a", "--max-concurrency", "1")
    run(SAMPLE, "--job-dir", tmp_path / "b", "--max-concurrency", "32")
    a = read_jsonl(tmp_path / "a" / "results.jsonl")
    b = read_jsonl(tmp_path / "b" / "results.jsonl")
    assert [r["text"] for r in a] == [r["text"] for r in b]  # seeded rows included


def test_bad_rows_become_error_records_and_the_job_goes_on(tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_text('{"prompt": "hello", "custom_id": "ok1"}\n'
                    '{"prompt": "x", "top_p": 7, "custom_id": "bad"}\n'
                    'not json\n'
                    '{"messages": [{"role": "user", "content": "hi"}], "custom_id": "ok2"}\n')
    result = run(path, "--job-dir", tmp_path / "job", "--max-tokens", "5")
    results = read_jsonl(tmp_path / "job" / "results.jsonl")
    errors = read_jsonl(tmp_path / "job" / "errors.jsonl")
    assert [r["custom_id"] for r in results] == ["ok1", "ok2"]
    assert [(e["custom_id"], e["line"]) for e in errors] == [("bad", 2), ("2", 3)]
    assert "top_p" in errors[0]["error"]["message"]
    assert errors[1]["error"]["code"] == "invalid_json"
    assert "2 done, 2 failed" in result.output


def test_default_job_dir_and_output_option(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copy(SAMPLE, tmp_path / "mine.jsonl")
    run("mine.jsonl", "--max-tokens", "3")
    assert len(read_jsonl(tmp_path / "jobs" / "mine" / "results.jsonl")) == 64
    run("mine.jsonl", "--max-tokens", "3", "-o", "out.jsonl", "--job-dir", "j2")
    assert len(read_jsonl(tmp_path / "out.jsonl")) == 64


def test_python_dash_m_batchrun_works():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "batchrun", "--version"], capture_output=True,
                         text=True, check=True)
    assert "batchrun" in out.stdout


def test_the_command_line_starts_without_loading_mlx():
    """`batchrun --help` (and every usage error) answers at once: no model stack imported."""
    import subprocess
    import sys

    code = ("import sys, batchrun.cli; heavy = [m for m in ('mlx.core', 'mlx_lm', 'pyarrow', "
            "'transformers') if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("args", [["--help"], ["run", "--help"]])
def test_help_imports_no_model_stack(args):
    """`batchrun --help` and `batchrun run --help` print their help without importing MLX,
    numpy, Arrow, Pillow, the grammar engine or transformers (what makes a start slow)."""
    import subprocess
    import sys

    code = ("import sys; from batchrun.cli import cli\n"
            f"try:\n    cli({args!r})\nexcept SystemExit as e:\n    assert e.code == 0, e.code\n"
            "heavy = {'mlx', 'mlx_lm', 'mlx_vlm', 'numpy', 'pyarrow', 'PIL', 'llguidance', "
            "'transformers', 'torch'}\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert "Usage: " in out
    assert out.splitlines()[-1] == "[]"


def test_run_options_come_in_bundles_that_match_the_python_api():
    """Every option of `run` is in one bundle, listed under its heading in --help, and every
    bundled name but the command line's own is a `batchrun.Job` keyword that RunOptions keeps
    in the part the bundle names (or at its top)."""
    from batchrun.cli import RUN_BUNDLES
    from batchrun.job.options import FLAT

    names = [n for bundle in RUN_BUNDLES for n in bundle.names]
    params = [p.name for p in cli.commands["run"].params if p.name != "input_path"]
    assert sorted(names) == sorted(params) and len(set(names)) == len(names)
    parts = {n: bundle.key for bundle in RUN_BUNDLES for n in bundle.names
             if n not in bundle.cli_only}
    assert set(parts) == set(FLAT)
    assert {n: key for n, key in parts.items() if FLAT[n][0] is not None} == \
        {n: part for n, (part, _) in FLAT.items() if part is not None}
    text = CliRunner().invoke(cli, ["run", "--help"], terminal_width=100).output
    at = [text.index(f"\n{bundle.heading}:\n") for bundle in RUN_BUNDLES]
    assert at == sorted(at) and text.index("\nExamples:\n") > at[-1]


def test_fail_on_row_errors_exits_3_after_every_row_has_its_record(tmp_path):
    from helpers import jsonl as read_jsonl
    from helpers import run as run_cli
    from helpers import write_rows as rows_file

    data = rows_file(tmp_path / "rows.jsonl", [{"prompt": "fine", "max_tokens": 2},
                                               {"prompt": "", "max_tokens": 2}])
    run_cli(data, "--job-dir", tmp_path / "a")  # exit 0 without the flag
    run_cli(data, "--job-dir", tmp_path / "b", "--fail-on-row-errors", code=3)
    assert len(read_jsonl(tmp_path / "b" / "results.jsonl")) == 1
    assert len(read_jsonl(tmp_path / "b" / "errors.jsonl")) == 1
    clean = rows_file(tmp_path / "clean.jsonl", [{"prompt": "fine", "max_tokens": 2}])
    run_cli(clean, "--job-dir", tmp_path / "c", "--fail-on-row-errors")  # exit 0


def test_defaults_come_from_the_environment_and_the_command_line_wins(tmp_path, monkeypatch):
    from helpers import jsonl as read_jsonl
    from helpers import run as run_cli
    from helpers import write_rows as rows_file

    data = rows_file(tmp_path / "rows.jsonl", [{"prompt": "Once upon a time"}])
    monkeypatch.setenv("BATCHRUN_MODEL", "demo")
    monkeypatch.setenv("BATCHRUN_RUN_MAX_TOKENS", "3")
    run_cli(data, "--job-dir", tmp_path / "env")
    (env,) = read_jsonl(tmp_path / "env" / "results.jsonl")
    assert env["usage"]["completion_tokens"] <= 3
    run_cli(data, "--job-dir", tmp_path / "flag", "--max-tokens", "5")
    (flag,) = read_jsonl(tmp_path / "flag" / "results.jsonl")
    assert 3 < flag["usage"]["completion_tokens"] <= 5 or flag["finish_reason"] == "stop"
    monkeypatch.setenv("BATCHRUN_MODEL", str(tmp_path / "no-such-model"))
    result = CliRunner().invoke(cli, ["run", str(data), "--job-dir", str(tmp_path / "bad"),
                                      "--quiet"])
    assert result.exit_code != 0 and "no-such-model" in result.output


def test_every_option_of_every_command_has_help_text():
    import click

    missing = []
    for name, command in cli.commands.items():
        commands = command.commands.values() if isinstance(command, click.Group) else [command]
        for c in commands:
            missing += [f"{name} {c.name} {p.opts[0]}" for p in c.params
                        if isinstance(p, click.Option) and not p.help and not p.hidden]
    assert not missing, missing


@pytest.mark.parametrize("name", ["notes.txt", "rows.xlsx", "rows.json"])
def test_an_input_of_another_format_is_a_usage_error_before_the_model_loads(tmp_path, name):
    data = tmp_path / name
    data.write_text('{"prompt": "hi"}\n')
    result = CliRunner().invoke(cli, ["run", str(data), "--job-dir", str(tmp_path / "job"),
                                      "--model", str(tmp_path / "no-model"), "--quiet"])
    assert result.exit_code == 2, result.output
    assert ".jsonl" in result.output and ".parquet" in result.output
    assert not (tmp_path / "job" / "results.jsonl").exists()


def test_ndjson_input_is_read_as_jsonl(tmp_path):
    from helpers import jsonl as read_jsonl
    from helpers import run as run_cli

    data = tmp_path / "rows.ndjson"
    data.write_text('{"prompt": "hi", "max_tokens": 2}\n')
    run_cli(data, "--job-dir", tmp_path / "job")
    assert len(read_jsonl(tmp_path / "job" / "results.jsonl")) == 1


def test_a_finished_job_says_already_complete_without_loading_the_model(tmp_path, monkeypatch):
    from helpers import jsonl as read_jsonl
    from helpers import run as run_cli
    from helpers import write_rows as rows_file

    import batchrun.api

    data = rows_file(tmp_path / "rows.jsonl", [{"prompt": "fine", "max_tokens": 2},
                                               {"prompt": "", "max_tokens": 2}])
    job = tmp_path / "job"
    run_cli(data, "--job-dir", job)
    before = (job / "results.jsonl").read_bytes()

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(batchrun.api, "load_engine", no_model)
    result = run_cli(data, "--job-dir", job)
    assert "already complete: 1 rows done, 1 failed" in result.output
    run_cli(data, "--job-dir", job, "--fail-on-row-errors", code=3)
    assert (job / "results.jsonl").read_bytes() == before
    monkeypatch.undo()
    (job / "results.jsonl").unlink()  # a damaged job is not complete: the run mends it
    result = run_cli(data, "--job-dir", job)
    assert "already complete" not in result.output
    assert len(read_jsonl(job / "results.jsonl")) == 1
