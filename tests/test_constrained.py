"""Labeling: constrained answers (JSON schema, regex, choices), label probabilities, logprobs in
OpenAI's formats, and n samples per row -- on the demo model, whose free text is random."""

import json
import re
import shutil
from pathlib import Path

import jsonschema
import orjson
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from helpers import choice_logprob, jsonl, run, write_rows

from batchrun.cli import cli
from batchrun.engine.config import EngineConfig
from batchrun.engine.engine import Engine
from batchrun.engine.types import Constraint, SamplingParams

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"enum": ["positive", "negative", "neutral"]},
        "score": {"type": "integer", "minimum": 1, "maximum": 5},
        "summary": {"type": "string", "maxLength": 12},
        "verified": {"type": "boolean"},
    },
    "required": ["label", "score", "summary", "verified"],
    "additionalProperties": False,
}
CHOICES = ["positive", "negative", "neutral", "mixed feelings"]








def review(i: int) -> str:
    return f"Review {i}: the kettle is {['sturdy', 'flimsy', 'fine', 'loud'][i % 4]}."


def test_120_schema_rows_all_validate_and_share_the_batch_with_free_rows(tmp_path):
    rows = []
    for i in range(160):
        row = {"custom_id": f"r{i}", "prompt": review(i), "max_tokens": 96}
        if i % 4 != 3:  # 120 constrained rows, 40 free ones interleaved
            row["response_format"] = {"type": "json_schema",
                                      "json_schema": {"name": "label", "schema": SCHEMA}}
        rows.append(row)
    job = tmp_path / "job"
    run(write_rows(tmp_path / "rows.jsonl", rows), "--job-dir", job, "--max-concurrency", "32")
    results = jsonl(job / "results.jsonl")
    assert [r["custom_id"] for r in results] == [f"r{i}" for i in range(160)]
    constrained = [r for i, r in enumerate(results) if i % 4 != 3]
    assert len(constrained) == 120
    for r in constrained:
        jsonschema.validate(json.loads(r["text"]), SCHEMA)
        assert r["finish_reason"] == "stop"
    free = [r["text"] for i, r in enumerate(results) if i % 4 == 3]
    assert sum(_parses(t) for t in free) < len(free) / 2  # the demo model's own text is random
    report = orjson.loads((job / "report.json").read_bytes())
    assert report["mean_batch_size"] > 4  # constrained and free rows decoded together


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def test_choices_answer_from_the_set_with_probabilities_summing_to_one(tmp_path):
    rows = [{"id": i, "prompt": review(i)} for i in range(24)]
    job = tmp_path / "job"
    run(write_rows(tmp_path / "rows.jsonl", rows), "--job-dir", job,
        "--choices", ",".join(CHOICES))
    results = jsonl(job / "results.jsonl")
    assert len(results) == 24
    for r in results:
        probs = r["choice_probs"]
        assert list(probs) == CHOICES
        assert sum(probs.values()) == pytest.approx(1.0, abs=1e-5)
        assert r["text"] == max(probs, key=probs.get)  # greedy: the most likely choice
    assert len({r["text"] for r in results}) >= 1


def test_choice_probabilities_are_the_models_sequence_probabilities(demo):
    """choice_probs come from the model's logprobs of each choice's tokens after the prompt."""
    engine = Engine(demo.model, demo.tokenizer, EngineConfig(max_concurrency=8),
                    demo.context_length)
    prompts = [review(i) + " Label:" for i in range(4)]
    for p in prompts:
        engine.add_request(p, SamplingParams(constraint=Constraint.choices(CHOICES)))
        engine.add_request(p, SamplingParams(max_tokens=12))  # free rows in the same batch
    outs = engine.run()[::2]
    assert any(len(demo.tokenizer.encode(c, add_special_tokens=False)) > 1 for c in CHOICES)
    for prompt, out in zip(prompts, outs, strict=True):
        for choice in CHOICES:
            assert out.choice_logprobs[choice] == pytest.approx(
                choice_logprob(demo, prompt, choice), abs=1e-3)
        assert out.text in CHOICES and out.constraint_complete


