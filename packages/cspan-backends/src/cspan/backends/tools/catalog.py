"""The tool catalog: tools are configuration. Built-in sets by name, MCP servers by command or URL.

The registry is :class:`~cspan.backends.tools.ToolBank`; this module ties it to every plugin. A server or a command
describes the tools it wants with a :class:`ToolsSpec` (from flags, a settings file or Python) and builds one shared
bank with ``await build_bank(spec)``; each session then gets its own view with :func:`session_bank` (the shared tools
plus that principal's memory tools and, for example, a Realtime client's function tools made with
:func:`callback_tool`).

Built-in sets (:data:`TOOL_SETS`):

============  ==========================================================================================
clock         ``get_time``: the current time and date in any timezone
calculator    ``calculate``: arithmetic (safe evaluator, no code)
weather       ``get_weather``: current weather from Open-Meteo (network; ``weather_url`` to point elsewhere)
knowledge     ``search_notes``: full-text search over the notes folder (``knowledge``; skipped without one)
memory        ``recall_memory``, ``remember_fact``: the session principal's Context DB facts (per session)
fdb-v3        the Full-Duplex-Bench v3 mock world: 12 travel, shopping and account tools over fabricated data
============  ==========================================================================================

The live default (:data:`LIVE_DEFAULT`) is every set but ``fdb-v3``: the mock world only answers when named.

Flag forms (:meth:`ToolsSpec.from_flags`): ``--tools clock,calculator,memory`` (``default`` = the live default,
``none`` = no built-in tools, ``default,fdb-v3`` adds to it), and ``--mcp SPEC`` (repeatable), where SPEC is a stdio
command line or a streamable-HTTP URL, optionally preceded by options::

    --mcp "npx -y @modelcontextprotocol/server-filesystem /srv/notes"
    --mcp "allow=search,fetch prefix=web_ https://mcp.example.org/mcp"
    --mcp "allow=read_file read=read_file -- python -m my_server --flag"

Options: ``allow=a,b`` (only these tools), ``read=a,b`` (treat these as reads whatever their annotations say),
``prefix=p_`` (prepended to the local names), ``timeout=S`` (per-call seconds); ``--`` ends the options. The
settings-file form (TOML, :meth:`ToolsSpec.from_toml`)::

    [tools]
    sets = ["clock", "calculator", "weather", "memory"]
    knowledge = "~/notes"

    [[tools.mcp]]
    command = ["npx", "-y", "@modelcontextprotocol/server-filesystem", "/srv/notes"]
    allow = ["read_file", "list_directory"]

    [[tools.mcp]]
    url = "http://127.0.0.1:8765/mcp"

Actions (tools that book, pay, cancel, write) are held back by the router until the user confirms (see
:class:`~cspan.backends.router.LLMRouter`); MCP tools are actions unless annotated ``readOnlyHint: true`` or listed
with ``read=``.
"""

from __future__ import annotations

import inspect
import math
import shlex
import tomllib
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from cspan.backends.context_db.models import MAX_FACT_KEY_CHARS, MAX_FACT_VALUE_CHARS
from cspan.backends.errors import ToolError
from cspan.backends.tools.bank import DEFAULT_MAX_CHARS, Tool, ToolArgs, ToolBank, ToolKind, ToolOutput
from cspan.backends.urls import check_http_url, redact_url

if TYPE_CHECKING:
    from cspan.backends.context_db import UserMemory
    from cspan.backends.knowledge import KnowledgeBase

__all__ = [
    "LIVE_DEFAULT",
    "TOOL_SETS",
    "MCPServerSpec",
    "ToolsSpec",
    "build_bank",
    "builtin_tools",
    "callback_tool",
    "fdb_v3_bank",
    "memory_tools",
    "mount_mcp",
    "parse_mcp",
    "session_bank",
]

