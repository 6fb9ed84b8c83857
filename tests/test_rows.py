"""Row shapes become engine tasks; bad rows become errors naming the field."""

import pytest

from batchrun.engine.backends.prompt import PromptBuilder
from batchrun.engine.types import FinishReason, Output, SamplingParams
from batchrun.io.jsonl import read_jsonl
from batchrun.job.rows import RowError, RowOptions, Task, build_task
from batchrun.job.sink import OrderedSink, Record
from batchrun.job.state import Progress


@pytest.fixture
def prompts(demo):
    return PromptBuilder(demo.tokenizer)


def task(value, prompts, **options):
    return build_task(value, 3, 4, prompts, RowOptions(**options))


def test_prompt_row_uses_raw_text(prompts, demo):
    t = task({"prompt": "hello there", "max_tokens": 7, "temperature": 0.5, "seed": 3}, prompts)
    assert isinstance(t, Task)
    assert t.prompt_ids == demo.tokenizer.encode("hello there")
    assert (t.params.max_tokens, t.params.temperature, t.params.seed) == (7, 0.5, 3)
    assert t.custom_id == "3"  # the 0-based row index when the row has no id


def test_row_ids_prefer_custom_id_then_id_then_column(prompts):
    assert task({"prompt": "a", "custom_id": "c", "id": "i"}, prompts).custom_id == "c"
    assert task({"prompt": "a", "id": 17}, prompts).custom_id == "17"
    assert task({"prompt": "a", "key": "k1"}, prompts, id_column="key").custom_id == "k1"


def test_messages_row_renders_chat_template_with_system(prompts):
    t = task({"messages": [{"role": "user", "content": "hi"}]}, prompts, system="Be kind.")
    expected = prompts.encode_chat([{"role": "system", "content": "Be kind."},
                                    {"role": "user", "content": "hi"}])
    assert t.prompt_ids == expected


def test_prompt_template_fills_columns(prompts):
    t = task({"review": "great kettle", "stars": 5}, prompts,
             prompt_template="Classify: {review} ({stars})")
    assert t.prompt_ids == prompts.encode_chat([{"role": "user",
                                                 "content": "Classify: great kettle (5)"}])
    err = task({"text": "x"}, prompts, prompt_template="Classify: {review}")
    assert isinstance(err, RowError) and "review" in err.message