def test_a_prompt_ending_in_a_space_scores_choices_with_the_space_as_the_model_writes_them(
        demo):
    """An answer begun as "Label: " ends its prompt with a lone space token; the model would
    have written the space into the label's first token. The choices are scored as " label"
    after "Label:", and the answer is the label as given."""
    engine = Engine(demo.model, demo.tokenizer, EngineConfig(max_concurrency=8),
                    demo.context_length)
    prompts = [review(i) + " Label: " for i in range(3)]
    assert all(demo.tokenizer.decode(demo.tokenizer.encode(p)[-1:]) == " " for p in prompts)
    for p in prompts:
        engine.add_request(p, SamplingParams(constraint=Constraint.choices(CHOICES)))
    for prompt, out in zip(prompts, engine.run(), strict=True):
        assert out.prompt_tokens == len(demo.tokenizer.encode(prompt)) - 1
        for choice in CHOICES:
            assert out.choice_logprobs[choice] == pytest.approx(
                choice_logprob(demo, prompt[:-1], " " + choice), abs=1e-3)
        assert out.text in CHOICES


def test_constrained_greedy_output_does_not_depend_on_batch_composition(demo):
    schema = Constraint.json_schema(SCHEMA)
    regex = Constraint.regex(r"[0-9]{3}-[a-z]{2,4}")
    targets = [(review(i), schema) for i in range(3)] + [(f"Code {i}:", regex) for i in range(2)]

    def alone(prompt, constraint):
        engine = Engine(demo.model, demo.tokenizer, EngineConfig(max_concurrency=1),
                        demo.context_length)
        return engine.generate([prompt], SamplingParams(max_tokens=96,
                                                        constraint=constraint))[0].token_ids

    engine = Engine(demo.model, demo.tokenizer, EngineConfig(max_concurrency=16),
                    demo.context_length)
    ids = []
    for i, (prompt, constraint) in enumerate(targets):
        engine.add_request(f"Noise {i} " * (i + 1), SamplingParams(max_tokens=5 + 7 * i))
        ids.append(engine.add_request(prompt, SamplingParams(max_tokens=96,
                                                             constraint=constraint)))
        engine.add_request(review(50 + i), SamplingParams(max_tokens=20, temperature=1.0,
                                                          seed=i, constraint=schema))
    crowded = {o.request_id: o for o in engine.run()}
    for (prompt, constraint), rid in zip(targets, ids, strict=True):
        assert crowded[rid].token_ids == alone(prompt, constraint), prompt


def test_regex_rows_match_and_the_job_flag_applies_to_every_row(tmp_path):
    rows = [{"prompt": f"Code {i}:", "max_tokens": 40} for i in range(10)]
    rows.append({"prompt": "Own pattern:", "guided_regex": "(yes|no)"})
    job = tmp_path / "job"
    run(write_rows(tmp_path / "rows.jsonl", rows), "--job-dir", job,
        "--regex", r"[A-Z]{2}-[0-9]{2,3}", "--temperature", "1.0", "--seed", "7")
    results = jsonl(job / "results.jsonl")
    assert all(re.fullmatch(r"[A-Z]{2}-[0-9]{2,3}", r["text"]) for r in results[:10])
    assert results[10]["text"] in ("yes", "no")


def test_n_samples_are_distinct_reproducible_and_sample_0_is_the_row_itself(tmp_path):
    rows = write_rows(tmp_path / "rows.jsonl",
                      [{"prompt": review(i), "max_tokens": 12, "seed": 100 + i} for i in range(6)]
                      + [{"prompt": review(9), "max_tokens": 12, "n": 2}])
    a, b, one = tmp_path / "a", tmp_path / "b", tmp_path / "one"
    run(rows, "--job-dir", a, "--n", "4", "--temperature", "1.0")
    run(rows, "--job-dir", b, "--n", "4", "--temperature", "1.0", "--max-concurrency", "3")
    run(rows, "--job-dir", one, "--temperature", "1.0")
    ra, rb, r1 = (jsonl(d / "results.jsonl") for d in (a, b, one))
    assert ra == rb  # reproducible, whatever the batching
    for row, single in zip(ra[:6], r1[:6], strict=True):
        texts = [s["text"] for s in row["samples"]]
        assert len(texts) == 4 and len(set(texts)) >= 3  # distinct seeds, distinct samples
        assert texts[0] == row["text"] == single["text"]
        assert row["usage"]["completion_tokens"] == sum(s["completion_tokens"]
                                                        for s in row["samples"])
    assert len(ra[6]["samples"]) == 2  # the row's own n beats --n