TOOL_SETS: dict[str, str] = {
    "clock": "get_time: the current time and date in any timezone",
    "calculator": "calculate: arithmetic",
    "weather": "get_weather: current weather from Open-Meteo (network)",
    "knowledge": "search_notes: full-text search over the notes folder (--knowledge)",
    "memory": "recall_memory, remember_fact: the user's own Context DB facts (per session)",
    "fdb-v3": "Full-Duplex-Bench v3 mock world: 12 travel, shopping and account tools over fabricated data",
}
"""Built-in tool sets by name, with what each provides."""

LIVE_DEFAULT: tuple[str, ...] = ("clock", "calculator", "weather", "knowledge", "memory")
"""What ``--tools default`` (and no ``--tools``) means: every set but the benchmark's mock world."""

PER_SESSION = frozenset({"memory"})
"""Sets made per session (they act on the session principal's own data), by :func:`session_bank`."""

_MCP_OPTIONS = ("allow", "read", "prefix", "timeout")


class MCPServerSpec(BaseModel):
    """One MCP server to mount: a stdio ``command`` (argv) or a streamable-HTTP ``url``.

    ``allow``: only these tools (the server's names; None for all); ``read_only``: tools treated as reads whatever
    their annotations; ``prefix``: prepended to local names; ``timeout_s``: per-call limit; ``env``/``cwd``: of the
    subprocess.
    """

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    command: list[str] | None = None
    url: str | None = None
    allow: list[str] | None = None
    read_only: list[str] = Field(default_factory=list, alias="read")
    prefix: str = ""
    timeout_s: float = Field(10.0, gt=0, le=600, allow_inf_nan=False, alias="timeout")
    env: dict[str, str] | None = None
    cwd: str | None = None

    @field_validator("allow")
    @classmethod
    def _allow_names_a_tool(cls, allow: list[str] | None) -> list[str] | None:
        if allow is not None and not allow:  # `allow=` mounted none of the server's tools, without a word
            raise ValueError("an empty list mounts no tool: name the tools (allow=a,b), or leave allow out for all")
        return allow

    @model_validator(mode="after")
    def _one_transport(self) -> MCPServerSpec:
        if (self.command is None) == (self.url is None):
            raise ValueError("give exactly one of command (a stdio server) or url (streamable HTTP)")
        if self.command is not None and not self.command:
            raise ValueError("command is empty")
        if self.url is not None:
            check_http_url(self.url)
        return self

    @property
    def where(self) -> str:
        return shlex.join(self.command) if self.command is not None else str(self.url)


def parse_mcp(text: str) -> MCPServerSpec:
    """One ``--mcp`` value: options (``allow=a,b read=a prefix=p_ timeout=S``, then optionally ``--``) and a
    command line or an ``http(s)://`` URL (see the module docstring).

    Raises:
        ToolError: empty, an unknown or malformed option, or no command/URL after the options.
    """
    shown = repr(redact_url(text))  # a password in the URL is not echoed
    try:
        words = shlex.split(text)
    except ValueError as exc:
        raise ToolError(f"--mcp {shown}: {exc} (quote the command as a shell would)") from None
    options: dict[str, Any] = {}
    while words:
        word = words[0]
        if word == "--":
            words.pop(0)
            break
        key, eq, value = word.partition("=")
        if eq and key not in _MCP_OPTIONS and key.isidentifier():  # alow=a: a typo, not a program to run
            raise ToolError(
                f"--mcp {shown}: unknown option {key!r}; the options are {', '.join(_MCP_OPTIONS)} (a command whose "
                "first word has '=' goes after --)"
            )
        if not eq or key not in _MCP_OPTIONS:
            break
        words.pop(0)
        if key in ("allow", "read"):
            options[key] = [v for v in value.split(",") if v]
        elif key == "timeout":
            try:
                options[key] = float(value)
            except ValueError:
                raise ToolError(f"--mcp {shown}: timeout={value!r} is not a number of seconds") from None
        else:
            options[key] = value
    if not words:
        raise ToolError(f"--mcp {shown}: give a stdio command line or an http(s):// URL after the options")
    target: dict[str, Any] = (
        {"url": words[0]} if len(words) == 1 and words[0].startswith(("http://", "https://")) else {"command": words}
    )
    try:
        return MCPServerSpec(**target, **options)
    except ValidationError as exc:
        raise ToolError(f"--mcp {shown}: {_first_error(exc)}") from None


