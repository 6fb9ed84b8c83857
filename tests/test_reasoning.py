"""Reasoning blocks and tool calls: taken out of the answer into their own fields, a constraint
that starts after the reasoning, and a reasoning budget. The demo model's template thinks
(`<think>`) and calls tools (`<tool_call>`); its outputs are forced with regexes and logit bias."""

import json

import orjson
import pytest
from helpers import jsonl, run, write_rows
from mlx_lm.tool_parsers import mistral
from openai.types.chat import ChatCompletion

from batchrun.engine.decoding.reasoning import Markup, parse_tool_calls, split_reasoning
from batchrun.engine.engine import Engine
from batchrun.engine.types import Constraint, FinishReason, Output
from batchrun.job.records import result_record
from batchrun.job.rows import RowError, RowOptions, Task, build_task

THINK = Markup(think_start="<think>", think_end="</think>", think_start_id=771, think_end_id=772)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.fixture(scope="module")
def demo():
    return Engine.load(None)


def test_the_demo_tokenizer_knows_its_markup(demo):
    m = demo.markup
    assert (m.think_start, m.think_end, m.tool_start, m.tool_end) == \
        ("<think>", "</think>", "<tool_call>", "</tool_call>")
    assert demo.tokenizer.encode("<think></think>", add_special_tokens=False) == \
        [m.think_start_id, m.think_end_id]


@pytest.mark.parametrize(("text", "opened", "expected"), [
    ("<think>weigh it</think>\n\nyes", False, ("weigh it", "yes")),
    ("  <think>\nweigh it\n</think>yes", False, ("weigh it", "yes")),
    ("weigh it</think>yes", True, ("weigh it", "yes")),  # the template opened the block
    ("<think>still weighing", False, ("still weighing", "")),  # cut off by max_tokens
    ("yes <think>no</think>", False, (None, "yes <think>no</think>")),  # not at the start
])
def test_split_reasoning(text, opened, expected):
    assert split_reasoning(text, THINK, opened) == expected


def test_tool_calls_in_each_family_format():
    hermes = Markup(tool_start="<tool_call>", tool_end="</tool_call>",
                    tool_parser=lambda body, tools: orjson.loads(body))
    content, calls = parse_tool_calls(f"Let me look. {CALL}", hermes, TOOLS)
    assert content == "Let me look." and [(c.name, orjson.loads(c.arguments)) for c in calls] \
        == [("get_weather", {"city": "Paris"})]
    assert parse_tool_calls(CALL, hermes, None) == (CALL, [])  # no tools offered: plain text
    broken = '<tool_call>{"name": "get_weather", "arguments": </tool_call>'
    assert parse_tool_calls(broken, hermes, TOOLS) == (broken, [])  # left as the model wrote

    llama3 = Markup()  # no markers: a bare JSON object naming an offered tool
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    content, calls = parse_tool_calls(text, llama3, TOOLS)
    assert content == "" and calls[0].name == "get_weather" \
        and orjson.loads(calls[0].arguments) == {"city": "Oslo"}
    other = '{"name": "launch", "parameters": {}}'
    assert parse_tool_calls(other, llama3, TOOLS) == (other, [])  # not an offered tool

    mistral_markup = Markup(tool_start=mistral.tool_call_start, tool_end=mistral.tool_call_end,
                            tool_parser=mistral.parse_tool_call)
    text = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}]'
    content, calls = parse_tool_calls(text, mistral_markup, TOOLS)
    assert content == "" and [(c.name, orjson.loads(c.arguments)) for c in calls] == \
        [("get_weather", {"city": "Rome"})]


def chat(name, **fields):
    return {"custom_id": name, "messages": [{"role": "user", "content": "Is it good?"}],
            **fields}


def openai_chat(name, **body):
    return {"custom_id": name, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "anything", "messages": [{"role": "user", "content": "Hi"}]} | body}


def record(demo, row, text, thinking_opened=False, **options):
    """The record a row gets when the model wrote `text` (the engine's part is tested below)."""
    task = build_task(row, 0, 1, demo.prompts, RowOptions(**options))
    assert isinstance(task, Task), task
    out = Output(0, text, [1] * 5, FinishReason.STOP, prompt_tokens=len(task.prompt_ids),
                 thinking_opened=thinking_opened)
    return result_record(task, [out], "demo", 0, lambda t: b"x", demo.markup)


