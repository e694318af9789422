"""JSON Schema -> pydantic model, for tools whose parameters are given as a schema (MCP tools, client functions).

Validation and coercion are then the same as for the built-in tools (:class:`~cspan.backends.tools.bank.ToolArgs`),
while the advertised schema stays the given one.
"""

from __future__ import annotations

import keyword
import re
from collections.abc import Mapping
from typing import Any, Literal, Union

from pydantic import BaseModel, Field, create_model

from cspan.backends.errors import ToolError
from cspan.backends.tools.bank import ToolArgs

__all__ = ["model_from_json_schema"]

_JSON_TYPES: dict[str, Any] = {
    "string": str,
    "integer": int,
    "number": float,
    "boolean": bool,
    "object": dict[str, Any],
    "array": list[Any],
    "null": type(None),
}


def _annotation(schema: Any, depth: int = 0) -> tuple[Any, bool]:
    """Python annotation for a JSON Schema node, and whether ``null`` is allowed."""
    if not isinstance(schema, dict) or depth > 8:
        return Any, True
    if "const" in schema:
        return Literal[schema["const"]], schema["const"] is None  # type: ignore[valid-type]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        values = [v for v in schema["enum"] if isinstance(v, str | int | float | bool) or v is None]
        if values:
            non_null = tuple(v for v in values if v is not None)
            return (Literal[non_null] if non_null else type(None)), None in values  # type: ignore[valid-type]
    for combinator in ("anyOf", "oneOf"):
        if isinstance(schema.get(combinator), list):
            parts = [_annotation(s, depth + 1) for s in schema[combinator]]
            nullable = any(n for _, n in parts) or any(
                isinstance(s, dict) and s.get("type") == "null" for s in schema[combinator]
            )
            types_ = [a for a, _ in parts if a is not type(None)]
            if not types_:
                return Any, True
            return (Union[tuple(types_)] if len(types_) > 1 else types_[0]), nullable  # noqa: UP007
    kind = schema.get("type")
    if isinstance(kind, list):
        nullable = "null" in kind
        parts = [_annotation({**schema, "type": k}, depth + 1)[0] for k in kind if k != "null"]
        if not parts:
            return type(None), True
        return (Union[tuple(parts)] if len(parts) > 1 else parts[0]), nullable  # noqa: UP007
    if kind == "array":
        item, _ = _annotation(schema.get("items"), depth + 1)
        return list[item], False  # type: ignore[valid-type]
    if kind == "null":
        return type(None), True
    if kind in _JSON_TYPES:
        return _JSON_TYPES[kind], False
    return Any, True


def _safe_field_name(name: str, index: int) -> str:
    if (
        name.isidentifier()
        and not keyword.iskeyword(name)
        and not name.startswith("_")
        and not hasattr(BaseModel, name)
    ):
        return name
    return f"arg{index}_{re.sub(r'[^0-9a-zA-Z_]', '_', name)}".rstrip("_")


def model_from_json_schema(name: str, schema: Mapping[str, Any] | None) -> type[ToolArgs]:
    """A :class:`ToolArgs` model equivalent to an object JSON Schema (an MCP tool's ``inputSchema``).

    Each property becomes a field: JSON types map to ``str``/``int``/``float``/``bool``/``list``/``dict``,
    ``enum`` to ``Literal``, ``anyOf``/``oneOf``/type lists to unions; ``minimum``/``maximum``,
    ``exclusiveMinimum``/``exclusiveMaximum``, ``minLength``/``maxLength`` become constraints; a property not in
    ``required`` is optional (its schema default, else ``None``). Property names that are not valid Python
    identifiers are kept as aliases, so arguments and dumps use the server's names.

    Raises:
        ToolError: the schema is not an object schema.
    """
    schema = dict(schema or {})
    if schema.get("type", "object") != "object":
        raise ToolError(f"tool {name!r}: inputSchema must describe an object, got type {schema.get('type')!r}")
    props = schema.get("properties") or {}
    required = set(schema.get("required") or [])
    fields: dict[str, Any] = {}
    for index, (prop, sub) in enumerate(props.items()):
        sub = sub if isinstance(sub, dict) else {}
        annotation, nullable = _annotation(sub)
        constraints: dict[str, Any] = {}
        for key, target in (
            ("minimum", "ge"),
            ("maximum", "le"),
            ("exclusiveMinimum", "gt"),
            ("exclusiveMaximum", "lt"),
            ("minLength", "min_length"),
            ("maxLength", "max_length"),
        ):
            if isinstance(sub.get(key), int | float) and not isinstance(sub.get(key), bool):
                constraints[target] = sub[key]
        # bounds apply to plain numbers, lengths to plain strings; unions and containers keep none
        allowed = {int: ("ge", "le", "gt", "lt"), float: ("ge", "le", "gt", "lt"), str: ("min_length", "max_length")}
        constraints = {k: v for k, v in constraints.items() if k in allowed.get(annotation, ())}
        if prop in required:
            default: Any = ...
        else:
            default = sub.get("default")
            nullable = True
        if nullable and annotation is not Any:
            annotation = annotation | None
        field_name = _safe_field_name(prop, index)
        alias = prop if field_name != prop else None
        fields[field_name] = (
            annotation,
            Field(default, description=sub.get("description"), alias=alias, **constraints),
        )
    model_name = "".join(part.capitalize() for part in re.split(r"[^0-9a-zA-Z]+", name) if part) + "Args"
    return create_model(model_name or "McpToolArgs", __base__=ToolArgs, **fields)
