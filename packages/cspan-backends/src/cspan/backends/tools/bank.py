"""The tool bank: named tools with JSON-Schema parameters, validation, coercion, timeouts and spoken results.

A :class:`Tool` couples a pydantic model (its parameters) with an async callable. :class:`ToolBank` holds tools by
name, validates and coerces the arguments a router LLM produced (``"2"`` becomes ``2`` for an integer field),
runs the tool under a timeout and returns a :class:`ToolResult` whose ``text`` is the short spoken clause that the
Context Span carries after the ``"(tool result) "`` prefix (the prefix is the router's job, see
``docs/reference/context-spanning-original.md`` section 4.5).

Tool output is *data*: the clause is stripped of control and format characters, whitespace is collapsed and the
result is cut to ``max_chars`` characters. Nothing in it is ever interpreted.

Every failure (unknown tool, invalid arguments, timeout, the tool raising) surfaces as
:class:`cspan.backends.errors.ToolError` with the tool's name and, for validation, the field. What a failing tool
said is data too: a failure's message is made one line the same way, quotes at most :data:`MAX_QUOTED_CHARS` of
the tool's own words and is cut to :data:`MAX_ERROR_CHARS`.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import inspect
import json
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict

from cspan.backends.deadline import Deadline
from cspan.backends.errors import ToolError
from cspan.backends.untrusted import is_seconds, sanitize_text

__all__ = [
    "DEFAULT_MAX_CHARS",
    "MAX_ERROR_CHARS",
    "MAX_QUOTED_CHARS",
    "Tool",
    "ToolArgs",
    "ToolBank",
    "ToolKind",
    "ToolOutput",
    "ToolResult",
    "call_deadline",
    "calls_due_by",
    "render_clause",
    "sanitize_text",
    "tool_name_key",
]

DEFAULT_MAX_CHARS = 400
"""Default cap, in characters, on :attr:`ToolResult.text`."""

MAX_ERROR_CHARS = 1000
"""Cap, in characters, on the message of a tool's failure (:meth:`ToolBank.call`): it reaches the client's
``no_span`` event, the Context DB's span row and the log, whatever the tool (an MCP server) answered."""

_CALL_DEADLINE = Deadline("cspan_tool_deadline")


def call_deadline() -> float | None:
    """When the tool call in progress must be over: the event loop's clock (``loop.time()``) at which
    :meth:`ToolBank.call`'s timeout ends it, or the deadline of what made the call (:func:`calls_due_by`: a
    retrieval's) where that comes first, as seen from inside the tool; None outside a bank's call. A tool that would
    wait (a server's ``Retry-After``) reads it to know whether the wait fits."""
    return _CALL_DEADLINE.get()


def calls_due_by(at: float) -> contextlib.AbstractContextManager[None]:
    """Tool calls made inside (by this task and the tasks it starts) must be over by ``at`` (``loop.time()``) at the
    latest, a deadline of their caller's that comes before their own timeout (a retrieval's: what the call is for is
    lost past it): :func:`call_deadline` is the nearer of the two."""
    return _CALL_DEADLINE.by(at)


MAX_QUOTED_CHARS = 300
"""Cap, in characters, on what a failing tool itself said (an MCP server's error text, an exception's message)
where a failure's message quotes it."""

NO_INFORMATION = "(no information found)"
"""What a tool that ran and found nothing returns (the released model was trained on this abstain clause)."""

ToolKind = Literal["read", "action"]

_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class ToolArgs(BaseModel):
    """Base class for tool parameter models.

    Lax coercion of the kind a router LLM needs: numeric strings become numbers (pydantic's lax mode), numbers
    become strings where a string is expected (``order_id=48213``), surrounding whitespace is stripped, and
    unknown keys are ignored (dropped) rather than failing the call.
    """

    model_config = ConfigDict(extra="ignore", coerce_numbers_to_str=True, str_strip_whitespace=True)


@dataclass(frozen=True)
class ToolOutput:
    """What a tool callable may return when it has both a spoken clause and structured data.

    ``text`` is the clause (digits allowed, no prefix); ``data`` any JSON-serialisable value that later steps can
    reuse (for example flight ids of a search).
    """

    text: str
    data: Any = None


ToolFn = Callable[..., Awaitable[Any]]