def test_reasoning_and_tool_calls_get_their_own_fields(demo):
    think = record(demo, chat("think"), "<think>weigh it</think>\n\nyes")
    assert (think["reasoning"], think["text"]) == ("weigh it", "yes")
    call = record(demo, chat("call", tools=TOOLS), f"Let me check. {CALL}")
    assert call["finish_reason"] == "tool_calls" and call["text"] == "Let me check."
    assert call["tool_calls"] == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    both = record(demo, chat("both", tools=TOOLS), f"it rains?</think>{CALL}",
                  thinking_opened=True)
    assert both["reasoning"] == "it rains?" and both["tool_calls"][0]["name"] == "get_weather"
    plain = record(demo, chat("plain"), "yes")
    assert plain == {**plain, "text": "yes", "finish_reason": "stop"} \
        and "reasoning" not in plain and "tool_calls" not in plain
    no_tools = record(demo, chat("no-tools"), CALL)  # no tools offered: just text
    assert no_tools["text"] == CALL and no_tools["finish_reason"] == "stop"
    raw = record(demo, {"custom_id": "raw", "prompt": "Q:"}, "<think>ab</think>c")
    assert raw["text"] == "<think>ab</think>c" and "reasoning" not in raw  # no template


def test_openai_chat_bodies_carry_reasoning_and_tool_calls(demo):
    think = record(demo, openai_chat("think"), "<think>hmm</think>yes")
    call = record(demo, openai_chat("call", tools=TOOLS), CALL)
    none = record(demo, openai_chat("none", tools=TOOLS, tool_choice="none"), CALL)
    for line in (think, call, none):
        body = line["response"]["body"]
        ChatCompletion.model_validate(body)
        assert body["model"] == "demo"  # the model that answered, not the one asked for
    think, call, none = (line["response"]["body"]["choices"][0] for line in (think, call, none))
    assert think["message"]["content"] == "yes" and think["message"]["reasoning"] == "hmm"
    assert call["finish_reason"] == "tool_calls" and call["message"]["content"] is None
    (tool_call,) = call["message"]["tool_calls"]
    assert tool_call["type"] == "function" and tool_call["id"].startswith("call_")
    assert tool_call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert "tool_calls" not in none["message"] and none["finish_reason"] == "stop"


def test_served_model_names_refuse_other_models(demo):
    options = {"served_model_names": ("demo", "demo-alias")}
    for name in ("demo", "demo-alias"):
        assert isinstance(build_task(openai_chat("a", model=name), 0, 1, demo.prompts,
                                     RowOptions(**options)), Task)
    error = build_task(openai_chat("b", model="gpt-4o"), 0, 1, demo.prompts,
                       RowOptions(**options))
    assert isinstance(error, RowError) and error.code == "model_not_found"
    assert "'gpt-4o'" in error.message and "'demo-alias'" in error.message
    assert isinstance(build_task(openai_chat("c", model="gpt-4o"), 0, 1, demo.prompts,
                                 RowOptions()), Task)  # no names given: any model


def test_a_constraint_applies_after_the_reasoning_which_its_budget_ends(demo, tmp_path):
    """The row asks for thinking; a +100 bias on <think> makes the model open a block and keep
    writing <think> in it. The budget ends the block after 3 tokens; the answer that follows
    matches the choices (the bias cannot reach past the grammar)."""
    rows = write_rows(tmp_path / "rows.jsonl", [
        chat(f"r{budget}", enable_thinking=True, logit_bias={"771": 100},
             max_thinking_tokens=budget, guided_choice=["yes", "no"]) for budget in (0, 3)
    ] + [chat("no-thinking", logit_bias={"771": 100}, guided_choice=["yes", "no"])])
    run(rows, "--job-dir", tmp_path / "job", "--max-tokens", "12")
    zero, three, off = jsonl(tmp_path / "job" / "results.jsonl")
    assert zero["reasoning"] == "" and zero["text"] in ("yes", "no")
    assert three["reasoning"] == "<think>" * 3 and three["text"] in ("yes", "no")
    assert off["text"] in ("yes", "no") and "reasoning" not in off  # the grammar from the start
    assert "choice_probs" in off  # scored right after the prompt, as before


def test_a_thinking_budget_ends_the_block_of_a_free_row(demo):
    from batchrun.engine.types import SamplingParams

    out = demo.generate([[{"role": "user", "content": "Hi"}]], SamplingParams(
        max_tokens=6, logit_bias=((771, 100.0),), max_thinking_tokens=2))[0]
    # <think>, two tokens of reasoning, the forced </think>, then the bias again.
    assert out.token_ids[:4] == [771, 771, 771, 772] and out.token_ids[4] == 771


