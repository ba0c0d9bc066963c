"""A JSON schema (a documented subset) compiled to a regular expression whose matches are the JSON texts valid for it.

JSON's own grammar nests without bound, which no finite automaton follows; a schema's nesting is finite (its
properties, items and `$ref`s to `$defs` are finite and not recursive), so its valid texts form a regular
language. Whitespace is bounded: at most one space where JSON allows whitespace (`WS`), so no constraint can
spend its tokens on blanks. Properties come in the schema's order, required ones always, optional ones or not.

Supported: `type` (string, number, integer, boolean, null, object, array, or a list of them), `properties`,
`required`, `additionalProperties` (false, or absent/true: no property but the listed ones is generated either way),
`enum`, `const`, `items`, `minItems`, `maxItems`, `minLength`, `maxLength`, `anyOf`, `$ref` into `$defs` or
`definitions`; annotations (`title`, `description`, `default`, `examples`, `$schema`, `$id`, `$comment`) are
ignored. Any other keyword is refused with a `SchemaError` naming it.

    >>> import re
    >>> pattern = schema_regex({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]})
    >>> bool(re.fullmatch(pattern, '{"ok": true}')), bool(re.fullmatch(pattern, '{"ok":"yes"}'))
    (True, False)
"""

from __future__ import annotations

import json
from typing import Any

from .regex import escape

WS = "[ ]?"
STRING_CHAR = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})'
STRING = f'"{STRING_CHAR}*"'
INTEGER = r"-?(?:0|[1-9][0-9]*)"
NUMBER = INTEGER + r"(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
SCALARS = {"string": STRING, "integer": INTEGER, "number": NUMBER, "boolean": "(?:true|false)", "null": "null"}
ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment", "$defs", "definitions"}
KEYWORDS = {
    "type",
    "properties",
    "required",
    "additionalProperties",
    "enum",
    "const",
    "items",
    "minItems",
    "maxItems",
    "minLength",
    "maxLength",
    "anyOf",
    "$ref",
}
JSON_DEPTH = 3  # json_object: objects and arrays nest this deep at most


class SchemaError(ValueError):
    """A schema outside the subset; the message names the keyword (and where it is)."""


