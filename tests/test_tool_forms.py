"""`tool_choice` "required" and named functions for every tool-call format a grammar writes
(engine/decoding/tool_grammar.py): the demo model given each family's chat template answers
with a call its family's parser (mlx-lm's) reads back, arguments valid against the tool."""

import json
import shutil

import jsonschema
import pytest
from helpers import jsonl, run, write_rows

from batchrun.engine.backends.text import vocab_size
from batchrun.engine.decoding.constrain import Grammars
from batchrun.engine.decoding.reasoning import Markup, parse_tool_calls
from batchrun.engine.decoding.tool_grammar import ToolForm, tool_call_constraint
from batchrun.engine.types import ConstraintError
from batchrun.models import RANDOM_DEMO_MODEL, load_model

TOOLS = [{"type": "function", "function": {
    "name": "weather", "parameters": {
        "type": "object", "additionalProperties": False,
        "properties": {"city": {"type": "string", "maxLength": 12},
                       "days": {"type": "integer", "minimum": 1, "maximum": 7},
                       "metric": {"type": "boolean"}},
        "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "time", "parameters": {
            "type": "object", "additionalProperties": False,
            "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

_SHOW_TOOLS = "{%- if tools %}TOOLS {{ tools | tojson }}\n{% endif -%}"
_TURNS = ("{%- for m in messages %}{% if m.role == 'user' %}USER {{ m.content }}\n"
          "{% elif m.role == 'assistant' %}ASSISTANT {%- if m.tool_calls %}{CALLS}"
          "{% else %}{{ m.content }}{% endif %}\n{% endif %}{% endfor -%}"
          "{%- if add_generation_prompt %}ASSISTANT {% endif -%}")
CALLS = {
    "mistral_args": "[TOOL_CALLS]{% for c in m.tool_calls %}{{ c.function.name }}[ARGS]"
                    "{{ c.function.arguments | tojson }}{% endfor %}",
    "mistral_list": "[TOOL_CALLS][{% for c in m.tool_calls %}{\"name\": "
                    "\"{{ c.function.name }}\", \"arguments\": "
                    "{{ c.function.arguments | tojson }}}{% endfor %}]",
    "pythonic": "<|tool_call_start|>[{% for c in m.tool_calls %}{{ c.function.name }}("
                "{% for k, v in c.function.arguments.items() %}{{ k }}={{ v | tojson }}"
                "{% if not loop.last %}, {% endif %}{% endfor %}){% endfor %}]"
                "<|tool_call_end|>",
    "qwen3_coder": "{% for c in m.tool_calls %}<tool_call>\n<function={{ c.function.name }}>\n"
                   "{% for k, v in c.function.arguments.items() %}<parameter={{ k }}>\n{{ v }}\n"
                   "</parameter>\n{% endfor %}</function>\n</tool_call>{% endfor %}",
    "bare": "{% for c in m.tool_calls %}{\"name\": \"{{ c.function.name }}\", \"parameters\": "
            "{{ c.function.arguments | tojson }}}{% endfor %}",
}
# How each family writes a call of weather(city="Paris", days=3) and time(zone="CET"), by hand
WRITTEN = {
    "mistral_args": ['[TOOL_CALLS]weather[ARGS]{"city": "Paris", "days": 3}',
                     '[TOOL_CALLS]time[ARGS]{"zone": "CET"}'],
    "mistral_list": ['[TOOL_CALLS][{"name": "weather", "arguments": {"city": "Paris", '
                     '"days": 3}}]', '[TOOL_CALLS][{"name": "time", "arguments": '
                                     '{"zone": "CET"}}]'],
    "pythonic": ['<|tool_call_start|>[weather(city="Paris", days=3)]<|tool_call_end|>',
                 '<|tool_call_start|>[time(zone="CET")]<|tool_call_end|>'],
    "qwen3_coder": ["<tool_call>\n<function=weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
                    "<tool_call>\n<function=time>\n<parameter=zone>\nCET\n</parameter>\n"
                    "</function>\n</tool_call>"],
    "bare": ['{"name": "weather", "parameters": {"city": "Paris", "days": 3}}',
             '{"name": "time", "parameters": {"zone": "CET"}}'],
}
# ... and calls its grammar must refuse: an unknown tool, a required argument left out, an
# argument against its schema
REFUSED = {
    "mistral_args": ['[TOOL_CALLS]nope[ARGS]{"city": "Paris"}', '[TOOL_CALLS]weather[ARGS]{}',
                     '[TOOL_CALLS]time[ARGS]{"zone": "PST"}'],
    "mistral_list": ['[TOOL_CALLS][{"name": "nope", "arguments": {}}]',
                     '[TOOL_CALLS][{"name": "weather", "arguments": {}}]',
                     '[TOOL_CALLS][{"name": "time", "arguments": {"zone": "PST"}}]'],
    "pythonic": ['<|tool_call_start|>[nope(city="Paris")]<|tool_call_end|>',
                 '<|tool_call_start|>[weather(days=3)]<|tool_call_end|>',
                 '<|tool_call_start|>[weather(city="Paris", days=9)]<|tool_call_end|>'],
    "qwen3_coder": ["<tool_call>\n<function=nope>\n</function>\n</tool_call>",
                    "<tool_call>\n<function=weather>\n</function>\n</tool_call>",
                    "<tool_call>\n<function=weather>\n<parameter=city>\nA city whose name is "
                    "too long\n</parameter>\n</function>\n</tool_call>"],
    "bare": ['{"name": "nope", "parameters": {}}', '{"name": "weather", "parameters": {}}',
             '{"name": "time", "parameters": {"zone": "PST"}}'],
}


def family_model(tmp_path, form):
    """The demo model whose chat template writes calls in `form`'s way."""
    folder = tmp_path / f"model-{form}"
    shutil.copytree(RANDOM_DEMO_MODEL, folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = _SHOW_TOOLS + _TURNS.replace("{CALLS}", CALLS[form])
    config.pop("tool_parser_type", None)
    config_path.write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def demo_grammars():
    model = load_model(str(RANDOM_DEMO_MODEL))
    return model.tokenizer, Grammars(model.tokenizer,
                                     vocab_size(model.model, model.tokenizer))


def _accepts(grammars, tokenizer, constraint, text) -> bool:
    matcher = grammars.matcher(constraint)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return bool(matcher.consume_tokens(ids)) and matcher.is_accepting() \
        and not matcher.is_error()


@pytest.mark.parametrize("form", sorted(WRITTEN))
def test_each_forms_grammar_takes_a_valid_call_and_refuses_a_wrong_one(tmp_path, form,
                                                                       demo_grammars):
    tokenizer, grammars = demo_grammars
    model = load_model(str(family_model(tmp_path, form)))
    markup = Markup.of(model.tokenizer)
    assert markup.tool_format == form
    tool_form = ToolForm.of(markup, lambda text: model.tokenizer.encode(
        text, add_special_tokens=False))
    constraint = tool_call_constraint(TOOLS, tool_form)
    for text in WRITTEN[form]:
        assert _accepts(grammars, tokenizer, constraint, text), text
        answer, calls = parse_tool_calls(text, markup, TOOLS)  # the family's parser reads it
        assert answer == "" and len(calls) == 1
    (weather,), (time,) = (parse_tool_calls(t, markup, TOOLS)[1] for t in WRITTEN[form])
    assert (weather.name, json.loads(weather.arguments)) == ("weather",
                                                             {"city": "Paris", "days": 3})
    assert (time.name, json.loads(time.arguments)) == ("time", {"zone": "CET"})
    for text in REFUSED[form]:
        assert not _accepts(grammars, tokenizer, constraint, text), text
    named = tool_call_constraint(TOOLS[1:], tool_form)
    assert _accepts(grammars, tokenizer, named, WRITTEN[form][1])
    assert not _accepts(grammars, tokenizer, named, WRITTEN[form][0])


@pytest.mark.parametrize("form", ["pythonic", "qwen3_coder"])
def test_argument_names_a_format_cannot_write_are_the_constraints_error(form):
    tool_form = ToolForm(form, '"<a>"', '"</a>"')
    bad = [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"two words": {}}}}}]
    with pytest.raises(ConstraintError, match="two words"):
        tool_call_constraint(bad, tool_form)
    missing = [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {}},
                                    "required": ["b"]}}}]
    with pytest.raises(ConstraintError, match="'b'"):
        tool_call_constraint(missing, tool_form)


