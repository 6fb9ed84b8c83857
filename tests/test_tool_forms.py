"""`tool_choice` "required" and named functions for every tool-call format a grammar writes
(engine/decoding/tool_grammar.py): the demo model given each family's chat template answers
with a call its family's parser (mlx-lm's) reads back, arguments valid against the tool."""

import json
import re
import shutil
from time import perf_counter

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


# A row's tools are user data: schemas as generators write them, and as no one should.

# What pydantic writes for a model holding a nested model, an enum and optional fields
# (extra="forbid" and bounded strings, so that a random model's call ends soon): $defs, $refs,
# anyOf with null
FORECAST = {"type": "function", "function": {"name": "forecast", "parameters": {
    "$defs": {
        "Place": {"additionalProperties": False, "title": "Place", "type": "object",
                  "properties": {
                      "city": {"maxLength": 12, "title": "City", "type": "string"},
                      "country": {"anyOf": [{"maxLength": 12, "type": "string"},
                                            {"type": "null"}],
                                  "default": None, "title": "Country"}},
                  "required": ["city"]},
        "Unit": {"enum": ["celsius", "fahrenheit"], "title": "Unit", "type": "string"}},
    "additionalProperties": False, "title": "Forecast", "type": "object",
    "properties": {
        "place": {"$ref": "#/$defs/Place"}, "unit": {"$ref": "#/$defs/Unit"},
        "days": {"default": 1, "maximum": 7, "minimum": 1, "title": "Days", "type": "integer"},
        "backup": {"anyOf": [{"$ref": "#/$defs/Place"}, {"type": "null"}], "default": None}},
    "required": ["place", "unit"]}}}
PING = {"type": "function", "function": {"name": "ping", "parameters": {  # all optional
    "type": "object", "additionalProperties": False,
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                   "b": {"type": "string", "maxLength": 6}, "c": {"type": "boolean"}}}}}
FORMS = ("json_tools", "mistral_args", "mistral_list", "pythonic", "qwen3_coder", "bare")


def form_model(tmp_path, form):
    """The demo model (its own template writes json_tools calls), or its copy for `form`."""
    return RANDOM_DEMO_MODEL if form == "json_tools" else family_model(tmp_path, form)


def written(form: str, name: str, arguments: dict) -> str:
    """A call as `form` writes it (arguments in the order given)."""
    call = {"name": name, "arguments": arguments}
    if form == "json_tools":
        return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
    if form == "mistral_args":
        return f"[TOOL_CALLS]{name}[ARGS]{json.dumps(arguments)}"
    if form == "mistral_list":
        return f"[TOOL_CALLS][{json.dumps(call)}]"
    if form == "pythonic":
        keywords = ", ".join(f"{k}={json.dumps(v)}" for k, v in arguments.items())
        return f"<|tool_call_start|>[{name}({keywords})]<|tool_call_end|>"
    if form == "qwen3_coder":
        parameters = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}"
                             "\n</parameter>\n" for k, v in arguments.items())
        return f"<tool_call>\n<function={name}>\n{parameters}</function>\n</tool_call>"
    return json.dumps({"name": name, "parameters": arguments})


def _markup_and_form(tmp_path, form):
    tokenizer = load_model(str(form_model(tmp_path, form))).tokenizer
    markup = Markup.of(tokenizer)
    assert markup.tool_format == form
    return markup, ToolForm.of(markup, lambda text: tokenizer.encode(
        text, add_special_tokens=False))