def schema_regex(schema: Any) -> str:
    """The regex of the JSON texts `schema` accepts (see the module's docstring for the subset)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as err:
            raise SchemaError(f"the schema is not JSON: {err}") from None
    if not isinstance(schema, dict):
        raise SchemaError(f"a JSON schema must be an object, got {type(schema).__name__}")
    return Compiler(schema).value(schema, "#", ())


class Compiler:
    def __init__(self, root: dict):
        self.defs = {**root.get("definitions", {}), **root.get("$defs", {})}

    def value(self, schema: Any, where: str, refs: tuple) -> str:
        if schema is True or schema == {}:
            return json_value(JSON_DEPTH)
        if not isinstance(schema, dict):
            raise SchemaError(f"{where}: a schema must be an object, got {schema!r}")
        unknown = sorted(set(schema) - KEYWORDS - ANNOTATIONS)
        if unknown:
            raise SchemaError(
                f"{where}: the keyword {unknown[0]!r} is not supported (supported: {', '.join(sorted(KEYWORDS))})"
            )
        if "$ref" in schema:
            return self.ref(schema["$ref"], where, refs)
        if "const" in schema:
            return escape(json.dumps(schema["const"]))
        if "enum" in schema:
            if not isinstance(schema["enum"], list) or not schema["enum"]:
                raise SchemaError(f"{where}: 'enum' must be a non-empty list")
            return "(?:" + "|".join(escape(json.dumps(v)) for v in schema["enum"]) + ")"
        if "anyOf" in schema:
            options = schema["anyOf"]
            if not isinstance(options, list) or not options:
                raise SchemaError(f"{where}: 'anyOf' must be a non-empty list of schemas")
            return "(?:" + "|".join(self.value(s, f"{where}/anyOf/{i}", refs) for i, s in enumerate(options)) + ")"
        kind = schema.get("type")
        if kind is None:
            if "properties" in schema:
                kind = "object"
            elif "items" in schema:
                kind = "array"
            else:
                return json_value(JSON_DEPTH)
        if isinstance(kind, list):
            return "(?:" + "|".join(self.typed(dict(schema, type=k), k, where, refs) for k in kind) + ")"
        return self.typed(schema, kind, where, refs)

    def typed(self, schema: dict, kind: str, where: str, refs: tuple) -> str:
        if kind == "object":
            return self.object(schema, where, refs)
        if kind == "array":
            return self.array(schema, where, refs)
        if kind == "string" and ("minLength" in schema or "maxLength" in schema):
            low, high = bounds(schema, "minLength", "maxLength", where)
            return f'"{STRING_CHAR}{{{low},{"" if high is None else high}}}"'
        if kind not in SCALARS:
            raise SchemaError(f"{where}: the type {kind!r} is not a JSON schema type")
        return SCALARS[kind]

    def object(self, schema: dict, where: str, refs: tuple) -> str:
        properties = schema.get("properties", {})
        required = set(schema.get("required", []))
        if set(required) - set(properties):
            raise SchemaError(f"{where}: 'required' names {sorted(required - set(properties))[0]!r}, not a property")
        extra = schema.get("additionalProperties", True)
        if extra not in (True, False):
            raise SchemaError(f"{where}: 'additionalProperties' as a schema is not supported; use false or true")
        if not properties:
            return r"\{" + WS + r"\}" if extra is False else json_object(JSON_DEPTH)
        members = [
            escape(json.dumps(name)) + WS + ":" + WS + self.value(sub, f"{where}/properties/{name}", refs)
            for name, sub in properties.items()
        ]
        comma = WS + "," + WS
        after = ""  # the members from i on, after one already written: each with its comma
        first = ""  # the members from i on, none written yet
        for i in reversed(range(len(members))):
            name = list(properties)[i]
            if name in required:
                after, first = comma + members[i] + after, members[i] + after
            else:
                after, first = f"(?:{comma}{members[i]})?" + after, f"(?:{members[i]}{after}|{first})"
        return r"\{" + WS + f"(?:{first})" + WS + r"\}"

    def array(self, schema: dict, where: str, refs: tuple) -> str:
        item = self.value(schema.get("items", {}), f"{where}/items", refs)
        low, high = bounds(schema, "minItems", "maxItems", where)
        if high == 0:
            return r"\[" + WS + r"\]"
        more = f"(?:{WS},{WS}{item}){{{max(low - 1, 0)},{'' if high is None else high - 1}}}"
        items = item + more
        return r"\[" + WS + (items if low > 0 else f"(?:{items})?") + WS + r"\]"

    def ref(self, ref: Any, where: str, refs: tuple) -> str:
        prefixes = ("#/$defs/", "#/definitions/")
        if not isinstance(ref, str) or not ref.startswith(prefixes):
            raise SchemaError(f"{where}: '$ref' {ref!r} is not supported; refer into '#/$defs/'")
        name = ref.split("/", 2)[2]
        if ref in refs:
            raise SchemaError(f"{where}: '$ref' {ref!r} is recursive, which no regular expression can follow")
        if name not in self.defs:
            raise SchemaError(f"{where}: '$ref' {ref!r} names no definition")
        return self.value(self.defs[name], ref, refs + (ref,))


def bounds(schema: dict, low_key: str, high_key: str, where: str) -> tuple[int, Any]:
    low, high = schema.get(low_key, 0), schema.get(high_key)
    for key, value in ((low_key, low), (high_key, high)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise SchemaError(f"{where}: '{key}' must be a whole number >= 0, got {value!r}")
    if high is not None and high < low:
        raise SchemaError(f"{where}: '{high_key}' ({high}) is below '{low_key}' ({low})")
    if max(low, high or 0) > 1000:
        raise SchemaError(f"{where}: '{low_key}'/'{high_key}' above 1000 are not supported")
    return low, high


def json_value(depth: int) -> str:
    """Any JSON value whose objects and arrays nest at most `depth` deep."""
    scalars = "|".join(SCALARS.values())
    if depth == 0:
        return f"(?:{scalars})"
    return f"(?:{scalars}|{json_object(depth)}|{json_array(depth)})"


def json_object(depth: int) -> str:
    """Any JSON object nesting at most `depth` deep (what `json_object=True` asks for: depth JSON_DEPTH)."""
    member = STRING + WS + ":" + WS + json_value(depth - 1)
    return r"\{" + WS + f"(?:{member}(?:{WS},{WS}{member})*)?" + WS + r"\}"


def json_array(depth: int) -> str:
    item = json_value(depth - 1)
    return r"\[" + WS + f"(?:{item}(?:{WS},{WS}{item})*)?" + WS + r"\]"