OPTIONAL = [{"type": "function", "function": {"name": "ping", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"},
                                     "c": {"type": "integer"}}}}}]
# Arguments written one by one, none required: any of them in the schema's order, or none
IN_ORDER = {"pythonic": ("<|tool_call_start|>[ping({})]<|tool_call_end|>", "{}={}", ", "),
            "qwen3_coder": ("<tool_call>\n<function=ping>\n{}</function>\n</tool_call>",
                            "<parameter={}>\n{}\n</parameter>\n", "")}


@pytest.mark.parametrize("form", sorted(IN_ORDER))
def test_optional_arguments_are_taken_in_order_and_any_may_be_left_out(tmp_path, form,
                                                                        demo_grammars):
    tokenizer, grammars = demo_grammars
    call, argument, separator = IN_ORDER[form]
    model = load_model(str(family_model(tmp_path, form)))
    markup = Markup.of(model.tokenizer)  # the markers as the family's vocabulary holds them
    constraint = tool_call_constraint(OPTIONAL, ToolForm.of(markup, lambda text: (
        model.tokenizer.encode(text, add_special_tokens=False))))

    def text(*keys):
        return call.format(separator.join(argument.format(k, 1) for k in keys))

    for keys in [(), ("a",), ("b",), ("c",), ("a", "c"), ("b", "c"), ("a", "b", "c")]:
        assert _accepts(grammars, tokenizer, constraint, text(*keys)), keys
        answer, (call_read,) = parse_tool_calls(text(*keys), markup, OPTIONAL)
        assert (answer, json.loads(call_read.arguments)) == ("", dict.fromkeys(keys, 1))
    for keys in [("b", "a"), ("c", "a"), ("a", "a")]:
        assert not _accepts(grammars, tokenizer, constraint, text(*keys)), keys