@pytest.mark.parametrize("form", FORMS)
def test_a_tool_whose_parameters_use_defs_and_refs_is_called_in_every_form(tmp_path, form,
                                                                          demo_grammars):
    tokenizer, grammars = demo_grammars
    markup, tool_form = _markup_and_form(tmp_path, form)
    constraint = tool_call_constraint([FORECAST, PING], tool_form)
    schema = FORECAST["function"]["parameters"]
    valid = [{"place": {"city": "Paris"}, "unit": "celsius"},
             {"place": {"city": "Oslo", "country": "Norway"}, "unit": "fahrenheit", "days": 3,
              "backup": {"city": "Bergen", "country": None}},
             {"place": {"city": "Rome"}, "unit": "celsius", "backup": None}]
    for arguments in valid:
        text = written(form, "forecast", arguments)
        assert _accepts(grammars, tokenizer, constraint, text), text
        answer, (call,) = parse_tool_calls(text, markup, [FORECAST, PING])
        assert (answer, call.name, json.loads(call.arguments)) == ("", "forecast", arguments)
        jsonschema.validate(arguments, schema)
    wrong = [{"place": {"city": "Paris"}, "unit": "kelvin"},  # not in the $ref'd enum
             {"place": {"country": "France"}, "unit": "celsius"},  # the $ref'd object's city
             {"place": {"city": "Paris"}, "unit": "celsius", "backup": {"town": "Lyon"}}]
    for arguments in wrong:
        assert not _accepts(grammars, tokenizer, constraint,
                            written(form, "forecast", arguments)), arguments


