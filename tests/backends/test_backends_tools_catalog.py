"""The tool catalog: sets by name, --mcp specs (real MCP subprocesses), session banks, callback tools."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest

from cspan.backends.context_db import ContextDB
from cspan.backends.errors import ToolError
from cspan.backends.tools import ToolBank
from cspan.backends.tools.catalog import (
    LIVE_DEFAULT,
    MCPServerSpec,
    ToolsSpec,
    build_bank,
    callback_tool,
    parse_mcp,
    session_bank,
)

HERE = Path(__file__).resolve().parent
FDB_TOOLS = {"book_flight", "search_flights", "get_exchange_rate", "track_order"}


def test_spec_parsing() -> None:
    assert ToolsSpec.from_flags(None).sets == list(LIVE_DEFAULT) and "fdb-v3" not in LIVE_DEFAULT
    assert ToolsSpec.from_flags("clock, calculator,clock").sets == ["clock", "calculator"]
    assert ToolsSpec.from_flags("default,fdb-v3").sets == [*LIVE_DEFAULT, "fdb-v3"]
    assert ToolsSpec.from_flags("none").sets == []
    with pytest.raises(ToolError, match=r"unknown tool set 'shopping'.*clock"):
        ToolsSpec.from_flags("clock,shopping")

    spec = parse_mcp("allow=read_file,list read=list prefix=fs_ timeout=5 -- npx -y server@1 --flag 'a b'")
    assert spec == MCPServerSpec(
        command=["npx", "-y", "server@1", "--flag", "a b"],
        allow=["read_file", "list"],
        read=["list"],
        prefix="fs_",
        timeout=5.0,
    )
    assert parse_mcp("https://mcp.example.org/mcp").url == "https://mcp.example.org/mcp"
    assert parse_mcp("allow=search http://127.0.0.1:8765/mcp").allow == ["search"]
    # words with "=" that are no option name belong to the command (a path, the server's own arguments)
    assert parse_mcp("./a=b/server --k=v -- x=1").command == ["./a=b/server", "--k=v", "--", "x=1"]
    for bad, message in [
        ("", "give a stdio command"),
        ("allow=a", "give a stdio command"),
        ("timeout=inf python x.py", "finite"),
        ("timeout=soon python x.py", "not a number"),
        ("'unclosed", "quote"),
        ("alow=search -- python x.py", "unknown option 'alow'; the options are allow, read, prefix, timeout"),
        ("allow=a tmeout=5 python x.py", "unknown option 'tmeout'"),  # was run as the program 'tmeout=5'
        # an empty allow list mounted none of the server's tools, and `cspan tools list` printed nothing (status 0)
        (
            "allow= python x.py",
            r"^--mcp 'allow= python x.py': allow: an empty list mounts no tool: name the tools \(allow=a,b\)",
        ),
        ("allow=, -- python x.py", "an empty list mounts no tool"),
        # a URL without a host was taken and failed at the first connection with httpx's "missing an 'http://' or
        # 'https://' protocol" (exit 1); now refused as --router's and --asr's are; the password is never echoed
        ("http://", "'http://' is not an http\\(s\\) URL with a host name"),
        ("https://:443/mcp", "with a host name"),
        ("https://bob:pw@:1/mcp", r"^--mcp 'https://bob:\*\*\*@:1/mcp': 'https://bob:\*\*\*@:1/mcp' is not"),
        ("timeout=x https://bob:pw@mcp.example.org/mcp", r"^--mcp 'timeout=x https://bob:\*\*\*@mcp"),
        ("http://mcp.example.org:99999/mcp", "not a valid URL"),
    ]:
        with pytest.raises(ToolError, match=message):
            parse_mcp(bad)


def test_settings_file_form(tmp_path: Path) -> None:
    path = tmp_path / "cspan.toml"
    path.write_text(
        """
[tools]
sets = ["clock", "memory"]
knowledge = "notes"

[[tools.mcp]]
command = ["python", "server.py"]
allow = ["add"]

