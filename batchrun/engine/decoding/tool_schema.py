"""The tools of a row whose answer is constrained to a call (tool_grammar.py), checked: a row's
`tools` are user data, so each fault is a ConstraintError naming the field
(`tools[i].function.parameters...`), and a schema past what the grammar engine can take is
refused by a limit rather than left to fail while the row decodes.

Local `$ref`s (`#` and `#/...` pointers) are rewritten to name entries of a table, which travels
as `$defs` at the root of whichever piece of a schema a grammar embeds (a call's arguments, or
one argument), so that every ref resolves wherever the piece is placed. Other refs (URLs,
anchors) are refused.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from batchrun.engine.types import ConstraintError

# llguidance's parser holds at most 2,000 items at a point of the answer; an object whose
# properties may each come next takes 4 of them a property (both measured on llguidance 1.9:
# 498 optional properties pass, 503 fail, in every form), and a choice of calls a few a tool.
MAX_OPTIONAL = 400
MAX_TOOLS = 1000
# The chosen tools as JSON: a grammar is built in time linear in it (~1 s for 1 MB), and a row
# may be 64 MiB.
MAX_SCHEMA_CHARS = 1 << 20
# The grammar written from them: a ref'd schema is copied into each argument that reaches it
MAX_GRAMMAR_CHARS = 8 << 20
MAX_DEPTH = 100  # a schema nested deeper than a JSONL row may be (io's limit)

# Keywords whose value is a schema, a list of schemas, or a map of names to schemas; the rest
# hold data (`enum`, `const`, `default`) or numbers, and are copied as they are.
_ONE = ("additionalProperties", "items", "additionalItems", "contains", "propertyNames",
        "unevaluatedProperties", "unevaluatedItems", "not", "if", "then", "else")
_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_MAPS = ("properties", "patternProperties", "dependentSchemas", "dependencies")
_DEFS = ("$defs", "definitions")  # reached through the table, so not copied
# Not copied either: a schema's own base URI would make its rewritten refs resolve against it,
# and anchors (which no ref here may name) of two tools in one grammar could clash
_DROPPED = (*_DEFS, "$id", "$schema", "$anchor", "$dynamicAnchor", "$recursiveAnchor")
# What a schema may hold beside a `$ref` and still be only that ref
NOTES = {"$ref", "title", "description", "default", "examples", "$comment", "deprecated",
          "readOnly", "writeOnly", "$schema", "$id", *_DEFS}
_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


@dataclass(frozen=True)
class Tool:
    """One of a row's tools: its place in `tools`, its function's name and parameters."""

    index: int
    name: str
    parameters: dict

    @property
    def where(self) -> str:
        return f"tools[{self.index}].function.parameters"


def tools_of(tools: Any, name: str | None = None) -> list[Tool]:
    """The row's tools, each checked, then those a call may be of: all, or the one `name`d."""
    if not isinstance(tools, list) or not tools:
        raise ConstraintError("tools must be a non-empty list")
    checked = [_tool(i, tool) for i, tool in enumerate(tools)]
    chosen = [t for t in checked if name is None or t.name == name]
    if not chosen:
        raise ConstraintError(f"no tool is named {name!r}")
    if len(chosen) > MAX_TOOLS:
        raise ConstraintError(f"a call may be of at most {MAX_TOOLS:,} tools, and {len(chosen):,}"
                              " are offered: offer fewer, or name one in tool_choice")
    size = sum(len(json.dumps(t.parameters, ensure_ascii=False, default=str)) for t in chosen)
    if size > MAX_SCHEMA_CHARS:
        raise ConstraintError(f"the tools' parameters hold {size:,} characters of JSON, over the "
                              f"limit of {MAX_SCHEMA_CHARS:,} for a constrained call")
    return chosen


def _tool(i: int, tool: Any) -> Tool:
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(function, dict):
        raise ConstraintError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": "
                              "{\"name\": ..., \"parameters\": ...}}")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise ConstraintError(f"tools[{i}].function.name must be a non-empty string")
    parameters = function.get("parameters")
    if parameters is None:  # a function without arguments
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise ConstraintError(f"tools[{i}].function.parameters must be a JSON schema (an "
                              "object)")
    return Tool(i, name, parameters)