def test_logprobs_in_openai_formats(tmp_path):
    rows = [
        {"custom_id": "native", "prompt": review(1), "max_tokens": 6, "logprobs": True,
         "top_logprobs": 3},
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": review(2)}], "max_tokens": 5,
                  "logprobs": True, "top_logprobs": 2, "n": 2, "temperature": 0.8}},
        {"custom_id": "completion", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": review(3), "max_tokens": 5, "logprobs": True, "top_logprobs": 2}},
    ]
    job = tmp_path / "job"
    run(write_rows(tmp_path / "rows.jsonl", rows), "--job-dir", job)
    native, chat, completion = jsonl(job / "results.jsonl")

    content = native["logprobs"]["content"]
    assert len(content) == native["usage"]["completion_tokens"] == 6
    assert "".join(bytes(e["bytes"]).decode("utf-8", "replace") for e in content) \
        == native["text"]
    for entry in content:
        assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 3
        assert entry["top_logprobs"][0]["token"] == entry["token"]  # greedy: the top one

    choices = chat["response"]["body"]["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    for c in choices:
        entries = c["logprobs"]["content"]
        assert entries and all(len(e["top_logprobs"]) == 2 for e in entries)
        assert "".join(e["token"] for e in entries) == c["message"]["content"]

    legacy = completion["response"]["body"]["choices"][0]["logprobs"]
    assert len(legacy["tokens"]) == len(legacy["token_logprobs"]) == len(legacy["top_logprobs"])
    assert legacy["text_offset"][0] == 0
    assert "".join(legacy["tokens"]) == completion["response"]["body"]["choices"][0]["text"]


def test_bad_constraints_are_row_errors_naming_the_field(tmp_path):
    rows = [
        {"custom_id": "ok", "prompt": "fine", "guided_choice": ["a", "b"]},
        {"custom_id": "bad-type", "prompt": "x", "response_format": {"type": "xml"}},
        {"custom_id": "bad-schema", "prompt": "x", "guided_json": {"type": "bogus"}},
        {"custom_id": "two", "prompt": "x", "guided_regex": "a+", "guided_choice": ["a"]},
        {"custom_id": "empty-choice", "prompt": "x", "guided_choice": []},
        {"custom_id": "bad-n", "prompt": "x", "n": 0},
    ]
    job = tmp_path / "job"
    run(write_rows(tmp_path / "rows.jsonl", rows), "--job-dir", job)
    assert [r["custom_id"] for r in jsonl(job / "results.jsonl")] == ["ok"]
    errors = {e["custom_id"]: e["error"] for e in jsonl(job / "errors.jsonl")}
    assert set(errors) == {"bad-type", "bad-schema", "two", "empty-choice", "bad-n"}
    assert "response_format" in errors["bad-type"]["message"]
    assert "guided_json" in errors["bad-schema"]["message"]
    assert "bogus" in errors["bad-schema"]["message"]
    assert "guided_regex" in errors["two"]["message"]
    assert errors["bad-n"]["code"] == "invalid_field" and "n must" in errors["bad-n"]["message"]


def test_bad_job_constraint_flags_are_usage_errors(tmp_path):
    rows = write_rows(tmp_path / "rows.jsonl", [{"prompt": "x"}])
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "bogus"}')
    assert "bogus" in run(rows, "--json-schema", schema, code=2).output
    assert "at most one" in run(rows, "--choices", "a,b", "--regex", "a", code=2).output
    assert "distinct" in run(rows, "--choices", "a,a", code=2).output