def test_openai_batch_lines(prompts):
    chat = task({"custom_id": "req-1", "method": "POST", "url": "/v1/chat/completions",
                 "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                          "max_completion_tokens": 9, "stop": "x"}}, prompts)
    assert chat.openai == "chat" and chat.custom_id == "req-1"
    assert chat.params.max_tokens == 9 and chat.params.stop == ("x",)
    completion = task({"custom_id": "req-2", "url": "/v1/completions",
                       "body": {"prompt": "Once"}}, prompts)
    assert completion.openai == "completion"
    bad = task({"custom_id": "req-3", "url": "/v1/embeddings", "body": {}}, prompts)
    assert isinstance(bad, RowError) and bad.code == "unsupported_url"
    # OpenAI's batch lines are POSTs matched to results by their custom_id
    get = task({"custom_id": "req-4", "method": "GET", "url": "/v1/completions",
                "body": {"prompt": "Once"}}, prompts)
    assert isinstance(get, RowError) and get.code == "invalid_field" and "POST" in get.message
    anonymous = task({"method": "POST", "url": "/v1/completions", "body": {"prompt": "Once"}},
                     prompts)
    assert isinstance(anonymous, RowError) and anonymous.code == "missing_custom_id"
    assert anonymous.openai


def test_row_fields_override_defaults(prompts):
    defaults = SamplingParams(max_tokens=50, temperature=0.3, stop=("END",))
    t = task({"prompt": "a", "temperature": 0}, prompts, defaults=defaults)
    assert (t.params.max_tokens, t.params.temperature, t.params.stop) == (50, 0, ("END",))


def test_a_row_without_its_own_sampling_fields_shares_the_jobs_params(prompts):
    defaults = SamplingParams(max_tokens=50, stop=("END",))
    messages = [{"role": "user", "content": "hi"}]
    assert task({"messages": messages}, prompts, defaults=defaults).params is defaults
    raw = task({"prompt": "a"}, prompts, defaults=defaults).params  # never read as reasoning
    assert raw.thinking is False and defaults.thinking is None and raw.stop == ("END",)
    own = task({"messages": messages, "max_tokens": 7}, prompts, defaults=defaults).params
    assert (own.max_tokens, own.stop, defaults.max_tokens) == (7, ("END",), 50)


def test_text_rows_do_not_load_the_image_machinery():
    """Looking for images in an all-text row does not import the media module (PIL's plugin
    registration, tens of milliseconds in a job's first row)."""
    import subprocess
    import sys

    code = """
import sys
from batchrun.job.rows import RowOptions, build_task
class Prompts:
    def encode_chat(self, messages, **kwargs): return [1, 2, 3]
    def encode(self, prompt): return [1, 2]
row = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]}
assert build_task(row, 0, 1, Prompts(), RowOptions()).prompt_ids == [1, 2, 3]
assert "batchrun.io.media" not in sys.modules
parts = {"messages": [{"role": "user", "content": [{"type": "image_url",
                                                    "image_url": {"url": "x.png"}}]}]}
assert build_task(parts, 1, 2, Prompts(), RowOptions()).code == "vision_model_required"
"""
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("row, field", [
    ({"prompt": "a", "top_p": 1.5}, "top_p"),
    ({"prompt": "a", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "a", "temperature": -0.1}, "temperature"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"text": "no prompt"}, "prompt"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "role"),
    ([1, 2], "object"),
    (None, "object"),
])
def test_bad_rows_name_the_problem(prompts, row, field):
    err = task(row, prompts)
    assert isinstance(err, RowError)
    assert field in err.message
    assert (err.index, err.line) == (3, 4)


def test_jsonl_reader_numbers_lines_and_skips_blank_ones(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n\n  \n{bad json\n"str"\n\xff\xfe\n')
    rows = list(read_jsonl(path))
    assert [(r.index, r.line) for r in rows] == [(0, 1), (1, 4), (2, 5), (3, 6)]
    assert rows[0].value == {"prompt": "a"} and rows[2].value == "str"
    assert "not valid JSON" in rows[1].error
    assert "UTF-8" in rows[3].error


def test_ordered_sink_spills_out_of_order_records_and_writes_them_when_the_gap_fills(tmp_path):
    results, errors, spill = tmp_path / "r.jsonl", tmp_path / "e.jsonl", tmp_path / "s.jsonl"
    sink = OrderedSink(results, errors, spill, Progress())
    out = Output(0, "x", [1, 2], FinishReason.LENGTH, prompt_tokens=5)
    sink.put(2, b"c\n", False, [out])
    sink.put(1, b"b\n", False, [out])
    progress = sink.sync()
    assert results.read_bytes() == b"" and sink.held == 2
    # Held rows are already durable, in the spill, and counted.
    assert [Record.from_spill(x).line for x in spill.read_bytes().splitlines(True)] == \
        [b"c\n", b"b\n"]
    assert progress.rows_done == 2 and progress.spill_bytes == spill.stat().st_size
    sink.put(0, b"a-error\n", True)
    progress = sink.sync()
    assert results.read_bytes() == b"b\nc\n" and errors.read_bytes() == b"a-error\n"
    assert sink.held == 0 and sink.spill_drained
    assert (progress.next_index, progress.rows_done, progress.rows_failed) == (3, 2, 1)
    assert progress.results_bytes == 4 and progress.errors_bytes == 8
    assert progress.completion_tokens == 4 and progress.prompt_tokens == 10
    with pytest.raises(RuntimeError, match="twice"):
        sink.put(1, b"again\n", False, [out])
    sink.put(3, b"d\n", False, [out])  # next in order: written directly, never spilled
    sink.empty_spill()
    assert sink.sync().spill_bytes == 0 and spill.read_bytes() == b""
    sink.close()


def test_sampled_rows_without_a_seed_get_one_from_their_position(prompts):
    a = build_task({"prompt": "a", "temperature": 1.0}, 5, 6, prompts, RowOptions())
    b = build_task({"prompt": "a", "temperature": 1.0}, 5, 6, prompts, RowOptions())
    c = build_task({"prompt": "a", "temperature": 1.0}, 6, 7, prompts, RowOptions())
    assert a.params.seed == b.params.seed != c.params.seed
    assert task({"prompt": "a"}, prompts).params.seed is None  # greedy needs none
    base = RowOptions(defaults=SamplingParams(temperature=1.0, seed=42))
    d = build_task({"prompt": "a"}, 5, 6, prompts, base)
    e = build_task({"prompt": "a"}, 6, 7, prompts, base)
    assert len({a.params.seed, d.params.seed, e.params.seed}) == 3
    own = build_task({"prompt": "a", "seed": 7}, 5, 6, prompts, base)
    assert own.params.seed == 7