@dataclass
class Tool:
    """One callable tool.

    Attributes:
        name: unique name, ``[A-Za-z0-9_-]{1,64}`` (the OpenAI function-name alphabet).
        description: one or two sentences for the router prompt (what it does, typical use).
        parameters: a pydantic model class; its fields are the tool's arguments.
        fn: async callable taking the validated fields as keyword arguments and returning a ``str`` clause, a
            JSON-serialisable ``dict``/``list`` (rendered with :func:`render_clause`) or a :class:`ToolOutput`;
            ``None`` or a blank clause means it found nothing (the result is ``(no information found)``).
            A plain (sync) callable is run in a worker thread.
        kind: ``"read"`` (looks something up) or ``"action"`` (changes state: books, pays, cancels, writes).
            Routers run actions only after the user confirms (see :class:`~cspan.backends.router.LLMRouter`).
        timeout_s: seconds one call may take before it fails with :class:`ToolError` (a finite number > 0).
        domain: optional group name (e.g. ``"travel_identity"``) for routers that pick a domain first.
        schema: optional JSON Schema to advertise instead of the one generated from ``parameters`` (used for MCP
            tools, whose server-side schema is the authority).
        confirm: whether the router must get the user's confirmation before running it; ``None`` (default):
            exactly the actions. ``False`` on an action marks a low-risk, reversible one (remembering a fact).
    """

    name: str
    description: str
    parameters: type[BaseModel]
    fn: ToolFn
    kind: ToolKind = "read"
    timeout_s: float = 10.0
    domain: str = ""
    schema: dict[str, Any] | None = field(default=None, repr=False)
    confirm: bool | None = None

    @property
    def needs_confirmation(self) -> bool:
        """Whether a router must hold this tool back until the user confirms."""
        return self.kind == "action" if self.confirm is None else self.confirm

    def __post_init__(self) -> None:
        if not _NAME_RE.match(self.name):
            raise ToolError(
                f"invalid tool name {self.name!r}: use 1-64 characters from A-Z a-z 0-9 _ -", tool=self.name
            )
        if self.kind not in ("read", "action"):
            raise ToolError(f"tool {self.name!r}: kind must be 'read' or 'action', got {self.kind!r}", tool=self.name)
        if not (isinstance(self.parameters, type) and issubclass(self.parameters, BaseModel)):
            raise ToolError(f"tool {self.name!r}: parameters must be a pydantic BaseModel subclass", tool=self.name)
        if not callable(self.fn):
            raise ToolError(
                f"tool {self.name!r}: fn must be a function (async or plain) taking the arguments as keywords, got "
                f"{type(self.fn).__name__}",
                tool=self.name,
            )
        if not (is_seconds(self.timeout_s) and self.timeout_s > 0):
            raise ToolError(
                f"tool {self.name!r}: timeout_s must be a finite number of seconds > 0, got {self.timeout_s!r}",
                tool=self.name,
            )

    def json_schema(self) -> dict[str, Any]:
        """JSON Schema of the parameters, without pydantic's ``title`` noise.

        ``Optional[X]`` fields are advertised as plain ``X`` (an omitted argument means "not given"), and local
        ``$ref``s are inlined so that the schema is self-contained. Returns a fresh dict each time.
        """
        raw = copy.deepcopy(self.schema) if self.schema is not None else self.parameters.model_json_schema()
        defs = raw.pop("$defs", None) or raw.pop("definitions", None) or {}
        cleaned = _clean_schema(raw, defs, depth=0)
        cleaned.setdefault("type", "object")
        cleaned.setdefault("properties", {})
        return cleaned


class ToolResult(BaseModel):
    """The outcome of one :meth:`ToolBank.call`.

    Attributes:
        name: the tool that ran.
        arguments: the arguments after validation and coercion (fields left at a ``None`` default are omitted).
        text: the spoken clause, sanitised and cut to the bank's ``max_chars`` (no ``"(tool result) "`` prefix).
        data: structured output when the tool returned some (dict/list), else ``None``.
        latency_s: wall time of the tool itself in seconds (validation excluded).
        error: ``None`` on success; :meth:`ToolBank.try_call` puts the failure message here instead of raising.
    """

    name: str
    arguments: dict[str, Any]
    text: str
    data: Any | None = None
    latency_s: float = 0.0
    error: str | None = None