def test_an_answer_cut_short_of_its_schema_is_an_error_not_a_result(tmp_path):
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    rows = [{"custom_id": "short", "prompt": review(1), "max_tokens": 3,
             "response_format": schema},
            {"custom_id": "full", "prompt": review(1), "max_tokens": 96,
             "response_format": schema}]
    rows += [{"custom_id": f"object{i}", "prompt": review(i), "max_tokens": 60,
              "response_format": {"type": "json_object"}} for i in range(6)]
    job = tmp_path / "job"
    run(write_rows(tmp_path / "rows.jsonl", rows), "--job-dir", job)
    errors = {e["custom_id"]: e["error"] for e in jsonl(job / "errors.jsonl")}
    results = {r["custom_id"]: r for r in jsonl(job / "results.jsonl")}
    assert errors["short"]["code"] == "constraint_incomplete"
    assert "max_tokens" in errors["short"]["message"]
    jsonschema.validate(json.loads(results["full"]["text"]), SCHEMA)
    for i in range(6):  # a free-form object either closes within max_tokens or is an error
        row = f"object{i}"
        if row in results:
            assert isinstance(json.loads(results[row]["text"]), dict)
        else:
            assert errors[row]["code"] == "constraint_incomplete"


def test_job_file_labels_the_sample_reviews_with_choices(tmp_path):
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    shutil.copy(ROOT / "jobs" / "label_reviews_choices.toml", jobs)
    (tmp_path / "sample_data").mkdir()
    shutil.copy(ROOT / "sample_data" / "reviews.parquet", tmp_path / "sample_data")
    result = CliRunner().invoke(cli, ["run", str(jobs / "label_reviews_choices.toml"),
                                      "--quiet"])
    assert result.exit_code == 0, result.output
    table = pq.read_table(jobs / "label_reviews_choices" / "labels.parquet")
    assert table.num_rows == 200 and "review" in table.schema.names
    for text, probs in zip(table.column("text").to_pylist(),
                           table.column("choice_probs").to_pylist(), strict=True):
        probs = dict(probs)
        assert tuple(probs) == ("positive", "negative", "neutral")
        assert text in probs
        assert sum(probs.values()) == pytest.approx(1.0, abs=1e-5)


def test_choice_paths_run_each_branch_of_the_choices_once():
    from batchrun.engine.decoding.choices import choice_paths

    # inputs (each choice but its last token): (1, 2), (1, 2), (1,), () -> one path, [1, 2]
    assert choice_paths([[1, 2, 3], [1, 2, 4], [1, 5], [7]]) == ([[1, 2]], [0, 0, 0, None])
    # two branches, the longer first
    assert choice_paths([[1, 2], [3, 4, 5], [3, 6]]) == ([[3, 4], [1]], [1, 0, 0])
    assert choice_paths([[4], [5]]) == ([], [None, None])


def normalized(logprobs: dict) -> dict:
    from batchrun.engine.decoding.choices import normalized as probs

    return probs(logprobs)


def _scored_rows(monkeypatch) -> list[int]:
    """The number of rows each batched scoring call took (text backend)."""
    from batchrun.engine.backends import text

    sizes, batched = [], text.batch_choice_logprobs

    def counting(model, firsts, rows, caches_for, **kw):
        sizes.append(len(rows))
        return batched(model, firsts, rows, caches_for, **kw)

    monkeypatch.setattr(text, "batch_choice_logprobs", counting)
    return sizes


