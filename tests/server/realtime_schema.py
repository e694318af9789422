"""Server events checked against the ``openai`` SDK's own models of them (the published Realtime schema).

The SDK parses what it receives without validating it (``construct_type_unchecked``), so a missing required field
or a value outside the schema passes its parsing unnoticed; :func:`check_event` validates each event with the
model of its ``type`` (GA, or beta for a client that asked for the beta names). ``cspan.*`` events are this
server's extensions and have no model.
"""

from __future__ import annotations

import typing
from typing import Any, get_args, get_origin

import pydantic


def _members(union: Any) -> list[Any]:
    if get_origin(union) is typing.Annotated:
        return _members(get_args(union)[0])
    if get_origin(union) is typing.Union:
        return [m for a in get_args(union) for m in _members(a)]
    return [union]


def _by_type(union: Any) -> dict[str, type[pydantic.BaseModel]]:
    return {v: m for m in _members(union) for v in get_args(m.model_fields["type"].annotation)}


def _models(beta: bool) -> dict[str, type[pydantic.BaseModel]]:
    if beta:
        from openai.types.beta.realtime import RealtimeServerEvent
    else:
        from openai.types.realtime import RealtimeServerEvent
    return _by_type(RealtimeServerEvent)


def check_event(raw: dict[str, Any], *, beta: bool = False) -> None:
    """Assert that ``raw`` is an event of the published schema (or a ``cspan.*`` extension)."""
    kind = raw.get("type")
    if isinstance(kind, str) and kind.startswith("cspan."):
        return
    model = _models(beta).get(str(kind))
    assert model is not None, f"{kind!r} is not a server event of the {'beta' if beta else 'GA'} schema"
    if beta and isinstance(raw.get("session"), dict):
        # the beta session's ``model`` is a Literal of OpenAI's model names; this server names its own checkpoint
        raw = {**raw, "session": {k: v for k, v in raw["session"].items() if k != "model"}}
    try:
        model.model_validate(raw)
    except pydantic.ValidationError as exc:
        raise AssertionError(f"{kind} does not match the SDK's {model.__name__}: {exc}\n{raw}") from None