def _fmt_value(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return f"{value:.2f}".rstrip("0").rstrip(".")
    if isinstance(value, Mapping):
        return render_clause(value)
    if isinstance(value, list | tuple):
        return "; ".join(_fmt_value(v) for v in value)
    return str(value)


def tool_name_key(name: str) -> str:
    """The name as a router matches it: lower case, each run of other characters than ``a-z0-9`` one ``_``, none
    at either end (``GET_TIME``, ``get-time`` and ``get_time`` are one name: an LLM that says ``Get-Time`` or
    ``functions.get_time`` gets the tool of that key). Two tools of one bank never share a key."""
    return re.sub(r"[^a-z0-9]+", "_", name.strip().lower()).strip("_")


def render_clause(value: Any) -> str:
    """Render JSON-like tool output as a compact spoken clause.

    ``{"flight_id": "UA837", "price": 420.0}`` becomes ``"flight id UA837, price 420"``; lists are joined with
    ``"; "``; booleans read ``yes``/``no``. Digits are kept as digits.
    """
    if isinstance(value, Mapping):
        parts = []
        for key, item in value.items():
            if item is None or item == "" or item == [] or item == {}:
                continue
            parts.append(f"{str(key).replace('_', ' ')} {_fmt_value(item)}")
        return ", ".join(parts)
    return _fmt_value(value)


def _clean_schema(node: Any, defs: Mapping[str, Any], depth: int) -> Any:
    """Drop ``title`` annotations, inline local ``$ref``s and collapse ``anyOf[X, null]`` to ``X``."""
    if depth > 32:
        return {}
    if isinstance(node, list):
        return [_clean_schema(item, defs, depth + 1) for item in node]
    if not isinstance(node, dict):
        return node
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith(("#/$defs/", "#/definitions/")):
        target = defs.get(ref.rsplit("/", 1)[-1], {})
        merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return _clean_schema(merged, defs, depth + 1)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "title" and isinstance(value, str):
            continue
        if key == "properties" and isinstance(value, dict):
            out[key] = {name: _clean_schema(sub, defs, depth + 1) for name, sub in value.items()}
        else:
            out[key] = _clean_schema(value, defs, depth + 1)
    variants = out.get("anyOf")
    if isinstance(variants, list):
        non_null = [v for v in variants if not (isinstance(v, dict) and v.get("type") == "null")]
        if len(non_null) == 1 and len(non_null) < len(variants) and isinstance(non_null[0], dict):
            rest = {k: v for k, v in out.items() if k != "anyOf"}
            if rest.get("default", 0) is None:
                rest.pop("default")
            out = {**non_null[0], **rest}
    return out


def _field_path(loc: Iterable[Any]) -> str:
    return ".".join(str(part) for part in loc) or "(arguments)"


MCP_STATES = ("up", "reconnecting", "down")
"""The states of an MCP server's connection (:attr:`cspan.backends.tools.mcp_bridge.MCPConnection.state`)."""


class ToolBank:
    """A set of tools by name, with validation, coercion, timeouts and spoken results.

    Args:
        tools: tools to register at once.
        max_chars: cap on :attr:`ToolResult.text` in characters (default 400).
        confirm_actions: whether routers hold back tools that need confirmation (:attr:`Tool.needs_confirmation`)
            until the user confirms; on by default, off only in the benchmark's mock world
            (:func:`~cspan.backends.tools.catalog.fdb_v3_bank` with ``confirm_actions=False``).

    Build one from configuration with :mod:`cspan.backends.tools.catalog` (``build_bank(ToolsSpec)``: built-in
    sets by name and MCP servers; ``fdb_v3_bank`` for the benchmark's mock world, ``mount_mcp`` for one MCP server),
    combine with :meth:`merge`, make a session's view with :meth:`derive`, and release sockets, subprocesses and
    database handles with ``await bank.aclose()`` (or ``async with``).
    """

    def __init__(
        self, tools: Iterable[Tool] = (), *, max_chars: int = DEFAULT_MAX_CHARS, confirm_actions: bool = True
    ) -> None:
        if max_chars < 8:
            raise ToolError(f"max_chars must be at least 8, got {max_chars}")
        self.max_chars = max_chars
        self.confirm_actions = confirm_actions
        self._tools: dict[str, Tool] = {}
        self._closers: list[Callable[[], Awaitable[None]]] = []
        self.mcp: list[Any] = []  # the MCP connections its tools call (:class:`~.mcp_bridge.MCPConnection`)
        for tool in tools:
            self.register(tool)

    # ------------------------------------------------------------------ construction

    def register(self, tool: Tool, *, replace: bool = False) -> None:
        """Add ``tool``; a second tool with the same name raises :class:`ToolError` unless ``replace``."""
        if not isinstance(tool, Tool):
            raise ToolError(f"register() takes a Tool, got {type(tool).__name__}")
        if tool.name in self._tools and not replace:
            raise ToolError(
                f"tool {tool.name!r} is already registered; pass replace=True or mount with a prefix", tool=tool.name
            )
        key = tool_name_key(tool.name)
        same = [name for name in self._tools if name != tool.name and tool_name_key(name) == key]
        if same:  # a router would take one for the other (an LLM's "Get_Time" is get_time's call)
            raise ToolError(
                f"tool {tool.name!r} would be confused with the registered tool {same[0]!r} (a router reads both as "
                f"{key!r}); rename it or mount with a prefix",
                tool=tool.name,
            )
        self._tools[tool.name] = tool

    def add_closer(self, closer: Callable[[], Awaitable[None]]) -> None:
        """Run ``await closer()`` in :meth:`aclose` (resources the bank owns: sessions, databases)."""
        self._closers.append(closer)

    def derive(self, extra: Iterable[Tool] = (), *, replace: bool = False) -> ToolBank:
        """A new bank with this bank's tools plus ``extra`` (a session's own tools), same settings.

        The new bank shares this one's tools but owns none of its resources: closing it closes only what was
        added to it with :meth:`add_closer`. Cheap (a dict copy); a server makes one per session.

        Raises:
            ToolError: an ``extra`` tool's name exists already and ``replace`` is false.
        """
        bank = ToolBank(max_chars=self.max_chars, confirm_actions=self.confirm_actions)
        bank._tools = dict(self._tools)
        bank.mcp = list(self.mcp)  # listed, not owned (their closers stay with this bank)
        for tool in extra:
            bank.register(tool, replace=replace)
        return bank

    def merge(self, other: ToolBank, *, replace: bool = False) -> ToolBank:
        """Add ``other``'s tools to this bank and take ownership of its resources; returns ``self``.

        Raises:
            ToolError: a name exists in both banks and ``replace`` is false, or two names a router would take one
                for the other (:func:`tool_name_key`); nothing is merged then.
        """
        if not replace:
            clash = sorted(set(self._tools) & set(other._tools))
            if clash:
                raise ToolError(f"cannot merge: tools {clash} exist in both banks; use replace=True or a prefix")
        mine = {tool_name_key(name): name for name in self._tools}
        confused = sorted(
            f"{name!r} and {mine[tool_name_key(name)]!r}"
            for name in other._tools
            if mine.get(tool_name_key(name), name) != name
        )
        if confused:
            raise ToolError(
                f"cannot merge: tools {', '.join(confused)} would be confused (a router reads them as one name); "
                "mount with a prefix"
            )
        for tool in other._tools.values():
            self.register(tool, replace=True)
        self._closers.extend(other._closers)
        self.mcp.extend(other.mcp)
        other._closers, other.mcp = [], []
        return self

    def mcp_states(self) -> dict[str, int]:
        """How many of the bank's MCP servers are ``up``, ``reconnecting`` and ``down`` (see
        :attr:`cspan.backends.tools.mcp_bridge.MCPConnection.state`); every key is present."""
        states = dict.fromkeys(MCP_STATES, 0)
        for conn in self.mcp:
            states[conn.state] += 1
        return states

    # ------------------------------------------------------------------ lookup

    def names(self) -> list[str]:
        """Registered tool names in registration order."""
        return list(self._tools)

    def tools(self) -> list[Tool]:
        """Registered tools in registration order."""
        return list(self._tools.values())

    def get(self, name: str) -> Tool:
        """The tool called ``name``.

        Raises:
            ToolError: unknown name (the message lists the known ones).
        """
        tool = self._tools.get(name)
        if tool is None:
            known = ", ".join(self._tools) or "(none)"
            raise ToolError(f"unknown tool {name!r}; this bank has: {known}", tool=name)
        return tool

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __len__(self) -> int:
        return len(self._tools)

    def __iter__(self) -> Iterator[Tool]:
        return iter(list(self._tools.values()))

    def domains(self) -> dict[str, list[str]]:
        """Tool names grouped by :attr:`Tool.domain` (tools without a domain under ``""``)."""
        groups: dict[str, list[str]] = {}
        for tool in self._tools.values():
            groups.setdefault(tool.domain, []).append(tool.name)
        return groups

    def openai_tools(self, names: Iterable[str] | None = None) -> list[dict[str, Any]]:
        """Tools in the OpenAI chat-completions ``tools`` format (all, or only ``names``)."""
        chosen = [self.get(n) for n in names] if names is not None else list(self._tools.values())
        return [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description, "parameters": t.json_schema()},
            }
            for t in chosen
        ]

    def catalogue_json(self, names: Iterable[str] | None = None) -> str:
        """Compact JSON list ``[{"name", "description", "parameters", "kind"[, "domain"]}]`` for JSON-mode prompts."""
        chosen = [self.get(n) for n in names] if names is not None else list(self._tools.values())
        items = []
        for t in chosen:
            item: dict[str, Any] = {
                "name": t.name,
                "description": t.description,
                "parameters": t.json_schema(),
                "kind": t.kind,
            }
            if t.needs_confirmation and self.confirm_actions:
                item["needs_confirmation"] = True
            if t.domain:
                item["domain"] = t.domain
            items.append(item)
        return json.dumps(items, ensure_ascii=False, separators=(",", ":"))

    # ------------------------------------------------------------------ validation and calls

    def _validated(self, tool: Tool, arguments: Mapping[str, Any] | str | None) -> tuple[dict[str, Any], dict]:
        if arguments is None:
            arguments = {}
        if isinstance(arguments, str):
            text = arguments.strip() or "{}"
            try:
                arguments = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ToolError(
                    f"tool {tool.name!r}: arguments are not valid JSON ({exc.msg} at {exc.pos}); pass an object",
                    tool=tool.name,
                ) from None
        if not isinstance(arguments, Mapping):
            raise ToolError(
                f"tool {tool.name!r}: arguments must be an object of name -> value, got {type(arguments).__name__}",
                tool=tool.name,
            )
        try:
            model = tool.parameters.model_validate(dict(arguments))
        except pydantic.ValidationError as exc:
            err = exc.errors(include_url=False)[0]
            path = _field_path(err.get("loc", ()))
            if err.get("type") == "missing":
                msg = f"tool {tool.name!r}: missing required argument {path!r}"
            else:
                shown = repr(err.get("input"))
                if len(shown) > 80:
                    shown = shown[:77] + "..."
                msg = f"tool {tool.name!r}: invalid argument {path!r}: {err.get('msg')} (got {shown})"
            more = len(exc.errors()) - 1
            if more > 0:
                msg += f" and {more} more problem(s)"
            raise ToolError(msg + "; see the tool's JSON schema", tool=tool.name, field=path) from None
        full = model.model_dump(by_alias=True)
        fields = type(model).model_fields
        explicit = {fields[n].alias or n for n in model.model_fields_set}
        shown_args = {k: v for k, v in full.items() if v is not None or k in explicit}
        return full, shown_args

    def validate(self, name: str, arguments: Mapping[str, Any] | str | None) -> dict[str, Any]:
        """Validate and coerce ``arguments`` for tool ``name``; returns the cleaned arguments.

        Strings are coerced to the declared types (``"2"`` -> ``2``, ``"100"`` -> ``100.0``), numbers to strings
        where a string is declared, unknown keys are dropped, and fields left at a ``None`` default are omitted.
        A JSON object given as a string is parsed first.

        Raises:
            ToolError: unknown tool, arguments not an object, or a field missing/invalid (``field`` names it).
        """
        return self._validated(self.get(name), arguments)[1]

    async def call(
        self, name: str, arguments: Mapping[str, Any] | str | None = None, *, timeout_s: float | None = None
    ) -> ToolResult:
        """Validate the arguments, run the tool under a timeout and return its spoken result.

        Args:
            name: tool name.
            arguments: raw arguments (a mapping or a JSON object string).
            timeout_s: overrides the tool's own ``timeout_s`` for this call (seconds).

        Raises:
            ToolError: unknown tool, invalid arguments, timeout, or the tool raised. A tool that returns nothing gives
                the text ``(no information found)``.
        """
        tool = self.get(name)
        full, shown = self._validated(tool, arguments)
        limit = timeout_s if timeout_s is not None else tool.timeout_s
        if not (is_seconds(limit) and limit > 0):
            raise ToolError(
                f"tool {name!r}: timeout_s must be a finite number of seconds > 0, got {limit!r}", tool=name
            )
        limit = float(limit)
        start = time.perf_counter()
        try:
            with _CALL_DEADLINE.by(asyncio.get_running_loop().time() + limit):  # call_deadline(), for the tool
                out = await asyncio.wait_for(self._invoke(tool, full), timeout=limit)
        except TimeoutError:
            raise ToolError(
                f"tool {name!r} timed out after {limit:g} s; retry later or raise its timeout", tool=name
            ) from None
        except ToolError as exc:
            # what the tool (an MCP server, a client's function) said is data of another party: one line, capped
            message = str(exc) if exc.tool is not None else f"tool {name!r}: {exc}"
            raise ToolError(sanitize_text(message, MAX_ERROR_CHARS), tool=exc.tool or name, field=exc.field) from exc
        except Exception as exc:
            message = f"tool {name!r} failed: {type(exc).__name__}: {sanitize_text(str(exc), MAX_QUOTED_CHARS)}"
            raise ToolError(sanitize_text(message, MAX_ERROR_CHARS), tool=name) from exc
        latency = time.perf_counter() - start
        text, data = self._render(tool, out)
        return ToolResult(name=name, arguments=shown, text=text, data=data, latency_s=latency)

    async def try_call(
        self, name: str, arguments: Mapping[str, Any] | str | None = None, *, timeout_s: float | None = None
    ) -> ToolResult:
        """Like :meth:`call` but never raises :class:`ToolError`: the message lands in ``ToolResult.error``."""
        try:
            return await self.call(name, arguments, timeout_s=timeout_s)
        except ToolError as exc:
            args = arguments if isinstance(arguments, Mapping) else {}
            return ToolResult(name=name, arguments=dict(args), text="", error=str(exc))

    @staticmethod
    async def _invoke(tool: Tool, kwargs: dict[str, Any]) -> Any:
        fn = tool.fn
        if inspect.iscoroutinefunction(fn):
            return await fn(**kwargs)
        result = await asyncio.to_thread(fn, **kwargs)
        if inspect.isawaitable(result):
            return await result
        return result

    def _render(self, tool: Tool, out: Any) -> tuple[str, Any]:
        data: Any = None
        if out is None:  # returned nothing (no return statement): ran and found nothing, as an empty clause
            text = ""
        elif isinstance(out, ToolOutput):
            text, data = out.text, out.data
        elif isinstance(out, str):
            text = out
        elif isinstance(out, Mapping | list | tuple):
            data = out
            text = render_clause(out)
        elif isinstance(out, int | float):
            text = _fmt_value(out)
            data = out
        else:
            raise ToolError(
                f"tool {tool.name!r} returned {type(out).__name__}; tools must return str, dict, list, ToolOutput or None",
                tool=tool.name,
            )
        text = sanitize_text(text, self.max_chars)
        if not text:
            # A tool that ran and found nothing is an answer, not a failure: the released model was trained on
            # the abstain span "(tool result) (no information found)" for exactly this case.
            text = NO_INFORMATION
        return text, data

    # ------------------------------------------------------------------ lifetime

    async def aclose(self) -> None:
        """Release what the bank owns (MCP sessions and subprocesses, the world database); idempotent."""
        closers, self._closers, self.mcp = self._closers, [], []
        errors: list[BaseException] = []
        for closer in reversed(closers):
            try:
                await closer()
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise ToolError(f"closing the tool bank failed: {errors[0]!r}") from errors[0]

    async def __aenter__(self) -> ToolBank:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"ToolBank({len(self._tools)} tools: {', '.join(self._tools)})"