@pytest.mark.parametrize("form", sorted(WRITTEN))
def test_a_job_answers_every_tool_choice_row_with_a_call_in_the_models_format(tmp_path, form):
    def line(name, choice, content):
        return {"custom_id": name, "method": "POST", "url": "/v1/chat/completions",
                "body": {"messages": [{"role": "user", "content": content}], "tools": TOOLS,
                         "tool_choice": choice, "max_tokens": 80}}

    rows = [*(line(f"req{i}", "required", f"Question {i}?") for i in range(3)),
            line("named", {"type": "function", "function": {"name": "time"}}, "Time?")]
    job = tmp_path / "job"
    run(write_rows(tmp_path / "rows.jsonl", rows), "--job-dir", job,
        "--model", family_model(tmp_path, form))
    assert jsonl(job / "errors.jsonl") == []
    results = {r["custom_id"]: r["response"]["body"]["choices"][0]
               for r in jsonl(job / "results.jsonl")}
    assert set(results) == {"req0", "req1", "req2", "named"}
    for name, choice in results.items():
        assert choice["finish_reason"] == "tool_calls", (name, choice["message"])
        (call,) = choice["message"]["tool_calls"]
        function = call["function"]
        jsonschema.validate(json.loads(function["arguments"]), SCHEMAS[function["name"]])
    assert results["named"]["message"]["tool_calls"][0]["function"]["name"] == "time"


def test_a_format_without_a_grammar_has_no_tool_form():
    markup = Markup(tool_start="<|tool_call>", tool_end="<tool_call|>", tool_format="gemma4")
    assert ToolForm.of(markup, lambda text: [1, 2]) is None