@pytest.mark.parametrize("form", FORMS)
def test_a_job_calls_ref_using_and_all_optional_tools_with_arguments_that_validate(tmp_path,
                                                                                  form):
    def line(name, choice):
        return {"custom_id": name, "method": "POST", "url": "/v1/chat/completions",
                "body": {"messages": [{"role": "user", "content": f"{name}?"}],
                         "tools": [FORECAST, PING], "tool_choice": choice,
                         "max_tokens": 160}}

    def named(function):
        return {"type": "function", "function": {"name": function}}

    rows = [line("forecast", named("forecast")), line("ping", named("ping")),
            line("either", "required")]
    job = tmp_path / "job"
    run(write_rows(tmp_path / "rows.jsonl", rows), "--job-dir", job,
        "--model", form_model(tmp_path, form))
    assert jsonl(job / "errors.jsonl") == []
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (FORECAST, PING)}
    for result in jsonl(job / "results.jsonl"):
        choice = result["response"]["body"]["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice["message"]
        (call,) = choice["message"]["tool_calls"]
        if result["custom_id"] != "either":
            assert call["function"]["name"] == result["custom_id"]
        jsonschema.validate(json.loads(call["function"]["arguments"]),
                            schemas[call["function"]["name"]])


def _tool(parameters, name="f"):
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def _obj(properties, required=(), **more):
    return {"type": "object", "properties": properties, "required": list(required), **more}


# Each a tool no form can call, and the field its error names
UNCALLABLE = [
    (_obj({"a": {}}, [1]), r"parameters\.required\[0\] must be a property name"),
    (_obj({"a": {}}, [{"x": 1}]), r"parameters\.required\[0\] must be a property name"),
    ({**_obj({"a": {}}), "required": "a"}, r"parameters\.required must be a list"),
    (_obj({"p": _obj({"a": {}}, [2])}), r"parameters\.properties\.p\.required\[0\]"),
    (_obj({"a": "integer"}), r"parameters\.properties\.a must be a JSON schema"),
    (_obj({"a": {"$ref": "https://example.com/a.json"}}), r"properties\.a\.\$ref must be a local"),
    (_obj({"a": {"$ref": "#/$defs/Missing"}}), r"properties\.a\.\$ref '#/\$defs/Missing' "
                                               "points at nothing"),
    ({**_obj({"a": {"$ref": "#/$defs/A"}}),
      "$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}}}, "comes back to itself"),
    ({"type": "string"}, r'parameters\.type must be "object"'),
    ([], r"parameters must be a JSON schema"),
    (_obj({f"p{i}": {"type": "integer"} for i in range(1000)}), "1,000 optional properties"),
    (_obj({"a": {"anyOf": [_obj({f"k{b}_{i}": {} for i in range(10)}) for b in range(100)]}}),
     r"properties\.a: its alternatives \(anyOf, oneOf\) leave 1,200 properties open"),
]


@pytest.mark.parametrize("form", FORMS)
def test_a_tool_no_call_can_be_written_for_is_an_error_naming_its_field(form):
    tool_form = ToolForm(form, '"<a>"', '"</a>"', '"[ARGS]"')
    for parameters, message in UNCALLABLE:
        with pytest.raises(ConstraintError, match=r"^tools\[1\]\.function\.") as refused:
            tool_call_constraint([_tool({"type": "object"}, "ok"), _tool(parameters)],
                                 tool_form)
        assert re.search(message, str(refused.value)), (str(refused.value), message)
    for tools, message in [(["f"], r"tools\[0\] must be"), ([{"function": "f"}], r"tools\[0\]"),
                           ([_tool({}, "")], r"tools\[0\]\.function\.name"),
                           ([_tool({}, f"f{i}") for i in range(1001)], "at most 1,000 tools")]:
        with pytest.raises(ConstraintError, match=message):
            tool_call_constraint(tools, tool_form)


def _walks(grammars, tokenizer, constraint, text) -> bool:
    """`text` is taken token by token with the mask computed before each, as a row decodes:
    where the grammar engine outgrows its parser, that is where it fails."""
    import llguidance.numpy as llg_numpy

    matcher = grammars.matcher(constraint)
    for token in tokenizer.encode(text, add_special_tokens=False):
        mask = llg_numpy.allocate_token_bitmask(1, grammars.vocab_size)
        llg_numpy.fill_next_token_bitmask(matcher, mask, 0)
        if not matcher.consume_token(token):
            return False
    return matcher.is_accepting() and not matcher.is_error()


@pytest.mark.parametrize("form", FORMS)
def test_400_optional_arguments_are_called_in_seconds_and_1000_are_refused(tmp_path, form,
                                                                          demo_grammars):
    tokenizer, grammars = demo_grammars
    _, tool_form = _markup_and_form(tmp_path, form)
    many = _obj({f"p{i}": {"type": "integer"} for i in range(400)})
    started = perf_counter()
    constraint = tool_call_constraint([_tool(many)], tool_form)
    grammars.check(constraint)
    assert perf_counter() - started < 5
    for arguments in [{}, {"p0": 1, "p399": 2}, {"p1": 3, "p200": 4, "p398": 5}]:
        assert _walks(grammars, tokenizer, constraint, written(form, "f", arguments)), arguments
    # the grammar engine's parser holds ~500 here; refused up front, not mid-answer
    with pytest.raises(ConstraintError, match="1,000 optional properties; a constrained call "
                                              "takes at most 400"):
        tool_call_constraint([_tool(_obj({f"p{i}": {} for i in range(1000)}))], tool_form)
    def alternatives(n, **more):
        return _obj({"a": {"anyOf": [_obj({f"k{b}_{i}": {"type": "integer"} for i in range(4)},
                                          **more) for b in range(n)]}}, ["a"])

    # 400 properties open at once (100 objects of 4), or 396 (66 of 4 that allow others)
    for wide in [alternatives(100, additionalProperties=False), alternatives(66)]:
        constraint = tool_call_constraint([_tool(wide)], tool_form)
        assert _walks(grammars, tokenizer, constraint, written(form, "f", {"a": {"k65_3": 1}}))
    with pytest.raises(ConstraintError, match="leave 402 properties open"):
        tool_call_constraint([_tool(alternatives(67))], tool_form)


def test_qwen3_coder_arguments_are_written_as_its_parser_reads_them_back(tmp_path,
                                                                        demo_grammars):
    """mlx-lm's qwen3_coder parser converts an argument's text by the property's own "type";
    without one it reads a JSON object or array as that, "null" as null (whatever the type),
    and any other text as a string. The grammar writes only what reads back as valid."""
    tokenizer, grammars = demo_grammars
    markup, tool_form = _markup_and_form(tmp_path, "qwen3_coder")
    defs = {"N": {"type": "integer"}, "S": {"type": "string"}}
    tool = _tool({**_obj({"s": {"type": "string"}, "ref": {"$ref": "#/$defs/S"},
                          "opt": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
                          "pick": {"enum": [f"v{i}" for i in range(3000)]}}, ["s"]),
                  "$defs": defs})
    constraint = tool_call_constraint([tool], tool_form)

    def takes(**arguments):
        text = written("qwen3_coder", "f", arguments)
        if not _walks(grammars, tokenizer, constraint, text):
            return False
        (call,) = parse_tool_calls(text, markup, [tool])[1]
        jsonschema.validate(json.loads(call.arguments), tool["function"]["parameters"])
        return True

    assert takes(s="nullable", ref="plain", opt=None, pick="v2999")
    assert not takes(s="null") and not takes(s="NULL")  # would read back as null
    assert not takes(s="x", ref="[1, 2]")  # would read back as a list
    assert not takes(s="x", opt=3)  # would read back as the string "3"
    untyped_int = _tool({**_obj({"n": {"$ref": "#/$defs/N"}}), "$defs": defs})
    with pytest.raises(ConstraintError, match=r'properties\.n: no value .* give the property '
                                              r'a "type"'):
        tool_call_constraint([untyped_int], tool_form)


def test_pythonic_calls_are_python_and_keep_to_the_schema_without_properties(tmp_path,
                                                                            demo_grammars):
    tokenizer, grammars = demo_grammars
    markup, tool_form = _markup_and_form(tmp_path, "pythonic")
    for bad, field in [(_tool(_obj({"class": {}})), r"properties\.class"),
                       (_tool(_obj({}), "lambda"), r"function\.name 'lambda'")]:
        with pytest.raises(ConstraintError, match=field + ".*not a Python name"):
            tool_call_constraint([bad], tool_form)

    def takes(parameters, call):
        constraint = tool_call_constraint([_tool(parameters)], tool_form)
        return _walks(grammars, tokenizer, constraint,
                      f"<|tool_call_start|>[f({call})]<|tool_call_end|>")

    either = {"anyOf": [_obj({"a": {"type": "integer"}}, ["a"]),
                        _obj({"b": {"type": "string"}, "c": {"type": "integer"}}, ["b"])]}
    assert takes(either, "a=1") and takes(either, 'b="x", c=2')
    assert not takes(either, 'a=1, b="x"') and not takes(either, "c=2")
    numbers = {"type": "object", "additionalProperties": {"type": "integer"}}
    assert takes(numbers, "x=1, y=2") and not takes(numbers, 'x="one"')
    assert not takes(numbers, "class=1")  # any name, but a Python one
    assert takes({"type": "object", "additionalProperties": False}, "")
    assert not takes({"type": "object", "additionalProperties": False}, "x=1")
    with pytest.raises(ConstraintError, match="not to its 'minProperties'"):
        tool_call_constraint([_tool({"type": "object", "minProperties": 1})], tool_form)


def test_a_row_whose_tools_cannot_be_called_is_its_error_and_the_job_goes_on(tmp_path):
    def line(name, tools, choice="required"):
        return {"custom_id": name, "method": "POST", "url": "/v1/chat/completions",
                "body": {"messages": [{"role": "user", "content": "Hi?"}], "tools": tools,
                         "tool_choice": choice, "max_tokens": 60}}

    rows = [line("ok", [PING]),
            line("required-1", [PING, _tool(_obj({"a": {}}, [1]))]),
            line("function-text", [{"type": "function", "function": "f"}]),
            line("named-beside-a-bad-one", [PING, {"function": [1]}],
                 {"type": "function", "function": {"name": "ping"}}),
            line("wide", [_tool(_obj({f"p{i}": {} for i in range(1000)}))]),
            line("dangling-ref", [_tool(_obj({"a": {"$ref": "#/$defs/A"}}))])]
    job = tmp_path / "job"
    run(write_rows(tmp_path / "rows.jsonl", rows), "--job-dir", job)
    (result,) = jsonl(job / "results.jsonl")
    assert result["custom_id"] == "ok"
    errors = {e["custom_id"]: e["error"] for e in jsonl(job / "errors.jsonl")}
    assert {name: e["code"] for name, e in errors.items()} == {
        name: "invalid_constraint" for name in ("required-1", "function-text",
                                                "named-beside-a-bad-one", "wide",
                                                "dangling-ref")}
    expected = {"required-1": "tools[1].function.parameters.required[0] must be a property name",
                "function-text": "tools[0] must be",
                "named-beside-a-bad-one": "tools[1] must be",
                "wide": "tools[0].function.parameters has 1,000 optional properties",
                "dangling-ref": "tools[0].function.parameters.properties.a.$ref"}
    for name, text in expected.items():
        assert errors[name]["message"].startswith("tool_choice: " + text), errors[name]
