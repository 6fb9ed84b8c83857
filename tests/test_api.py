"""The Python API: batchrun.Engine.load(...).generate(...) as the seed's engine, the same
outputs as the engine driven by hand."""

import subprocess
import sys
from pathlib import Path

import pytest

import batchrun
from batchrun.engine.types import FinishReason, SamplingParams
from batchrun.job.errors import UsageError


@pytest.fixture(scope="module")
def engine():
    return batchrun.Engine.load(max_concurrency=4, prefix_cache=False)


def test_generate_takes_texts_token_ids_and_chats_and_answers_in_order(engine):
    chat = [{"role": "user", "content": "Hi there"}]
    ids = engine.prompts.encode("Once upon a time")
    outs = engine.generate(["Once upon a time", ids, chat], max_tokens=6)
    assert [o.request_id for o in outs] == sorted(o.request_id for o in outs)
    assert len(outs) == 3 and all(o.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
                                  for o in outs)
    assert outs[0].token_ids == outs[1].token_ids  # the text and its ids are the same prompt
    alone = engine.generate([chat], SamplingParams(max_tokens=6))[0]
    assert alone.token_ids == outs[2].token_ids  # greedy: the batch does not change a row


def test_the_seed_api_add_step_abort(engine):
    keep = engine.add_request("The kettle", SamplingParams(max_tokens=5))
    drop = engine.add_request(messages=[{"role": "user", "content": "x"}],
                              params=SamplingParams(max_tokens=50))
    assert engine.abort(drop)
    outs = {o.request_id: o for o in engine.run()}
    assert outs[keep].completion_tokens == 5 and outs[drop].finish_reason is FinishReason.ABORT
    assert engine.stats.requests_finished >= 2


def test_bad_sampling_is_a_value_error(engine):
    with pytest.raises(ValueError):
        engine.generate(["x"], temperature=-1)
    with pytest.raises(ValueError):
        engine.generate(["x"], SamplingParams(), max_tokens=3)


def test_import_batchrun_is_cheap():
    code = "import sys, batchrun; print('mlx.core' in sys.modules, 'mlx_lm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.split() == ["False", "False"]


def test_a_job_gives_what_the_command_line_gives(tmp_path):
    from tests.helpers import jsonl, run, write_rows

    rows = write_rows(tmp_path / "rows.jsonl",
                      [{"custom_id": f"r{i}", "prompt": f"row {i}", "max_tokens": 4}
                       for i in range(8)] + [{"custom_id": "bad"}])
    job = batchrun.Job(rows, job_dir=tmp_path / "api", max_tokens=4, choices=None)
    report = job.run()
    assert (report["rows_done"], report["rows_failed"]) == (8, 1)
    run(rows, "--job-dir", tmp_path / "cli", "--max-tokens", "4")
    assert (tmp_path / "api" / "results.jsonl").read_bytes() == \
        (tmp_path / "cli" / "results.jsonl").read_bytes()
    records = list(job.results())
    assert [r["custom_id"] for r in records] == [f"r{i}" for i in range(8)] + ["bad"]
    assert records[-1]["error"]["code"] and records[0] == jsonl(tmp_path / "cli" /
                                                                "results.jsonl")[0]
    status = job.status()
    assert status["running"] is False and status["rows_done"] == 8
    again = batchrun.Job(rows, job_dir=tmp_path / "api", max_tokens=4).run()  # resumes
    assert again["runs"][-1]["rows_done"] == 0


def test_a_job_refuses_bad_options_by_name(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "x"}\n')
    with pytest.raises(UsageError, match="unknown options max_tokenz"):
        batchrun.Job(rows, max_tokenz=3)
    with pytest.raises(UsageError, match="at most one"):
        batchrun.Job(rows, choices="a,b", regex="x")
    with pytest.raises(UsageError, match="not found"):
        batchrun.Job(tmp_path / "missing.jsonl")


def test_flat_keywords_and_whole_parts_fill_the_nested_options():
    """Each flat keyword lands in its part (media_timeout is media.timeout); a part may be
    given whole, and a flat keyword wins over the same field of it."""
    from batchrun.job.options import FLAT, MediaOptions, RunOptions, SamplingOptions

    for name, (part, field) in FLAT.items():
        options = RunOptions.from_flat(**{name: "x"})
        assert getattr(getattr(options, part) if part else options, field) == "x", name
    options = RunOptions.from_flat(sampling=SamplingOptions(temperature=0.5, top_k=4),
                                   top_k=8, media_timeout=5.0, ray_address="local")
    assert (options.sampling.temperature, options.sampling.top_k) == (0.5, 8)
    assert options.media == MediaOptions(timeout=5.0) and options.ray.address == "local"
    assert RunOptions.from_flat() == RunOptions()
    with pytest.raises(UsageError, match="media takes a MediaOptions"):
        RunOptions.from_flat(media={"timeout": 5.0})


def test_a_job_takes_parts_as_the_flat_keywords(tmp_path):
    from batchrun.job.options import LabelOptions, SamplingOptions

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "x"}\n')
    nested = batchrun.Job(rows, job_dir=tmp_path / "job", sampling=SamplingOptions(max_tokens=3),
                          labels=LabelOptions(choices=["a", "b"]))
    flat = batchrun.Job(rows, job_dir=tmp_path / "job", max_tokens=3, choices=["a", "b"])
    assert nested.options == flat.options and nested.spec.options() == flat.spec.options()


def test_the_command_line_keeps_torch_out_for_text_models_only(tmp_path):
    """In a fresh process (the CLI's own): a text model hides PyTorch from transformers, a
    vision model does not."""
    code = ("import sys, importlib.util; from batchrun.engine.load import keep_torch_out; "
            "hidden = keep_torch_out(sys.argv[1] or None); "
            "print(hidden, importlib.util.find_spec('torch') is None if hidden else '')")
    root = Path(__file__).resolve().parents[1]
    text = subprocess.run([sys.executable, "-c", code, ""], capture_output=True, text=True)
    vision = subprocess.run([sys.executable, "-c", code,
                             str(root / "sample_data" / "demo-vision-model")],
                            capture_output=True, text=True)
    assert text.stdout.split() == ["True", "True"], text.stderr
    assert vision.stdout.split()[0] == "False", vision.stderr