def _first_error(exc: ValidationError) -> str:
    err = exc.errors(include_url=False)[0]
    where = ".".join(str(p) for p in err.get("loc", ()))
    return f"{where + ': ' if where else ''}{str(err.get('msg')).removeprefix('Value error, ')}"


class ToolsSpec(BaseModel):
    """Which tools a server or command offers (see the module docstring for the flag and file forms).

    Attributes:
        sets: built-in sets by name (:data:`TOOL_SETS`); default :data:`LIVE_DEFAULT`.
        mcp: MCP servers to mount.
        knowledge: folder of ``.txt`` / ``.md`` notes for ``search_notes`` (and the local router).
        world_db: SQLite file of the ``fdb-v3`` mock world (None: in memory).
        weather_url, geocoding_url: Open-Meteo base URLs (default env ``CSPAN_WEATHER_URL`` / ``CSPAN_GEOCODING_URL``).
        max_chars: cap on a tool result's text in characters.
        confirm_actions: hold back actions until the user confirms (on; the benchmark turns it off).
    """

    model_config = ConfigDict(extra="forbid")

    sets: list[str] = Field(default_factory=lambda: list(LIVE_DEFAULT))
    mcp: list[MCPServerSpec] = Field(default_factory=list)
    knowledge: Path | None = None
    world_db: Path | None = None
    weather_url: str | None = None
    geocoding_url: str | None = None
    max_chars: int = Field(DEFAULT_MAX_CHARS, ge=40, le=4000)
    confirm_actions: bool = True

    @field_validator("sets")
    @classmethod
    def _known_sets(cls, sets: list[str]) -> list[str]:
        out: list[str] = []
        for name in sets:
            if name not in TOOL_SETS:
                raise ValueError(f"unknown tool set {name!r}; known: {', '.join(TOOL_SETS)}")
            if name not in out:
                out.append(name)
        return out

    @classmethod
    def from_flags(cls, tools: str | None = None, mcp: Iterable[str] = (), **settings: Any) -> ToolsSpec:
        """From ``--tools NAME,...`` (None: the live default) and ``--mcp SPEC`` values; ``settings`` are the other
        fields (``knowledge=``, ``world_db=`` ...).

        Raises:
            ToolError: an unknown set name or a malformed ``--mcp`` (the message names the flag and the fix).
        """
        sets = list(LIVE_DEFAULT) if tools is None else parse_tools(tools)
        servers = [parse_mcp(text) for text in mcp]
        try:
            return cls(sets=sets, mcp=servers, **settings)
        except ValidationError as exc:
            raise ToolError(f"tool settings: {_first_error(exc)}") from None

    @classmethod
    def from_toml(cls, path: str | Path, table: str = "tools") -> ToolsSpec:
        """From the ``[tools]`` table of a TOML settings file (the whole file when it has no such table).

        Raises:
            ToolError: unreadable, not TOML, or an invalid value (the message names the file and the key).
        """
        path = Path(path).expanduser()
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise ToolError(f"tool settings file {path}: {exc}") from None
        section = data.get(table, data)
        try:
            return cls.model_validate(section)
        except ValidationError as exc:
            raise ToolError(f"tool settings file {path} [{table}]: {_first_error(exc)}") from None


def parse_tools(text: str) -> list[str]:
    """``--tools`` value -> set names: comma-separated names, ``default`` (:data:`LIVE_DEFAULT`), ``none``.

    Raises:
        ToolError: an unknown name (the message lists the known ones).
    """
    names: list[str] = []
    for raw in text.split(","):
        name = raw.strip().lower()
        if not name or name == "none":
            continue
        expanded = list(LIVE_DEFAULT) if name == "default" else [name]
        for item in expanded:
            if item not in TOOL_SETS:
                raise ToolError(
                    f"--tools: unknown tool set {raw.strip()!r}; use a comma-separated list of "
                    f"{', '.join(TOOL_SETS)}, 'default' or 'none'"
                )
            if item not in names:
                names.append(item)
    return names


