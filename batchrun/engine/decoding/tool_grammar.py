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
  `</tool_call>`, a line each. The parser converts a value by its property's own "type": a
  string is raw text (its `enum`, `minLength` and `maxLength` honoured, never "null", which
  reads back as null), other types are JSON. A property without a "type" (a `$ref`, an
  `anyOf`) reads back as a JSON object or array where the text is one, else as a string, so
  only such values are written: numbers and booleans there cannot be;
- bare (Llama 3, whose template shows tools but has no markers): the whole answer is
  {"name": ..., "parameters": {...}}.

JSON values match the tool's parameters schema (its local `$ref`s resolved: tool_schema.py).
Where a format writes arguments one by one (pythonic, XML), the schema's required properties
come first in its order, then any of the others in theirs; parameters that are `anyOf`/`oneOf`
objects write any one of them; a schema without properties takes any argument names (with
values that match its `additionalProperties`). Other formats have no grammar here: such a
row's `tool_choice` is its `unsupported_field` error.
"""

from __future__ import annotations

import functools
import json
import keyword
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from batchrun.engine.decoding.tool_schema import (
    MAX_GRAMMAR_CHARS,
    NOTES,
    Arg,
    Refs,
    Tool,
    step,
    tools_of,
)
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


def tool_call_constraint(tools: list, form: ToolForm, name: str | None = None) -> Constraint:
    """The answer as one call of one of `tools` (a row's OpenAI function tools), or of the one
    `name`d, in `form`."""
    chosen = tools_of(tools, name)
    write = {"json_tools": _json_tools, "mistral_args": _mistral_args,
             "mistral_list": _mistral_list, "pythonic": _pythonic, "qwen3_coder": _xml,
             "bare": _bare}[form.form]
    return Constraint("lark", write(chosen, form))


def _quote(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _json(schema: Any) -> str:
    """A lark `%json` item: compact JSON, as every constrained answer is (JSON_OPTIONS)."""
    if isinstance(schema, dict):
        schema = {**schema, "x-guidance": JSON_OPTIONS}
    else:  # true: any value (false never reaches here: such an argument is not written)
        schema = {"x-guidance": JSON_OPTIONS}
    return "%json " + json.dumps(schema, ensure_ascii=False)  # in order: "name" first


def _with_table(schema: Any, table: dict) -> Any:
    """A piece of a tool's schema with the entries its refs name, at its root."""
    if not table:
        return schema
    return {**(schema if isinstance(schema, dict) else {}), "$defs": table}


def _calls_schema(tools: list[Tool], arguments: str) -> dict:
    table: dict = {}  # every tool's refs, each tool's entries under its own prefix
    calls = []
    for tool in tools:
        refs = Refs(tool, table, f"t{tool.index}_")
        refs.root()
        calls.append({"type": "object", "additionalProperties": False,
                      "required": ["name", arguments],
                      "properties": {"name": {"const": tool.name},
                                     arguments: refs.embed(tool.parameters, tool.where)}})
    return _with_table({"anyOf": calls}, table)


def _json_tools(tools, form: ToolForm) -> str:
    return (f'start: {form.start} "\\n" call "\\n" {form.end}\n'
            f"call: {_json(_calls_schema(tools, 'arguments'))}\n")


def _mistral_list(tools, form: ToolForm) -> str:
    return (f'start: {form.start} " "? "[" call "]"\n'
            f"call: {_json(_calls_schema(tools, 'arguments'))}\n")


def _bare(tools, form: ToolForm) -> str:
    return f"start: {_json(_calls_schema(tools, 'parameters'))}\n"


class _Rules(list):
    """A grammar's rules, held to MAX_GRAMMAR_CHARS as they are added (a ref'd schema is
    copied into each argument that reaches it, so the grammar may outgrow the tools)."""

    def __init__(self, rules: list[str]):
        super().__init__(rules)
        self.chars = sum(map(len, rules))

    def append(self, rule: str) -> None:
        self.chars += len(rule)
        if self.chars > MAX_GRAMMAR_CHARS:
            raise ConstraintError(f"the tools make a grammar of over {MAX_GRAMMAR_CHARS:,} "
                                  "characters: offer fewer or smaller tools")
        super().append(rule)


def _name_error(tool, why: str) -> ConstraintError:
    """A tool whose name the model's call format cannot write, said as the row's field."""
    return ConstraintError(f"tools[{tool.index}].function.name {tool.name!r}: {why}")


def _mistral_args(tools, form: ToolForm) -> str:
    rules = _Rules([f"start: {form.start} call",
                    "call: " + " | ".join(f"call{i}" for i in range(len(tools)))])
    for i, tool in enumerate(tools):
        if not MISTRAL_NAME.fullmatch(tool.name):
            raise _name_error(tool, "this model's calls name a function with letters, "
                                    "digits, '_' and '-' only")
        refs = Refs(tool)
        refs.root()
        arguments = _with_table(refs.embed(tool.parameters, tool.where), refs.table)
        rules.append(f"call{i}: {_quote(tool.name)} {form.args} {_json(arguments)}")
    return "\n".join(rules) + "\n"


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
        if k or required:  # tail0 follows the required items; with none, nothing uses it
            rules.append(f"{name}_tail{k}: ({sep}{term})?{tail(k + 1)}")
    if required:
        return f" {sep}".join(required) + tail(0)
    if not optional:
        return ""
    # nothing required: the first argument written has no separator before it
    return "(" + " | ".join(term + tail(k + 1) for k, term in enumerate(optional)) + ")?"


# Object keywords a schema without properties may hold that arguments written one by one
# (pythonic, XML) would not keep to
_UNHELD = ("required", "patternProperties", "propertyNames", "allOf", "not", "if",
           "dependentSchemas", "dependentRequired", "dependencies", "minProperties",
           "maxProperties", "unevaluatedProperties")


def _argument_lists(refs: Refs) -> list[list[Arg]] | None:
    """The arguments a call of the tool may pass, one list for each object its parameters
    allow (`anyOf`/`oneOf` objects: several); None for any names (a schema without
    properties)."""
    node, path = refs.root()
    if not isinstance(node, dict):  # true: any arguments
        return None
    if "properties" in node:
        return [refs.arguments(node, path)]
    branches = node.get("anyOf", node.get("oneOf"))
    if isinstance(branches, list) and branches:
        refs.check_width(node, path)
        where = step(path, "anyOf" if "anyOf" in node else "oneOf")
        lists = []
        for j, branch in enumerate(branches):
            branch, at = refs.resolve(branch, step(where, j))
            if not isinstance(branch, dict) or "properties" not in branch:
                raise ConstraintError(f"{at}: this model's calls write arguments one by one, "
                                      "so each of the parameters' alternatives must be an "
                                      "object schema with properties")
            lists.append(refs.arguments(branch, at))
        return lists
    unheld = [k for k in (*_UNHELD, "anyOf", "oneOf") if k in node]
    if unheld:
        raise ConstraintError(f"{path}: this model's calls write arguments one by one, which "
                              f"keeps to a schema's properties but not to its {unheld[0]!r}: "
                              "give the parameters properties")
    return None


def _arguments(lists: list[list[Arg]], write: Callable[[Arg, str], str], separator: str,
               rules: list[str], name: str) -> str:
    """The lark for the arguments of one of `lists`, each written by `write(arg, rule)` (a
    value rule named `rule`, which it adds)."""
    expressions = []
    for b, args in enumerate(lists):
        items = [(write(arg, f"{name}_{b}_{j}"), arg.required) for j, arg in enumerate(args)]
        expressions.append(_sequence(items, separator, rules, f"{name}_{b}"))
    if len(expressions) == 1:
        return expressions[0]
    return "(" + " | ".join(e or '""' for e in expressions) + ")"


# A Python name that is not a keyword (`f(class=1)` does not parse)
_KEYWORD_TERMINAL = ("/[A-Za-z_][A-Za-z0-9_]*/ & ~/(" + "|".join(keyword.kwlist) + ")/")


def _python_name(text: str) -> bool:
    return IDENTIFIER.fullmatch(text) is not None and not keyword.iskeyword(text)


def _pythonic(tools, form: ToolForm) -> str:
    rules = _Rules([f'start: {form.start} "[" call "]" {form.end}',
                    "call: " + " | ".join(f"call{i}" for i in range(len(tools))),
                    f"KEYWORD: {_KEYWORD_TERMINAL}"])
    for i, tool in enumerate(tools):
        if not all(_python_name(part) for part in tool.name.split(".")):
            raise _name_error(tool, "this model's calls are Python calls, and it is not a "
                                    "Python name")
        refs = Refs(tool)
        lists = _argument_lists(refs)
        if lists is None:
            values = _free_values(refs)
            arguments = ""
            if values is not None:
                rules.append(f"any{i}: {values}")
                arguments = f'(KEYWORD "=" any{i} (", " KEYWORD "=" any{i})*)?'
        else:
            write = functools.partial(_pythonic_argument, refs, rules)
            arguments = _arguments(lists, write, ", ", rules, f"args{i}")
        rules.append(f'call{i}: {_quote(tool.name + "(")} {arguments} ")"')
    return "\n".join(rules) + "\n"


def _pythonic_argument(refs: Refs, rules: list[str], arg: Arg, rule: str) -> str:
    if not _python_name(arg.key):
        raise ConstraintError(f"{arg.path}: this model's calls pass arguments by keyword, and "
                              f"{arg.key!r} is not a Python name")
    rules.append(f"{rule}: {_embedded(refs.tool, arg.schema, arg.path)}")
    return f"{_quote(arg.key + '=')} {rule}"


def _free_values(refs: Refs) -> str | None:
    """The lark for any argument of a tool whose parameters name none: a value of its
    additionalProperties (None where that is false: no argument)."""
    node, path = refs.root()
    extra = node.get("additionalProperties", True) if isinstance(node, dict) else True
    if extra is False:
        return None
    return _embedded(refs.tool, extra, step(path, "additionalProperties"))


def _embedded(tool: Tool, schema: Any, path: str) -> str:
    """The `%json` item of a piece of a tool's schema, with a table of its own: only the
    entries its refs reach."""
    refs = Refs(tool)
    return _json(_with_table(refs.embed(schema, path), refs.table))


# Raw text of the XML form and the line that closes it, with no earlier close (the lexeme then
# ends at the first one), and not "null", which mlx-lm's parser reads as None whatever the type
_XML_TEXT = (r"/(?s:.{%s})\n<\/parameter>/ & ~/(?s:.*)<\/parameter>(?s:.+)/"
             r" & ~/(?i:null)\n<\/parameter>/")
# ... and, for a property without a type (which the parser reads as JSON where it can), no
# text that might be a JSON object or array
_XML_UNTYPED = r" & ~/[ \t\n\r]*[\[{](?s:.*)/"
_XML_CLOSE = '"\\n</parameter>"'
# Past these the grammar engine spends seconds on an argument's listed values (100,000 took
# 1.3 s; in a JSON value llguidance refuses that many) or runs out of fuel on a raw text's
# least length (llguidance 1.9: 5,000 characters did, 1,000 did not)
MAX_LISTED = 10_000
MAX_MIN_LENGTH = 1_000
_XML_MARKUP = ("</parameter>", "<parameter=", "</function>")


def _xml(tools, form: ToolForm) -> str:
    rules = _Rules([f'start: {form.start} "\\n" call "\\n" {form.end}',
                    "call: " + " | ".join(f"call{i}" for i in range(len(tools))),
                    f'ANYTEXT: {_XML_TEXT % "0,"}',
                    "NAME: /[^\\s<>]+/"])
    texts: dict[tuple, str] = {}  # terminals of values, by what they match
    for i, tool in enumerate(tools):
        if not XML_NAME.fullmatch(tool.name):
            raise _name_error(tool, "this model's calls cannot name a function with spaces "
                                    "or angle brackets")
        refs = Refs(tool)
        lists = _argument_lists(refs)
        if lists is None:
            value = _xml_free_value(refs, rules, texts)
            arguments = "" if value is None else f'("<parameter=" NAME ">\\n" {value} "\\n")*'
        else:
            write = functools.partial(_xml_argument, refs, rules, texts)
            arguments = _arguments(lists, write, "", rules, f"args{i}")
        rules.append(f'call{i}: {_quote(f"<function={tool.name}>" + chr(10))} {arguments} '
                     '"</function>"')
    return "\n".join(rules) + "\n"


def _xml_argument(refs: Refs, rules: list[str], texts: dict, arg: Arg, rule: str) -> str:
    if not XML_NAME.fullmatch(arg.key):
        raise ConstraintError(f"{arg.path}: argument {arg.key!r} cannot be written in this "
                              "model's calls (spaces or angle brackets)")
    rules.append(f"{rule}: {_xml_value(refs, arg, rules, texts)}")
    return f'{_quote(f"<parameter={arg.key}>" + chr(10))} {rule} "\\n"'


def _xml_value(refs: Refs, arg: Arg, rules: list[str], texts: dict) -> str:
    """The lark for an argument's value and its closing line, as mlx-lm's qwen3_coder parser
    reads it back, by the property's own "type": a string as raw text, another type as JSON;
    without a type, see _xml_untyped."""
    kind = arg.schema.get("type") if isinstance(arg.schema, dict) else None
    if kind == "string":
        view = _View.of(refs.conjuncts(arg.schema, arg.path), arg.path)
        if view.values is None:
            return _xml_text(view, False, arg.path, rules, texts)
        value = _xml_listed(view.values, False, arg.path, rules, texts)
    elif kind is not None:
        return f"{_embedded(refs.tool, arg.schema, arg.path)} {_XML_CLOSE}"
    else:
        value = _xml_untyped(refs, arg.schema, arg.path, rules, texts)
    if value is None:
        raise ConstraintError(f"{arg.path}: no value it allows can be written in this model's "
                              "calls (its parser reads an argument without a \"type\" as text, "
                              "or as JSON where that is an object or array, and \"null\" as "
                              "null): give the property a \"type\"")
    return value


def _xml_untyped(refs: Refs, schema: Any, path: str, rules: list[str], texts: dict
                 ) -> str | None:
    """The lark for the value of a property without a "type", which the parser reads as a
    JSON object or array where the text is one, null for "null", else as a string: of what
    `schema` allows, what reads back as itself (None where nothing does). Alternatives
    (anyOf, oneOf) are written each its own way."""
    branches = schema.get("anyOf", schema.get("oneOf")) if isinstance(schema, dict) else None
    if isinstance(branches, list) and branches and set(schema) <= NOTES | {"anyOf", "oneOf"}:
        refs.check_width(schema, path)
        where = step(path, "anyOf" if "anyOf" in schema else "oneOf")
        written = [w for j, b in enumerate(branches)
                   if (w := _xml_untyped(refs, b, step(where, j), rules, texts)) is not None]
        return "(" + " | ".join(written) + ")" if written else None
    view = _View.of(refs.conjuncts(schema, path), path)
    if view.values is not None:
        return _xml_listed(view.values, True, path, rules, texts)
    if view.kinds is None or view.kinds <= {"object", "array", "null"}:
        return f"{_embedded(refs.tool, schema, path)} {_XML_CLOSE}"
    if "string" in view.kinds and view.kinds <= {"string", "null"}:
        return _xml_text(view, True, path, rules, texts)
    return None  # a number or a boolean would read back as text


def _xml_listed(values: list, untyped: bool, path: str, rules: list[str], texts: dict
                ) -> str | None:
    """The terminal for one of an argument's listed values (enum, const) and the closing line:
    those the parser reads back as themselves. One terminal, not a rule of alternatives: the
    grammar engine's parser would hold an item for each."""
    if len(values) > MAX_LISTED:
        raise ConstraintError(f"{path}: {len(values):,} listed values; this model's calls take "
                              f"at most {MAX_LISTED:,} for an argument")
    written = []
    for value in values:
        if isinstance(value, str):
            if value.lower() == "null" or untyped and _is_json_container(value):
                continue
            text = value
        elif untyped and (value is None or isinstance(value, dict | list)):
            text = json.dumps(value, ensure_ascii=False)
        else:
            continue
        if any(m in text for m in _XML_MARKUP):  # the value would close its own tag
            raise ConstraintError(f"{path}: the value {text[:40]!r} holds this model's call "
                                  "markup")
        written.append(_quote(text))
    if not written:
        return None
    key = ("listed", *written)
    if key not in texts:
        texts[key] = f"LISTED{len(texts)}"
        rules.append(f"{texts[key]}: ({' | '.join(written)}) {_XML_CLOSE}")
    return texts[key]


def _is_json_container(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict | list)
    except ValueError:
        return False


def _xml_text(view: _View, untyped: bool, path: str, rules: list[str], texts: dict) -> str:
    """The terminal for raw text of the view's length range (one a range and typing)."""
    if view.low > MAX_MIN_LENGTH:
        raise ConstraintError(f"{path}: a minLength of {view.low:,}; this model's calls take at "
                              f"most {MAX_MIN_LENGTH:,} for a text argument")
    key = ("text", view.low, view.high, untyped)
    if key not in texts:
        texts[key] = f"TEXT{len(texts)}"
        span = f"{view.low},{'' if view.high is None else view.high}"
        rules.append(f"{texts[key]}: {_XML_TEXT % span}{_XML_UNTYPED if untyped else ''}")
    return texts[key]


def _xml_free_value(refs: Refs, rules: list[str], texts: dict) -> str | None:
    """The lark for any argument's value of a tool whose parameters name none (None where
    additionalProperties is false): the parser reads such an argument as text."""
    node, path = refs.root()
    extra = node.get("additionalProperties", True) if isinstance(node, dict) else True
    if extra is False:
        return None
    where = step(path, "additionalProperties")
    view = _View.of(refs.conjuncts(extra, where), where)
    if view.values is not None:
        value = _xml_listed(view.values, False, where, rules, texts)
    elif view.kinds is None or "string" in view.kinds:
        return _xml_text(view, False, where, rules, texts)
    else:
        value = None
    if value is None:
        raise ConstraintError(f"{where}: this model's parser reads an argument the schema does "
                              "not name as text, and this schema allows none: give the "
                              "parameters properties")
    return value


@dataclass(frozen=True)
class _View:
    """What all of an argument's schemas (the conjuncts) allow, as far as its text depends
    on it: JSON types (None: any), listed values (None: any), a string's length range."""

    kinds: frozenset[str] | None
    values: list | None
    low: int
    high: int | None

    @classmethod
    def of(cls, nodes: list, path: str) -> _View:
        kinds: frozenset[str] | None = None
        values: list | None = None
        low, high = 0, None
        for node in nodes:
            if not isinstance(node, dict):
                continue
            kind = node.get("type")
            if isinstance(kind, str | list):
                named = {kind} if isinstance(kind, str) else {k for k in kind if isinstance(k, str)}
                if "number" in named:
                    named.add("integer")
                kinds = frozenset(named) if kinds is None else kinds & named
            for listed in (node.get("enum"), [node["const"]] if "const" in node else None):
                if isinstance(listed, list):
                    values = listed if values is None else [
                        v for v in values if any(_same(v, w) for w in listed)]
            shortest, longest = node.get("minLength", 0), node.get("maxLength")
            if not _count(shortest) or longest is not None and not _count(longest):
                raise ConstraintError(f"{path}: minLength and maxLength must be counts")
            low = max(low, shortest)
            high = longest if high is None else high if longest is None else min(high, longest)
        if high is not None and high < low:
            raise ConstraintError(f"{path}: no string is at least {low} and at most {high} "
                                  "characters long")
        if values is not None:
            values = [v for v in values if (kinds is None or _kind(v) in kinds) and not (
                isinstance(v, str) and (len(v) < low or high is not None and len(v) > high))]
        return cls(kinds, values, low, high)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _kind(value: Any) -> str:
    """A value's JSON type, as a schema's "type" names it."""
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or isinstance(value, float) and value.is_integer():
        return "integer"
    return {str: "string", float: "number", list: "array", dict: "object"}.get(
        type(value), "null")


def _same(a: Any, b: Any) -> bool:
    """JSON equality (Python's has True == 1)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