[[tools.mcp]]
url = "http://127.0.0.1:8765/mcp"
"""
    )
    spec = ToolsSpec.from_toml(path)
    assert spec.sets == ["clock", "memory"] and spec.knowledge == Path("notes")
    assert spec.mcp[0].command == ["python", "server.py"] and spec.mcp[0].allow == ["add"]
    assert spec.mcp[1].url == "http://127.0.0.1:8765/mcp"
    path.write_text('[tools]\nsets = ["clock"]\nbogus = 1\n')
    with pytest.raises(ToolError, match=r"\[tools\]: bogus"):
        ToolsSpec.from_toml(path)


async def test_live_default_has_no_mock_world(tmp_path: Path) -> None:
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "library.md").write_text("The library opens at nine on Sundays.\n")
    bank = await build_bank(ToolsSpec(knowledge=tmp_path / "notes"))
    try:
        assert set(bank.names()) == {"get_time", "calculate", "get_weather", "search_notes"}
        assert not FDB_TOOLS & set(bank.names()) and bank.confirm_actions
        found = await bank.call("search_notes", {"query": "when does the library open on sunday"})
        assert found.text == "The library opens at nine on Sundays."
    finally:
        await bank.aclose()
    world = await build_bank(ToolsSpec.from_flags("fdb-v3"))
    try:
        assert set(world.names()) >= FDB_TOOLS and world.get("book_flight").needs_confirmation
    finally:
        await world.aclose()


async def test_mcp_allow_list_and_annotations() -> None:
    demo = shlex.join([sys.executable, str(HERE / "mcp_demo_server.py")])
    spec = ToolsSpec.from_flags("clock", [f"allow=add,shout read=add prefix=demo_ -- {demo}"])
    bank = await build_bank(spec)
    try:
        assert bank.names() == ["get_time", "demo_add", "demo_shout"]  # refuse was not allowed
        assert bank.get("demo_add").kind == "read"  # vouched for with read=
        assert bank.get("demo_shout").kind == "action"  # no readOnlyHint: may change state (MCP's default)
        assert (await bank.call("demo_add", {"a": 2, "b": 3})).text == "5"
    finally:
        await bank.aclose()
    with pytest.raises(ToolError, match=r"has no tool\(s\) \['nope'\]; it lists: add, shout, refuse, crash"):
        await build_bank(ToolsSpec.from_flags("none", [f"allow=nope -- {demo}"]))
    # a name already mounted: the fix is said in --mcp's own words
    with pytest.raises(ToolError, match=r"tool\(s\) add are already mounted .* prefix \(prefix=NAME_\)"):
        await build_bank(ToolsSpec.from_flags("none", [f"allow=add -- {demo}", f"allow=add,shout -- {demo}"]))


def test_cspan_tools_default_is_what_it_can_serve() -> None:
    """``cspan tools list --tools default``: the live default but ``memory`` (one signed-in user's); naming
    ``memory`` itself is refused."""
    import subprocess

    def tools(*args: str) -> subprocess.CompletedProcess[str]:
        cli = [sys.executable, "-m", "cspan.core.cli", "tools", "list", *args]
        return subprocess.run(cli, capture_output=True, text=True, timeout=120)

    listed = tools("--tools", "default,fdb-v3")
    assert listed.returncode == 0, listed.stderr
    names = {line.split("(")[0] for line in listed.stdout.splitlines()}
    assert {"get_time", "calculate", "get_weather", "book_flight"} <= names and "recall_memory" not in names
    refused = tools("--tools", "clock,memory")
    assert refused.returncode == 2 and "cspan tools cannot serve them" in refused.stderr


async def test_session_banks_keep_each_users_memory_apart() -> None:
    db = ContextDB(":memory:")
    shared = await build_bank(ToolsSpec.from_flags("clock,calculator"))
    ada_bank = session_bank(shared, memory=db.user("ada"))
    bob_bank = session_bank(shared, memory=db.user("bob"))
    try:
        assert {"recall_memory", "remember_fact", "get_time"} <= set(ada_bank.names())
        assert "recall_memory" not in shared.names()
        saved = await ada_bank.call("remember_fact", {"key": "favourite food", "value": "ramen"})
        assert saved.text == "remembered: the user's favourite food is ramen"
        assert "ramen" in (await ada_bank.call("recall_memory", {"query": "food"})).text
        assert (await bob_bank.call("recall_memory", {})).text == "(no information found)"
        assert not ada_bank.get("remember_fact").needs_confirmation  # the user's own memory: no confirmation
        await ada_bank.aclose()  # closes nothing shared
        assert (await shared.call("calculate", {"expression": "2+2"})).text == "2+2 = 4"
    finally:
        await shared.aclose()


async def test_callback_tool_runs_the_callers_coroutine() -> None:
    seen: list[dict] = []

    async def client_function(arguments: dict) -> dict:
        seen.append(arguments)
        return {"status": "lights on", "room": arguments["room"]}

    schema = {
        "type": "object",
        "properties": {"room": {"type": "string"}, "level": {"type": "integer", "minimum": 0, "maximum": 100}},
        "required": ["room"],
    }
    tool = callback_tool("set_lights", "Turn the lights on in a room.", schema, client_function, kind="action")
    bank = ToolBank().derive([tool])
    result = await bank.call("set_lights", {"room": "kitchen", "level": "40"})
    assert seen == [{"room": "kitchen", "level": 40}] and result.text == "status lights on, room kitchen"
    assert bank.openai_tools()[0]["function"]["parameters"]["required"] == ["room"]
    assert tool.needs_confirmation
    with pytest.raises(ToolError, match="level"):
        await bank.call("set_lights", {"room": "kitchen", "level": 400})
    with pytest.raises(ToolError, match="async function"):
        callback_tool("x", "d", None, lambda a: a)  # type: ignore[arg-type]