# --------------------------------------------------------------------------------------------- building


def builtin_tools(
    sets: Iterable[str],
    *,
    weather_url: str | None = None,
    geocoding_url: str | None = None,
    knowledge: KnowledgeBase | None = None,
) -> list[Tool]:
    """The tools of the shared built-in sets among ``sets`` (clock, calculator, weather, knowledge)."""
    from cspan.backends.tools.builtin import calculate_tool, get_time_tool
    from cspan.backends.tools.weather import WeatherClient

    chosen = set(sets)
    tools: list[Tool] = []
    if "clock" in chosen:
        tools.append(get_time_tool())
    if "calculator" in chosen:
        tools.append(calculate_tool())
    if "weather" in chosen:
        tools.append(WeatherClient(base_url=weather_url, geocoding_base_url=geocoding_url).tool())
    if "knowledge" in chosen and knowledge is not None and knowledge.folder is not None:
        tools.append(knowledge_tool(knowledge))
    return tools


def fdb_v3_bank(
    world_db: str | Path | None = None, *, max_chars: int = DEFAULT_MAX_CHARS, confirm_actions: bool = True
) -> ToolBank:
    """A bank with the 12 Full-Duplex-Bench v3 tools over a fresh mock world (fabricated data; see :mod:`.fdb_v3`).

    ``world_db``: SQLite file of the world (built at first use); None keeps it in memory.
    """
    from cspan.backends.tools.fdb_v3 import fdb_v3_tools
    from cspan.backends.tools.world import MockWorld

    world = MockWorld(world_db)
    bank = ToolBank(fdb_v3_tools(world), max_chars=max_chars, confirm_actions=confirm_actions)
    bank.add_closer(world.aclose)
    return bank


async def mount_mcp(
    command: list[str] | None = None,
    *,
    url: str | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    prefix: str = "",
    timeout_s: float = 10.0,
    connect_timeout_s: float = 20.0,
    max_chars: int = DEFAULT_MAX_CHARS,
    allow: Iterable[str] | None = None,
    read_only: Iterable[str] = (),
    reconnect: bool = True,
) -> ToolBank:
    """Mount the tools of an MCP server (official ``mcp`` SDK) and keep the session open until ``aclose``.

    Args:
        command: argv of a stdio server, e.g. ``["cspan", "tools", "serve"]``.
        url: streamable-HTTP endpoint instead, e.g. ``"http://127.0.0.1:8765/mcp"``.
        env: extra environment for the stdio subprocess.
        cwd: working directory of the stdio subprocess.
        prefix: prepended to every tool name (to avoid clashes when merging banks).
        timeout_s: per-call timeout of the mounted tools.
        connect_timeout_s: limit for spawning/connecting, the handshake and listing the tools.
        max_chars: cap on result text.
        allow: only these tools (the server's names); None mounts all.
        read_only: tools treated as reads whatever their annotations say.
        reconnect: replace a lost connection at the next call (False for a one-shot command:
            :class:`~cspan.backends.tools.mcp_bridge.MCPConnection`).

    Raises:
        ToolError: neither or both of ``command``/``url``, the ``mcp`` package missing, the server could not be
            started, reached or listed, or ``allow``/``read_only`` names a tool it does not have.
    """
    from cspan.backends.tools.mcp_bridge import MCPConnection

    conn = MCPConnection(
        command=command, url=url, env=env, cwd=cwd, connect_timeout_s=connect_timeout_s, reconnect=reconnect
    )
    await conn.start()
    bank = ToolBank(max_chars=max_chars)
    bank.add_closer(conn.aclose)
    bank.mcp.append(conn)
    try:
        for tool in conn.tools(prefix=prefix, timeout_s=timeout_s, allow=allow, read_only=read_only):
            bank.register(tool)
    except BaseException:
        await bank.aclose()
        raise
    return bank


