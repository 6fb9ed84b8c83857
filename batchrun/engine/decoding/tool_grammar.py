"""`tool_choice` "required" or a named function: the answer constrained to a call, written the
way the model's chat template writes one, so that the model's own tool-call parser (mlx-lm's)
reads it back.

The families, by mlx-lm's parser for the tokenizer (reasoning.Markup.tool_format):

- json_tools (Qwen, Hermes): `<tool_call>`, a line, {"name": ..., "arguments": {...}}, a line,
  `</tool_call>`;
- mistral, newer templates (a `[ARGS]` marker): `[TOOL_CALLS]name[ARGS]{...}`;
- mistral, older templates: `[TOOL_CALLS][{"name": ..., "arguments": {...}}]`;
- pythonic (LFM2): `<|tool_call_start|>[name(key=value, ...)]<|tool_call_end|>`, each value a
  JSON literal (the parser reads `true`/`false`/`null` as Python's);
- qwen3_coder (Qwen3-Coder's XML): `<tool_call>`, `<function=name>`, each argument as
  `<parameter=key>`, its value on the lines after, `</parameter>`; `</function>`,
  `</tool_call>`, a line each. A string value is raw text (its `enum`, `minLength` and
  `maxLength` honoured); other values are JSON;
- bare (Llama 3, whose template shows tools but has no markers): the whole answer is
  {"name": ..., "parameters": {...}}.

JSON values match the tool's parameters schema. Where a format writes arguments one by one
(pythonic, XML), the schema's required properties come first in its order, then any of the
others in theirs; a schema without properties takes any argument names. Other formats have no
grammar here: such a row's `tool_choice` is its `unsupported_field` error.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from batchrun.engine.types import JSON_OPTIONS, Constraint, ConstraintError

FORMS = ("json_tools", "mistral_args", "mistral_list", "pythonic", "qwen3_coder", "bare")
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
MISTRAL_NAME = re.compile(r"[\w-]+\Z")  # what mlx-lm's mistral parser reads as a name
XML_NAME = re.compile(r"[^\s<>]+\Z")


@dataclass(frozen=True)
class ToolForm:
    """How a model writes a call: `form` (one of FORMS) and its markers as lark terms (`<[id]>`
    for a marker that is one token, which the grammar engine matches only by its id, else the
    quoted text; "" for none)."""

    form: str
    start: str = ""
    end: str = ""
    args: str = ""  # mistral's `[ARGS]`

    @classmethod
    def of(cls, markup: Any, encode: Callable[[str], list[int]]) -> ToolForm | None:
        """The form of a tokenizer's markup (reasoning.Markup); None where no grammar here
        writes its calls."""
        form = markup.tool_format
        if form not in FORMS:
            return None

        def term(marker: str | None) -> str:
            if not marker:
                return ""
            ids = encode(marker)
            return f"<[{ids[0]}]>" if len(ids) == 1 else _quote(marker)

        return cls(form, term(markup.tool_start), term(markup.tool_end),
                   term("[ARGS]") if form == "mistral_args" else "")


def tool_call_constraint(tools: list[dict], form: ToolForm) -> Constraint:
    """The answer as one call of one of `tools` (OpenAI function tools) in `form`."""
    functions = [_function(tool) for tool in tools]
    write = {"json_tools": _json_tools, "mistral_args": _mistral_args,
             "mistral_list": _mistral_list, "pythonic": _pythonic, "qwen3_coder": _xml,
             "bare": _bare}[form.form]
    return Constraint("lark", write(functions, form))


def _function(tool: Any) -> tuple[str, dict]:
    function = tool.get("function") if isinstance(tool, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise ConstraintError("each tool needs a function with a name")
    parameters = function.get("parameters") or {"type": "object"}
    if not isinstance(parameters, dict):
        raise ConstraintError(f"tool {name!r}: parameters must be a JSON schema")
    return name, parameters


def _quote(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _json(schema: Any) -> str:
    """A lark `%json` item: compact JSON, as every constrained answer is (JSON_OPTIONS)."""
    if isinstance(schema, dict):
        schema = {**schema, "x-guidance": JSON_OPTIONS}
    else:
        schema = {"x-guidance": JSON_OPTIONS}
    return "%json " + json.dumps(schema, ensure_ascii=False)  # in order: "name" first


def _calls_schema(functions: list[tuple[str, dict]], arguments: str) -> dict:
    return {"anyOf": [{"type": "object", "additionalProperties": False,
                       "required": ["name", arguments],
                       "properties": {"name": {"const": name}, arguments: parameters}}
                      for name, parameters in functions]}


def _json_tools(functions, form: ToolForm) -> str:
    return (f'start: {form.start} "\\n" call "\\n" {form.end}\n'
            f"call: {_json(_calls_schema(functions, 'arguments'))}\n")


def _mistral_list(functions, form: ToolForm) -> str:
    return (f'start: {form.start} " "? "[" call "]"\n'
            f"call: {_json(_calls_schema(functions, 'arguments'))}\n")


def _bare(functions, form: ToolForm) -> str:
    return f"start: {_json(_calls_schema(functions, 'parameters'))}\n"


def _mistral_args(functions, form: ToolForm) -> str:
    rules = [f"start: {form.start} call",
             "call: " + " | ".join(f"call{i}" for i in range(len(functions)))]
    for i, (name, parameters) in enumerate(functions):
        if not MISTRAL_NAME.fullmatch(name):
            raise ConstraintError(f"tool {name!r}: this model's calls name a function with "
                                  "letters, digits, '_' and '-' only")
        rules.append(f"call{i}: {_quote(name)} {form.args} {_json(parameters)}")
    return "\n".join(rules) + "\n"


def _properties(name: str, parameters: dict) -> list[tuple[str, dict, bool]] | None:
    """(key, schema, required) of a function's arguments, required first; None for a schema
    without properties (any arguments)."""
    properties = parameters.get("properties")
    if properties is None:
        return None
    if not isinstance(properties, dict):
        raise ConstraintError(f"tool {name!r}: properties must be an object")
    required = parameters.get("required") or []
    if not isinstance(required, list):
        raise ConstraintError(f"tool {name!r}: required must be a list")
    missing = [key for key in required if key not in properties]
    if missing:
        raise ConstraintError(f"tool {name!r}: required names {missing[0]!r}, which its "
                              "properties do not define")
    return ([(key, properties[key], True) for key in properties if key in required]
            + [(key, properties[key], False) for key in properties if key not in required])


def _sequence(items: list[tuple[str, bool]], separator: str, rules: list[str],
              name: str) -> str:
    """A lark expression for the items in order, separated, the required ones always there and
    the others optional ("" where nothing is written). The optional items' tails are rules
    (named from `name`, added to `rules`), so the grammar grows with the items, not their
    square."""
    sep = f"{_quote(separator)} " if separator else ""
    required = [term for term, needed in items if needed]
    optional = [term for term, needed in items if not needed]

    def tail(k: int) -> str:  # the optional items from k on, each after a separator
        return f" {name}_tail{k}" if k < len(optional) else ""

    for k, term in enumerate(optional):
        rules.append(f"{name}_tail{k}: ({sep}{term})?{tail(k + 1)}")
    if required:
        return f" {sep}".join(required) + tail(0)
    if not optional:
        return ""
    # nothing required: the first argument written has no separator before it
    return "(" + " | ".join(term + tail(k + 1) for k, term in enumerate(optional)) + ")?"


def _pythonic(functions, form: ToolForm) -> str:
    rules = [f'start: {form.start} "[" call "]" {form.end}',
             "call: " + " | ".join(f"call{i}" for i in range(len(functions))),
             "KEYWORD: /[A-Za-z_][A-Za-z0-9_]*/",
             f"anyvalue: {_json({})}"]
    for i, (name, parameters) in enumerate(functions):
        if not all(IDENTIFIER.fullmatch(part) for part in name.split(".")):
            raise ConstraintError(f"tool {name!r}: this model's calls are Python calls, and "
                                  f"{name!r} is not a Python name")
        properties = _properties(name, parameters)
        if properties is None:
            arguments = '(KEYWORD "=" anyvalue (", " KEYWORD "=" anyvalue)*)?'
        else:
            items = []
            for j, (key, schema, needed) in enumerate(properties):
                if not IDENTIFIER.fullmatch(key):
                    raise ConstraintError(f"tool {name!r}: this model's calls pass arguments "
                                          f"by keyword, and {key!r} is not a Python name")
                rules.append(f"value{i}_{j}: {_json(schema)}")
                items.append((f'{_quote(key + "=")} value{i}_{j}', needed))
            arguments = _sequence(items, ", ", rules, f"args{i}")
        rules.append(f'call{i}: {_quote(name + "(")} {arguments} ")"')
    return "\n".join(rules) + "\n"


# A string argument of the XML form: raw text and the line that closes it, with no earlier
# close (the lexeme then ends at the first one).
_XML_TEXT = r"/(?s:.{%s})\n<\/parameter>/ & ~/(?s:.*)<\/parameter>(?s:.+)/"


def _xml_value(schema: Any) -> str | None:
    """The lark for an argument's value and its closing `</parameter>` line, as
    mlx-lm's qwen3_coder parser reads it back (by the schema's type); None for a free string,
    whose terminal (by its length range) the caller names."""
    close = '"\\n</parameter>"'
    if not isinstance(schema, dict):
        return f"{_json({})} {close}"
    kind = schema.get("type")
    values = schema.get("enum") if "enum" in schema else (
        [schema["const"]] if "const" in schema else None)
    if isinstance(values, list) and values and all(isinstance(v, str) for v in values) \
            and kind in (None, "string"):
        if any("</parameter>" in v or "<parameter=" in v or "</function>" in v
               for v in values):  # the value would close its own tag: an argument injected
            raise ConstraintError("an enum value holds this model's call markup")
        return "(" + " | ".join(_quote(v) for v in values) + f") {close}"
    if kind == "string":
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        if not isinstance(low, int) or low < 0 or high is not None and (
                not isinstance(high, int) or high < low):
            raise ConstraintError("a string's minLength and maxLength must be counts")
        return None  # the caller names a terminal for the length
    return f"{_json(schema)} {close}"


def _xml(functions, form: ToolForm) -> str:
    rules = [f'start: {form.start} "\\n" call "\\n" {form.end}',
             "call: " + " | ".join(f"call{i}" for i in range(len(functions))),
             f'ANYTEXT: {_XML_TEXT % "0,"}',
             "NAME: /[^\\s<>]+/"]
    lengths: dict[tuple[int, int | None], str] = {}
    for i, (name, parameters) in enumerate(functions):
        if not XML_NAME.fullmatch(name):
            raise ConstraintError(f"tool {name!r}: this model's calls cannot name a function "
                                  "with spaces or angle brackets")
        properties = _properties(name, parameters)
        if properties is None:
            arguments = '("<parameter=" NAME ">\\n" ANYTEXT "\\n")*'
        else:
            items = []
            for j, (key, schema, needed) in enumerate(properties):
                if not XML_NAME.fullmatch(key):
                    raise ConstraintError(f"tool {name!r}: argument {key!r} cannot be written "
                                          "in this model's calls")
                value = _xml_value(schema)
                if value is None:  # a string: a terminal a length range
                    span = (schema.get("minLength", 0), schema.get("maxLength"))
                    if span not in lengths:
                        lengths[span] = f"TEXT{len(lengths)}"
                        rules.append(f"{lengths[span]}: " + _XML_TEXT % (
                            f"{span[0]},{'' if span[1] is None else span[1]}"))
                    value = lengths[span]
                rules.append(f"value{i}_{j}: {value}")
                items.append((f'{_quote(f"<parameter={key}>" + chr(10))} value{i}_{j} "\\n"',
                              needed))
            arguments = _sequence(items, "", rules, f"args{i}")
        rules.append(f'call{i}: {_quote(f"<function={name}>" + chr(10))} {arguments} '
                     '"</function>"')
    return "\n".join(rules) + "\n"
