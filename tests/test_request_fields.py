"""Every OpenAI / vLLM request field a migrated batch file may carry is honoured, or the row is
an error naming the field: never silently answered as if it were absent."""

import mlx.core as mx
import orjson
import pytest
from helpers import jsonl, run, write_rows

from batchrun.engine.decoding.sampling import LogitAdjustments
from batchrun.engine.engine import Engine
from batchrun.engine.types import SamplingParams

PROMPT = "Review: the kettle is fine"


@pytest.fixture(scope="module")
def engine():
    return Engine.load(None)


def tokens(engine, **sampling) -> list[int]:
    return engine.generate([PROMPT], SamplingParams(max_tokens=8, **sampling))[0].token_ids


def test_a_logit_bias_of_100_forces_its_token_and_minus_100_bans_one(engine):
    free = tokens(engine)
    assert tokens(engine, logit_bias=((100, 100.0),)) == [100] * 8
    banned = tokens(engine, logit_bias=((free[0], -100.0),))
    assert banned[0] != free[0] and free[0] not in banned


def test_min_tokens_bars_the_stop_token_until_reached(engine):
    first = tokens(engine)[0]
    assert tokens(engine, stop_token_ids=(first,)) == []  # stops at once
    out = engine.generate([PROMPT], SamplingParams(max_tokens=8, stop_token_ids=(first,),
                                                   min_tokens=3))[0]
    assert len(out.token_ids) >= 3 and first not in out.token_ids[:3]


def test_a_plain_steps_bias_and_min_tokens_are_each_rows_own_call_bit_for_bit():
    """A decode step applies the rows' logit bias and min_tokens all at once; each row gets
    exactly what its own processor's call gives, step after step, and rows without them, or
    with a penalty (which reads the row's tokens), are left to their own."""
    from mlx_lm.models.cache import TokenBuffer

    from batchrun.engine.backends.batch import LeanGenerationBatch

    end = 2
    rows = [SamplingParams(min_tokens=2, logit_bias=((4, 3.5), (9, -1.25))), None,
            SamplingParams(min_tokens=1, stop_token_ids=(6,)),
            SamplingParams(presence_penalty=0.5, min_tokens=1),
            SamplingParams(logit_bias=((2, 0.75),))]
    batch = LeanGenerationBatch.__new__(LeanGenerationBatch)
    batch.logits_processors = [[LogitAdjustments(p, (end,))] if p else [] for p in rows]
    batch._token_context = [TokenBuffer([1, 2]) if p else None for p in rows]
    own = [LogitAdjustments(p, (end,)) if p else None for p in rows]  # each row's own calls
    for step in range(3):
        logits = mx.random.normal((len(rows), 12), key=mx.random.key(step))
        inputs = mx.array([3, 4, 5, 7, 8])
        got, _ = batch._process(mx.array(logits), inputs)
        for i, adjust in enumerate(own):
            context = mx.array([1, 2, *[7] * (step + 1)])  # the penalty row's tokens
            want = logits[i] if adjust is None else adjust(context, logits[i:i + 1])[0]
            assert got[i].tolist() == want.tolist(), (step, i)
        assert mx.isinf(got[0, end]).item() == (step < 2)  # 2 tokens before it may end
        assert mx.isinf(got[2, 6]).item() == (step < 1)


def test_penalties_change_logits_as_openai_and_vllm_define_them():
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25,
                            repetition_penalty=2.0, logit_bias=((0, 1.0),))
    adjust = LogitAdjustments(params, end_ids=(5,))
    logits = mx.array([[1.0, -1.0, 2.0, 4.0, 0.5, 3.0]])
    first = adjust(mx.array([1]), logits)[0].tolist()  # nothing generated yet: bias, repetition
    assert first == pytest.approx([2.0, -2.0, 2.0, 4.0, 0.5, 3.0])
    for context in ([1, 3], [1, 3, 3]):
        adjust(mx.array(context), logits)
    # The prompt was [1]; tokens 3, 3 and 2 were generated.
    out = adjust(mx.array([1, 3, 3, 2]), logits)[0].tolist()
    assert out[0] == pytest.approx(2.0)  # bias +1
    assert out[1] == pytest.approx(-2.0)  # in the prompt: repetition only (x2, negative)
    assert out[2] == pytest.approx(2.0 / 2 - 0.25 - 0.5)  # generated once
    assert out[3] == pytest.approx(4.0 / 2 - 2 * 0.25 - 0.5)  # generated twice
    assert out[4] == pytest.approx(0.5)  # never seen
    assert out[5] == pytest.approx(3.0)