async def build_bank(
    spec: ToolsSpec, *, knowledge: KnowledgeBase | None = None, reconnect_mcp: bool = True
) -> ToolBank:
    """The shared bank ``spec`` describes: its built-in sets (but the per-session ``memory``) and MCP servers.

    Args:
        spec: what to build.
        knowledge: an already built knowledge index to share (else one is made from ``spec.knowledge``).
        reconnect_mcp: an MCP server's lost connection is replaced at the next call (a server's bank); False for a
            one-shot command, which makes no next call.

    Raises:
        ToolError: an MCP server failed to start or list its tools, or two sources define one tool name (mount
            with ``prefix=``); everything opened so far is closed first.
        ValueError: the knowledge folder does not exist.
    """
    from cspan.backends.knowledge import KnowledgeBase

    if "knowledge" in spec.sets and knowledge is None and spec.knowledge is not None:
        knowledge = KnowledgeBase(spec.knowledge)
    bank = ToolBank(max_chars=spec.max_chars, confirm_actions=spec.confirm_actions)
    # the memory set is made per session (session_bank): its names are taken too, or every session would fail
    per_session = {tool.name for tool in memory_tools(None)} if "memory" in spec.sets else set()  # type: ignore[arg-type]
    try:
        for tool in builtin_tools(
            spec.sets, weather_url=spec.weather_url, geocoding_url=spec.geocoding_url, knowledge=knowledge
        ):
            bank.register(tool)
        if "fdb-v3" in spec.sets:
            bank.merge(fdb_v3_bank(spec.world_db, max_chars=spec.max_chars))
        for server in spec.mcp:
            mounted = await mount_mcp(
                server.command,
                url=server.url,
                env=server.env,
                cwd=server.cwd,
                prefix=server.prefix,
                timeout_s=server.timeout_s,
                max_chars=spec.max_chars,
                allow=server.allow,
                read_only=server.read_only,
                reconnect=reconnect_mcp,
            )
            clash = sorted((set(bank.names()) | per_session) & set(mounted.names()))
            if clash:
                await mounted.aclose()
                raise ToolError(
                    f"--mcp {server.where}: tool(s) {', '.join(clash)} are already mounted (a built-in set of --tools "
                    "or another --mcp); give this --mcp a prefix (prefix=NAME_), leave them out with allow=, or "
                    "leave that set out of --tools"
                )
            try:
                bank.merge(mounted)
            except ToolError as exc:
                await mounted.aclose()
                raise ToolError(f"--mcp {server.where}: {exc}") from None
    except BaseException:
        await bank.aclose()
        raise
    return bank


def session_bank(
    shared: ToolBank,
    *,
    memory: UserMemory | None = None,
    sets: Iterable[str] = LIVE_DEFAULT,
    extra: Iterable[Tool] = (),
) -> ToolBank:
    """One session's bank: ``shared`` plus the per-session sets among ``sets`` (``memory``, over this session
    principal's :class:`~cspan.backends.context_db.UserMemory`) plus ``extra`` (e.g. :func:`callback_tool`\\ s).

    Cheap; closing it leaves ``shared`` open. Raises :class:`ToolError` when an ``extra`` name is taken.
    """
    tools: list[Tool] = []
    if "memory" in set(sets) and memory is not None:
        tools.extend(memory_tools(memory))
    tools.extend(extra)
    return shared.derive(tools)


# --------------------------------------------------------------------------------------------- built-in tools


class _QueryArgs(ToolArgs):
    query: str = Field("", max_length=500, description="what to look for, in a few words")


class _RememberArgs(ToolArgs):
    key: str = Field(
        ...,
        min_length=1,
        max_length=MAX_FACT_KEY_CHARS,
        description="what the fact is about, e.g. name, city, favourite_food",
    )
    value: str = Field(..., min_length=1, max_length=MAX_FACT_VALUE_CHARS, description="the fact, as the user said it")