def test_parquet_output_has_reasoning_and_tool_call_columns(demo, tmp_path):
    import pyarrow.parquet as pq

    from batchrun.io.parquet_output import flat_result

    rows = write_rows(tmp_path / "rows.jsonl", [
        chat("think", enable_thinking=True, logit_bias={"771": 100}, max_thinking_tokens=2,
             guided_choice=["yes", "no"]),
        chat("plain", guided_choice=["yes", "no"])])
    run(rows, "--job-dir", tmp_path / "job", "--max-tokens", "8", "-o", tmp_path / "out.parquet")
    table = pq.read_table(tmp_path / "out.parquet").to_pylist()
    assert table[0]["reasoning"] == "<think>" * 2 and table[0]["text"] in ("yes", "no")
    assert table[1]["reasoning"] is None and table[1]["tool_calls"] is None
    call = record(demo, openai_chat("call", tools=TOOLS), CALL)
    assert orjson.loads(flat_result(call)["tool_calls"]) == \
        [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    native = record(demo, chat("call", tools=TOOLS), CALL)
    assert flat_result(native)["tool_calls"] == flat_result(call)["tool_calls"]


def test_bodies_name_the_first_served_model_name(tmp_path):
    rows = write_rows(tmp_path / "rows.jsonl", [openai_chat("a", model="alias", max_tokens=2),
                                                openai_chat("b", model="gpt-4o", max_tokens=2)])
    run(rows, "--job-dir", tmp_path / "job", "--served-model-name", "demo-lm,alias")
    (ok,) = jsonl(tmp_path / "job" / "results.jsonl")
    (refused,) = jsonl(tmp_path / "job" / "errors.jsonl")
    assert ok["custom_id"] == "a" and ok["response"]["body"]["model"] == "demo-lm"
    assert refused["custom_id"] == "b" and refused["error"]["code"] == "model_not_found"
    assert refused["response"] is None


def test_tool_call_text_that_breaks_a_parser_stays_text():
    hermes = Markup(tool_start="<tool_call>", tool_end="</tool_call>",
                    tool_parser=lambda body, tools: json.loads(body))  # as mlx-lm's json_tools
    deep = "<tool_call>" + "[" * 5000 + "</tool_call>"  # RecursionError in json.loads
    assert parse_tool_calls(deep, hermes, TOOLS) == (deep, [])
    surrogate = '<tool_call>{"name": "get_weather", "arguments": {"x": "\\ud800"}}</tool_call>'
    assert parse_tool_calls(surrogate, hermes, TOOLS) == (surrogate, [])  # not UTF-8 writable


def test_only_a_block_the_template_opens_counts_not_a_think_tag_in_the_question(demo):
    m = demo.markup
    opened = demo.prompts.encode_chat([{"role": "user", "content": "Hi"}]) + [m.think_start_id]
    assert m.opens_thinking(opened) and m.opens_thinking(opened + [90, 91])
    asked = demo.prompts.encode_chat(
        [{"role": "user", "content": "What does the <think> tag do?"}])
    assert m.think_start_id in asked and not m.opens_thinking(asked)
    out = demo.generate([[{"role": "user", "content": "What does the <think> tag do?"}]],
                        max_tokens=4, constraint=Constraint.choices(["yes", "no"]))[0]
    assert out.text in ("yes", "no") and not out.thinking_opened


def test_a_raw_prompt_is_never_read_as_reasoning(tmp_path):
    rows = write_rows(tmp_path / "rows.jsonl", [
        {"custom_id": "raw", "prompt": "Question? <think>", "guided_choice": ["yes", "no"],
         "max_thinking_tokens": 2, "enable_thinking": True, "max_tokens": 10}])
    run(rows, "--job-dir", tmp_path / "job")
    (row,) = jsonl(tmp_path / "job" / "results.jsonl")
    assert row["text"] in ("yes", "no") and "reasoning" not in row and "choice_probs" in row


def test_a_choice_longer_than_the_context_is_that_row_s_error(tmp_path):
    rows = write_rows(tmp_path / "rows.jsonl", [
        {"custom_id": "long", "prompt": "hi", "guided_choice": ["A" * 9000, "B"]},
        {"custom_id": "fine", "prompt": "hi", "guided_choice": ["A", "B"]}])
    # Past the choice-length limit first; with the limit raised, past the context.
    for limit, message in (("choice-chars=1024", "over the limit of 1,024"),
                           ("choice-chars=20000", "exceed the model's context")):
        job = tmp_path / limit
        run(rows, "--job-dir", job, "--limit", limit)
        (error,) = jsonl(job / "errors.jsonl")
        assert error["custom_id"] == "long" and message in error["error"]["message"]
        assert [r["custom_id"] for r in jsonl(job / "results.jsonl")] == ["fine"]