def test_migrated_openai_rows_honour_or_reject_every_field(tmp_path):
    def row(name, **body):
        return {"custom_id": name, "method": "POST", "url": "/v1/completions",
                "body": {"model": "m", "prompt": PROMPT, "max_tokens": 6, **body}}

    rows = [row("bias", logit_bias={"100": 100}),
            row("penalties", presence_penalty=1.0, frequency_penalty=1.0,
                repetition_penalty=1.3),
            row("logprobs", logprobs=2),
            row("best_of", best_of=3), row("echo", echo=True), row("suffix", suffix="x"),
            row("bad_bias", logit_bias={"x": 1}), row("too_big", logit_bias={"99999": 1}),
            row("plain")]
    job = tmp_path / "job"
    run(write_rows(tmp_path / "rows.jsonl", rows), "--job-dir", job)
    out = {r["custom_id"]: r for r in jsonl(job / "results.jsonl")}
    errors = {r["custom_id"]: r for r in jsonl(job / "errors.jsonl")}
    assert set(out) == {"bias", "penalties", "logprobs", "plain"}
    assert out["bias"]["response"]["body"]["choices"][0]["text"] != \
        out["plain"]["response"]["body"]["choices"][0]["text"]
    top = out["logprobs"]["response"]["body"]["choices"][0]["logprobs"]["top_logprobs"]
    assert len(top) == 6 and all(1 <= len(t) <= 2 for t in top)  # keyed by text: may merge
    for name in ("best_of", "echo", "suffix"):
        assert errors[name]["error"]["code"] == "unsupported_field"
        assert name in errors[name]["error"]["message"]
    assert "logit_bias" in errors["bad_bias"]["error"]["message"]
    assert "logit_bias" in errors["too_big"]["error"]["message"]


def test_top_level_enable_thinking_reaches_the_chat_template(tmp_path):
    chat = [{"role": "user", "content": "Is the kettle good?"}]
    rows = [{"custom_id": str(v), "messages": chat, "enable_thinking": v, "max_tokens": 2}
            for v in (True, False)]
    job = tmp_path / "job"
    run(write_rows(tmp_path / "rows.jsonl", rows), "--job-dir", job)
    prompt_tokens = {r["custom_id"]: r["usage"]["prompt_tokens"]
                     for r in jsonl(job / "results.jsonl")}
    assert prompt_tokens["True"] != prompt_tokens["False"]


def test_every_openai_rows_error_has_the_batch_error_file_shape(tmp_path):
    """Errors found while reading the row and errors from the engine look alike."""
    def line(name, body):
        return {"custom_id": name, "method": "POST", "url": "/v1/chat/completions",
                "body": body}

    rows = [line("parse", {"messages": "not a list"}),
            line("field", {"messages": [{"role": "user", "content": "hi"}], "echo": True}),
            line("engine", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                            "logit_bias": {"99999": 1}}),
            line("parse", {"messages": [{"role": "user", "content": "hi"}]}),  # a duplicate id
            {"custom_id": "plain", "prompt": ""}]
    job = tmp_path / "job"
    run(write_rows(tmp_path / "rows.jsonl", rows), "--job-dir", job, code=1)  # all 5 failed
    errors = jsonl(job / "errors.jsonl")
    assert len(errors) == 5
    for i, record in enumerate(errors[:4]):
        assert set(record) == {"id", "custom_id", "response", "error"}
        assert record["response"] is None and record["id"].startswith("batch_req_")
        assert record["error"] == {**record["error"], "param": None, "line": i + 1}
        assert set(record["error"]) == {"code", "message", "param", "line"}
    assert set(errors[4]) == {"custom_id", "index", "line", "error"}  # not a batch line
    # error ids are the job's own: the same rows in another job get other ids
    other = tmp_path / "other"
    run(tmp_path / "rows.jsonl", "--job-dir", other, code=1)
    assert not {e.get("id") for e in errors[:4]} & {e.get("id") for e in jsonl(
        other / "errors.jsonl")}