def knowledge_tool(knowledge: KnowledgeBase) -> Tool:
    """``search_notes(query)``: the best sentence of the notes folder for the query (read)."""

    async def search_notes(query: str = "") -> str:
        hit = await knowledge.search(query)
        return hit.text if hit is not None else ""

    return Tool(
        name="search_notes",
        description="Search the operator's local notes (opening hours, policies, facts about this place) for a "
        "sentence that answers the query.",
        parameters=_QueryArgs,
        fn=search_notes,
        kind="read",
        timeout_s=5.0,
    )


def memory_tools(memory: UserMemory) -> list[Tool]:
    """``recall_memory`` (read) and ``remember_fact`` (an action that needs no confirmation: it only writes the
    user's own memory, and can be undone) over one principal's memory. Nothing here can reach another user."""
    from cspan.backends.context_db import fact_sentence
    from cspan.backends.knowledge import content_words

    async def recall_memory(query: str = "") -> str:
        facts = await memory.afacts()
        profile = await memory.aget_profile()
        lines = [fact_sentence(f.key, f.value) for f in facts]
        if profile is not None and profile.notes:
            lines.append("the user's notes say: " + " ".join(profile.notes.split()))
        terms = content_words(query)
        if terms:
            matching = [line for line in lines if any(t in line.lower() for t in terms)]
            lines = matching or lines
        return "; ".join(lines)

    async def remember_fact(key: str, value: str) -> str:
        slug = "_".join(key.lower().split())
        await memory.aset_fact(slug, value, source="tool")
        return f"remembered: {fact_sentence(slug, value)}"

    return [
        Tool(
            name="recall_memory",
            description="What is remembered about this user (name, home city, preferences, notes); optionally only "
            "what matches the query.",
            parameters=_QueryArgs,
            fn=recall_memory,
            kind="read",
            timeout_s=5.0,
        ),
        Tool(
            name="remember_fact",
            description="Remember a fact the user asked to be remembered about themselves.",
            parameters=_RememberArgs,
            fn=remember_fact,
            kind="action",
            confirm=False,
            timeout_s=5.0,
        ),
    ]


def callback_tool(
    name: str,
    description: str,
    parameters: Mapping[str, Any] | None,
    callback: Callable[[dict[str, Any]], Awaitable[Any]],
    *,
    kind: ToolKind = "read",
    timeout_s: float = 10.0,
    confirm: bool | None = None,
) -> Tool:
    """A tool whose execution is the caller's coroutine (e.g. a Realtime client's function: send the call to the
    client, await its output).

    Args:
        name: tool name (``[A-Za-z0-9_-]{1,64}``).
        description: for the router prompt.
        parameters: JSON Schema of the arguments (an object schema; None for no arguments). Arguments are
            validated and coerced against it before ``callback`` runs.
        callback: ``async callback(arguments: dict) -> str | dict | list | ToolOutput``; it receives the validated
            arguments (keys as in the schema, unset optional ones left out).
        kind: ``"read"`` or ``"action"`` (an action is held back until the user confirms).
        timeout_s: seconds one call may take.
        confirm: see :attr:`Tool.confirm`.

    Raises:
        ToolError: a bad name, a schema that is not an object schema, or a callback that is not a coroutine function.
    """
    from cspan.backends.tools.schema import model_from_json_schema

    if not inspect.iscoroutinefunction(callback):
        raise ToolError(f"tool {name!r}: callback must be an async function taking the arguments dict", tool=name)
    if not math.isfinite(timeout_s):
        raise ToolError(f"tool {name!r}: timeout_s must be finite", tool=name)
    schema = dict(parameters or {"type": "object", "properties": {}})
    model = model_from_json_schema(name, schema)

    async def run(**kwargs: Any) -> Any:
        out = await callback({k: v for k, v in kwargs.items() if v is not None})
        return out if out is not None else ToolOutput("")

    return Tool(
        name=name,
        description=description,
        parameters=model,
        fn=run,
        kind=kind,
        timeout_s=timeout_s,
        schema=schema,
        confirm=confirm,
    )