@pytest.mark.parametrize("shared", [True, False], ids=["shared-prefix", "copied-prefix"])
def test_choices_scored_together_equal_each_row_scored_alone(demo, tmp_path, monkeypatch,
                                                             shared):
    """Rows that finish their prompts in one step are scored in one forward from the batch's
    KV: the same log-probabilities as an uncached forward of each row (float32, 1e-5) and the
    same answers as at concurrency 1, with two instructions mixed in one batch, a cold and a
    warm prefix cache, greedy and seeded sampling."""
    sizes = _scored_rows(monkeypatch)
    instructions = ["Label the review's sentiment. " * 12, "Is the buyer happy? Answer. " * 14]
    prompts = [instructions[i % 2] + review(i) + " Label:" for i in range(24)]
    params = [SamplingParams(constraint=Constraint.choices(CHOICES)) if i % 3 else
              SamplingParams(constraint=Constraint.choices(CHOICES), temperature=1.0, seed=i)
              for i in range(24)]

    def outputs(concurrency: int) -> list:
        engine = Engine(demo.model, demo.tokenizer,
                        EngineConfig(max_concurrency=concurrency, shared_prefix=shared,
                                     cache_dir=str(tmp_path / f"cache-{concurrency}")),
                        demo.context_length, model_fingerprint=demo.fingerprint)
        engine.enable_prefix_cache()
        for p, sp in zip(prompts, params, strict=True):
            engine.add_request(p, sp)
        try:
            return engine.run()
        finally:
            engine.close()  # its blocks written for the warm run

    alone = outputs(1)
    assert set(sizes) == {1}  # a row alone
    cold, warm = outputs(64), outputs(64)
    assert max(sizes) > 1  # rows were scored together
    assert sum(o.cached_tokens for o in warm) > sum(o.prompt_tokens for o in warm) / 2
    for prompt, a, c, w in zip(prompts, alone, cold, warm, strict=True):
        assert a.text == c.text == w.text
        expected = {choice: choice_logprob(demo, prompt, choice) for choice in CHOICES}
        for out in (a, c, w):
            # a sum of float32 log-probabilities near -150 is good to ~1e-5 either way
            assert out.choice_logprobs == pytest.approx(expected, rel=1e-6, abs=1e-5)
            assert normalized(out.choice_logprobs) == pytest.approx(normalized(expected),
                                                                    abs=1e-5)


def test_choices_with_n_seeded_samples_do_not_depend_on_the_batch(tmp_path):
    """--n samples of a choices row: each sample's label a seeded draw from the same choice
    probabilities (scored once a sample, together with the step's other rows), the same at
    concurrency 1 and 16."""
    rows = write_rows(tmp_path / "rows.jsonl", [{"prompt": review(i)} for i in range(6)])
    outs = {}
    for conc in ("1", "16"):
        job = tmp_path / f"job-{conc}"
        run(rows, "--job-dir", job, "--choices", ",".join(CHOICES), "--n", "3",
            "--temperature", "1.0", "--seed", "7", "--max-concurrency", conc)
        outs[conc] = jsonl(job / "results.jsonl")
    for a, b in zip(outs["1"], outs["16"], strict=True):
        assert [s["text"] for s in a["samples"]] == [s["text"] for s in b["samples"]]
        assert all(s["text"] in CHOICES for s in a["samples"])
        assert a["choice_probs"] == pytest.approx(b["choice_probs"], abs=1e-5)