def test_the_report_counts_the_models_rows_asked_for_and_bodies_name_the_one_that_answered(
        tmp_path):
    def row(i, model):
        return {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": model, "max_tokens": 2,
                         "messages": [{"role": "user", "content": f"row {i}"}]}}

    rows = write_rows(tmp_path / "rows.jsonl",
                      [row(0, "gpt-4o-mini"), row(1, "gpt-4o-mini"), row(2, "llama")])
    run(rows, "--job-dir", tmp_path / "job")
    report = orjson.loads((tmp_path / "job" / "report.json").read_bytes())
    assert report["models_requested"] == {"gpt-4o-mini": 2, "llama": 1}
    answered = {r["response"]["body"]["model"] for r in jsonl(tmp_path / "job" / "results.jsonl")}
    assert answered == {report["model"]}


def test_a_completions_prompt_may_be_token_ids_or_a_list_of_prompts(tmp_path, demo):
    """As OpenAI's /v1/completions: a list of prompts gives one choice a prompt (n each,
    numbered prompt * n + sample) in one response; token ids are a prompt as they are."""
    def line(name, prompt, **extra):
        return {"custom_id": name, "method": "POST", "url": "/v1/completions",
                "body": {"prompt": prompt, "max_tokens": 3, **extra}}

    ids = demo.tokenizer.encode("Once upon a time")
    vocab = len(demo.tokenizer.get_vocab())
    rows = [line("one", "Once upon a time"), line("two", "The sea is"),
            line("list", ["Once upon a time", "The sea is"], n=2),
            line("ids", ids), line("lists", [ids, "The sea is"]),
            line("bad-id", [1, vocab + 5]), line("empty", []), line("mixed", ["x", 3])]
    job = tmp_path / "job"
    run(write_rows(tmp_path / "rows.jsonl", rows), "--job-dir", job)
    out = {r["custom_id"]: r["response"]["body"] for r in jsonl(job / "results.jsonl")}
    text = {k: [c["text"] for c in b["choices"]] for k, b in out.items()}
    one, two = text["one"][0], text["two"][0]
    assert text["list"] == [one, one, two, two]
    assert [c["index"] for c in out["list"]["choices"]] == [0, 1, 2, 3]
    assert text["ids"] == [one] and text["lists"] == [one, two]
    usage = out["list"]["usage"]
    assert usage["prompt_tokens"] == out["one"]["usage"]["prompt_tokens"] + \
        out["two"]["usage"]["prompt_tokens"]
    errors = {e["custom_id"]: e["error"] for e in jsonl(job / "errors.jsonl")}
    assert set(errors) == {"bad-id", "empty", "mixed"}
    assert all(e["code"] == "invalid_prompt" for e in errors.values())
    assert "token ids" in errors["bad-id"]["message"]


def test_a_callers_logits_processors_run_as_mlx_lm_runs_them(engine, demo):
    """SamplingParams(logits_processors=[f]): f(tokens, logits) -> logits each step, with the
    row's tokens so far, as mlx-lm's generate_step calls it; alone or batched, the same."""
    from mlx_lm.generate import generate_step

    def no_repeat(tokens, logits):  # the token just before may not come again
        return logits.at[..., tokens[-1]].add(-1e9) if tokens.size else logits

    prompt = "Once upon a time there was"
    ids = demo.tokenizer.encode(prompt)
    want = [int(t) for t, _ in generate_step(mx.array(ids), demo.model, max_tokens=8,
                                             logits_processors=[no_repeat])]
    params = SamplingParams(max_tokens=8, logits_processors=[no_repeat])
    alone = engine.generate([ids], params)[0].token_ids
    batched = engine.generate([ids, "Another row", [1, 2, 3]], params)[0].token_ids
    assert alone == batched == want[:len(alone)] and len(alone) >= 2
    assert all(a != b for a, b in zip(alone, alone[1:], strict=False))
    forced = engine.generate(["Hello"], SamplingParams(
        max_tokens=4, logits_processors=[lambda t, x: x.at[..., 42].add(1e9)]))[0]
    assert forced.token_ids == [42] * 4
    with pytest.raises(ValueError, match="logits_processors"):
        SamplingParams(logits_processors=["not callable"])