def step(path: str, key: str | int) -> str:
    """The path of a field inside `path`, as an error names it."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if _PLAIN_KEY.match(key) else f"{path}[{json.dumps(key)}]"


@dataclass
class Arg:
    """An argument a call may pass: its name, schema (as the tool gives it), path, and
    whether the call must pass it."""

    key: str
    schema: Any
    path: str
    required: bool


class Refs:
    """One tool's parameters, whose local refs `embed` rewrites as `#/$defs/<prefix>N`, entries
    it adds to `table` (each target once, whichever piece reaches it)."""

    def __init__(self, tool: Tool, table: dict | None = None, prefix: str = "r"):
        self.tool = tool
        self.table = {} if table is None else table
        self.prefix = prefix
        self.names: dict[tuple, str] = {}  # a target's pointer -> its entry
        self.widths: dict[int, int] = {}  # width() of the schemas met, by identity

    def embed(self, schema: Any, path: str) -> Any:
        """`schema` (a piece of the tool's parameters at `path`), its refs rewritten and each
        schema in it checked; the entries its refs reach are in the table."""
        pending: list[tuple[str, Any, str]] = []
        out = self._walk(schema, path, 0, pending)
        while pending:  # a worklist, not recursion: a chain of refs may be long
            name, target, where = pending.pop()
            self.table[name] = self._walk(target, where, 0, pending)
        return out

    def root(self) -> tuple[Any, str]:
        """The parameters' schema with its own refs followed, and its path; it must describe
        an object."""
        node, path = self.resolve(self.tool.parameters, self.tool.where)
        if not isinstance(node, dict | bool):
            raise ConstraintError(f"{path} must be a JSON schema (an object)")
        kind = node.get("type") if isinstance(node, dict) else None
        if kind is not None and kind != "object" and not (
                isinstance(kind, list) and "object" in kind):
            raise ConstraintError(f"{path}.type must be \"object\": a call's arguments are an "
                                  f"object, not {json.dumps(kind)}")
        if node is False:
            raise ConstraintError(f"{path} is false: no call could be valid")
        return node, path

    def resolve(self, node: Any, path: str) -> tuple[Any, str]:
        """`node` with refs followed while it is only a ref; a ref that comes back to itself
        without a schema between is refused."""
        seen = set()
        while isinstance(node, dict) and "$ref" in node and set(node) <= NOTES:
            pointer = self._pointer(node["$ref"], path)
            if pointer in seen:
                raise ConstraintError(f"{path}.$ref {node['$ref']!r} comes back to itself "
                                      "through refs alone: it describes no value")
            seen.add(pointer)
            node, path = self._target(pointer, path)
        return node, path

    def conjuncts(self, node: Any, path: str) -> list[Any]:
        """`node` and every schema a value must also match through its `$ref`s and `allOf`s."""
        nodes, todo, seen = [], [(node, path)], set()
        while todo:
            node, path = todo.pop()
            nodes.append(node)
            if not isinstance(node, dict):
                continue
            if "$ref" in node:
                pointer = self._pointer(node["$ref"], path)
                if pointer not in seen:
                    seen.add(pointer)
                    todo.append(self._target(pointer, path))
            if isinstance(node.get("allOf"), list):
                where = step(path, "allOf")
                todo.extend((s, step(where, j)) for j, s in enumerate(node["allOf"]))
        return nodes

    def arguments(self, node: dict, path: str) -> list[Arg]:
        """The properties of the object schema `node` as arguments, required ones first (each
        in the schema's order); a property whose schema is false is never passed."""
        required = check_object(node, path, defined=True)
        args = []
        for key, schema in node["properties"].items():
            arg = Arg(key, schema, step(step(path, "properties"), key), key in required)
            if any(n is False for n in self.conjuncts(arg.schema, arg.path)):
                if arg.required:
                    raise ConstraintError(f"{arg.path} is false, yet required: no call could "
                                          "be valid")
                continue
            args.append(arg)
        return [a for a in args if a.required] + [a for a in args if not a.required]

    def width(self, node: Any, path: str, depth: int = 0) -> int:
        """How many properties a value of `node` leaves open at its start: an object's optional
        ones (at least one), and two more where it allows others (measured: llguidance holds
        about 4 items for each), summed over its alternatives (anyOf, oneOf), whose objects
        the grammar engine holds open together."""
        if id(node) in self.widths:
            return self.widths[id(node)]
        if depth > MAX_DEPTH:
            raise ConstraintError(f"{path}: alternatives nest deeper than {MAX_DEPTH} levels")
        self.widths[id(node)] = 1  # a ref back to itself adds nothing new
        target, where = self.resolve(node, path)
        total = 0
        if isinstance(target, dict):
            properties, required = target.get("properties"), target.get("required")
            if isinstance(properties, dict) or target.get("type") == "object":
                named = set(required) & set(properties or {}) if isinstance(required, list) \
                    and all(isinstance(k, str) for k in required) else set()
                total += max(len(properties or {}) - len(named), 1)
                total += 0 if target.get("additionalProperties") is False else 2
            for key in ("anyOf", "oneOf"):
                if isinstance(target.get(key), list):
                    total += sum(self.width(b, step(step(where, key), j), depth + 1)
                                 for j, b in enumerate(target[key]))
        self.widths[id(node)] = max(total, 1)
        return self.widths[id(node)]

    def check_width(self, node: Any, path: str) -> None:
        """Refuse alternatives whose objects together leave more than MAX_OPTIONAL properties
        open (an object alone: check_object)."""
        if isinstance(node, dict) and ("anyOf" in node or "oneOf" in node):
            width = self.width(node, path)
            if width > MAX_OPTIONAL:
                raise ConstraintError(f"{path}: its alternatives (anyOf, oneOf) leave {width:,} "
                                      "properties open at once (each object's optional ones, "
                                      "2 more where it allows others); a constrained call "
                                      f"takes at most {MAX_OPTIONAL} (the grammar engine's "
                                      "limit): make some required, or offer fewer alternatives")

    def _walk(self, node: Any, path: str, depth: int, pending: list) -> Any:
        if depth > MAX_DEPTH:
            raise ConstraintError(f"{path}: the schema nests deeper than {MAX_DEPTH} levels")
        if isinstance(node, bool):
            return node
        if not isinstance(node, dict):
            raise ConstraintError(f"{path} must be a JSON schema (an object or a boolean), not "
                                  f"{json.dumps(node)[:40]}")
        if "properties" in node:
            check_object(node, path)
        self.check_width(node, path)
        out = {}
        for key, value in node.items():
            where = step(path, key)
            if key in _DROPPED:
                continue
            if key == "$ref":
                out[key] = self._ref(value, path, pending)
            elif key in _LISTS and (isinstance(value, list) or key != "items"):
                if not isinstance(value, list):
                    raise ConstraintError(f"{where} must be a list of schemas")
                out[key] = [self._walk(v, step(where, j), depth + 1, pending)
                            for j, v in enumerate(value)]
            elif key in _ONE:
                out[key] = self._walk(value, where, depth + 1, pending)
            elif key in _MAPS:
                if not isinstance(value, dict):
                    raise ConstraintError(f"{where} must be an object")
                out[key] = {k: v if key == "dependencies" and isinstance(v, list)  # names
                            else self._walk(v, step(where, k), depth + 1, pending)
                            for k, v in value.items()}
            else:
                out[key] = value
        return out

    def _ref(self, ref: Any, path: str, pending: list) -> str:
        pointer = self._pointer(ref, path)
        name = self.names.get(pointer)
        if name is None:
            name = self.names[pointer] = f"{self.prefix}{len(self.names)}"
            target, where = self.resolve(*self._target(pointer, path))
            pending.append((name, target, where))
        return f"#/$defs/{name}"

    def _pointer(self, ref: Any, path: str) -> tuple[str, ...]:
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise ConstraintError(f"{path}.$ref must be a local reference (\"#\" or "
                                  f"\"#/...\"), not {json.dumps(ref)[:80]}")
        if ref == "#":
            return ()
        return tuple(part.replace("~1", "/").replace("~0", "~")
                     for part in unquote(ref[2:]).split("/"))

    def _target(self, pointer: tuple[str, ...], path: str) -> tuple[Any, str]:
        node, where = self.tool.parameters, self.tool.where
        for part in pointer:
            if isinstance(node, dict) and part in node:
                node, where = node[part], step(where, part)
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node, where = node[int(part)], step(where, int(part))
            else:
                ref = "#/" + "/".join(p.replace("~", "~0").replace("/", "~1") for p in pointer)
                raise ConstraintError(f"{path}.$ref {ref!r} points at nothing")
        return node, where


def check_object(node: dict, path: str, defined: bool = False) -> set[str]:
    """The required property names of an object schema that has `properties`, checked: names
    (strings; with `defined`, of its properties), and at most MAX_OPTIONAL others."""
    properties = node["properties"]
    if not isinstance(properties, dict):
        raise ConstraintError(f"{step(path, 'properties')} must be an object")
    required = node.get("required", [])
    where = step(path, "required")
    if not isinstance(required, list):
        raise ConstraintError(f"{where} must be a list of property names")
    for j, key in enumerate(required):
        if not isinstance(key, str):
            raise ConstraintError(f"{step(where, j)} must be a property name (a string), not "
                                  f"{json.dumps(key)[:40]}")
        if defined and key not in properties:
            raise ConstraintError(f"{where} names {key!r}, which {step(path, 'properties')} "
                                  "does not define")
    optional = len(properties) - len(set(required) & set(properties))
    if optional > MAX_OPTIONAL:
        raise ConstraintError(f"{path} has {optional:,} optional properties; a constrained call "
                              f"takes at most {MAX_OPTIONAL} in one object (the grammar "
                              "engine's limit): make some required, or split the tool")
    return set(required)