TOOLS = [{"type": "function", "function": {
    "name": "weather", "parameters": {"type": "object", "additionalProperties": False,
                                      "properties": {"city": {"type": "string", "maxLength": 12}},
                                      "required": ["city"]}}},
         {"type": "function", "function": {
             "name": "time", "parameters": {"type": "object", "additionalProperties": False,
                                            "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                            "required": ["zone"]}}}]


def test_tool_choice_required_or_named_makes_every_answer_a_call(tmp_path):
    """`tool_choice: "required"` answers with a call of one of the tools, a named function
    with a call of it, its arguments valid against the tool's parameters; one that cannot be
    honoured is the row's error."""
    def line(name, choice, tools=TOOLS, content="Weather in Paris?"):
        return {"custom_id": name, "method": "POST", "url": "/v1/chat/completions",
                "body": {"messages": [{"role": "user", "content": content}], "tools": tools,
                         "tool_choice": choice, "max_tokens": 60}}

    rows = [*(line(f"req{i}", "required", content=f"Question {i}?") for i in range(4)),
            line("named", {"type": "function", "function": {"name": "time"}}),
            line("unknown", {"type": "function", "function": {"name": "nope"}}),
            line("no-tools", "required", tools=None), line("odd", "sometimes")]
    job = tmp_path / "job"
    run(write_rows(tmp_path / "rows.jsonl", rows), "--job-dir", job)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    results = {r["custom_id"]: r["response"]["body"]["choices"][0]
               for r in jsonl(job / "results.jsonl")}
    assert set(results) == {"req0", "req1", "req2", "req3", "named"}
    for name, choice in results.items():
        assert choice["finish_reason"] == "tool_calls", name
        (call,) = choice["message"]["tool_calls"]
        function = call["function"]
        assert function["name"] in schemas
        jsonschema.validate(json.loads(function["arguments"]), schemas[function["name"]])
    assert results["named"]["message"]["tool_calls"][0]["function"]["name"] == "time"
    errors = {e["custom_id"]: e["error"] for e in jsonl(job / "errors.jsonl")}
    assert {k: e["code"] for k, e in errors.items()} == {
        "unknown": "invalid_field", "no-tools": "invalid_field", "odd": "invalid_field"}
    assert "'nope'" in errors["unknown"]["message"]


def test_tool_choice_on_a_tool_format_that_cannot_be_constrained_is_the_rows_error(demo):
    from batchrun.engine.backends.prompt import PromptBuilder
    from batchrun.job.rows import RowError, RowOptions, build_task

    body = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
            "tool_choice": "required"}
    row = {"custom_id": "a", "url": "/v1/chat/completions", "body": body}
    # a model whose tool calls are not JSON between two markers: no markup to constrain to
    error = build_task(row, 0, 1, PromptBuilder(demo.tokenizer),
                       RowOptions(tool_form=None))
    assert isinstance(error, RowError) and error.code == "unsupported_field"
    assert "cannot be constrained" in error.message


def test_a_grammar_past_the_grammar_engines_symbol_count_is_refused_not_a_panic(demo):
    """llguidance numbers a grammar's symbols in 16 bits and panics past 65,525 of them (a
    tool call of thousands of arguments reached it); the size limit refuses such a grammar
    first, with an error that says so."""
    from batchrun.engine.backends.text import vocab_size
    from batchrun.engine.decoding.constrain import Grammars
    from batchrun.engine.types import ConstraintError

    grammars = Grammars(demo.tokenizer, vocab_size(demo.model, demo.tokenizer))
    n = 20_000  # JSON values, a few symbols each
    lark = ("start: " + " | ".join(f"v{i}" for i in range(n)) + "\n" + "\n".join(
        f'v{i}: "k{i}=" %json {{"type": "integer", "minimum": {i}}}' for i in range(n)))
    with pytest.raises(ConstraintError, match="number of symbols") as refused:
        grammars.check(Constraint("lark", lark))
    assert "panic" not in str(refused.value)


def test_an_answer_the_grammar_engine_gives_up_on_is_an_error_that_says_why(tmp_path):
    """A schema that compiles but outgrows llguidance's parser while the row decodes (600
    optional properties: more items than it holds where any may come next) ends the row; the
    error gives the engine's reason, not a shortage of max_tokens."""
    wide = {"type": "object", "additionalProperties": False,
            "properties": {f"p{i}": {"type": "integer"} for i in range(600)}}
    rows = [{"custom_id": "wide", "messages": [{"role": "user", "content": "Q?"}],
             "guided_json": wide, "max_tokens": 40},
            {"custom_id": "short", "prompt": "x", "guided_json": SCHEMA, "max_tokens": 3},
            {"custom_id": "free", "prompt": "x", "max_tokens": 3}]
    job = tmp_path / "job"
    run(write_rows(tmp_path / "rows.jsonl", rows), "--job-dir", job)
    errors = {e["custom_id"]: e["error"] for e in jsonl(job / "errors.jsonl")}
    assert errors["wide"]["code"] == "constraint_incomplete"
    assert "grammar engine gave up" in errors["wide"]["message"]
    assert "items" in errors["wide"]["message"]  # its reason, first line only
    assert "\n" not in errors["wide"]["message"]
    assert "max_tokens" in errors["short"]["message"]  # cut short: still said so
