"""LocalRouter: clock and arithmetic through the real tool bank, notes through SQLite FTS5 over a real folder."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from banks import make_mixed_bank

from cspan.backends.context_db import ContextDB, Profile
from cspan.backends.router import LocalRouter, RouteRequest
from cspan.backends.router.local import content_words, read_knowledge_file, spoken_arithmetic, timezone_for_place
from cspan.backends.tools import ToolBank

LONDON_NOTE = """# London

Typical spring day in the capital.

London weather today: mild and cloudy, around 14 degrees Celsius, with light rain expected in the evening.
Take an umbrella if you go out after six.

- The Tower of London was founded in 1066.
"""

PARIS_NOTE = """Paris travel notes.

The Louvre is closed on Tuesdays. Museum tickets cost 22 euros.
"""


@pytest.fixture
def knowledge(tmp_path: Path) -> Path:
    folder = tmp_path / "knowledge"
    (folder / "cities").mkdir(parents=True)
    (folder / "cities" / "london.md").write_text(LONDON_NOTE)
    (folder / "paris.txt").write_text(PARIS_NOTE)
    (folder / "ignored.bin").write_bytes(b"\x00weather london today\x00")
    return folder


@pytest.fixture
async def bank() -> AsyncIterator[ToolBank]:
    tools = make_mixed_bank()
    yield tools
    await tools.aclose()


@pytest.mark.parametrize(
    "question", ["What is the weather like in London today?", "well the weather like in london today"]
)
async def test_london_weather_note_is_found(knowledge: Path, bank: ToolBank, question: str) -> None:
    router = LocalRouter(bank, None, knowledge)
    result = await router.route(RouteRequest(question=question))
    assert result.source == "local:knowledge"
    assert result.reference is not None
    assert result.reference.startswith("London weather today: mild and cloudy, around 14 degrees Celsius")
    assert len(result.reference) <= 300 and result.tool is None


async def test_nothing_matching_gives_none(knowledge: Path, bank: ToolBank) -> None:
    router = LocalRouter(bank, None, knowledge)
    for question in ("What is the capital of Mongolia?", "um well", "", "tell me about the weather in Oslo"):
        result = await router.route(RouteRequest(question=question))
        assert result.reference is None and result.source == "none", question


async def test_short_sentence_takes_its_neighbour(knowledge: Path) -> None:
    router = LocalRouter(None, None, knowledge)
    result = await router.route(RouteRequest(question="when is the louvre closed"))
    assert result.reference == "The Louvre is closed on Tuesdays. Museum tickets cost 22 euros."
    tower = await router.route(RouteRequest(question="when was the tower of london founded"))
    assert tower.reference == "The Tower of London was founded in 1066."


@pytest.mark.parametrize(
    ("zone", "said"),
    [
        ("UTC", "in UTC (server local time)"),
        ("Europe/Berlin", "in CE"),  # CET or CEST
        ("Asia/Riyadh", "in UTC+3 (server local time)"),  # the zone database names it "+03"
        ("America/Sao_Paulo", "in UTC-3 (server local time)"),
        ("Asia/Kathmandu", "in UTC+5:45 (server local time)"),
    ],
)
async def test_clock_without_a_profile_says_which_time_it_gives(bank: ToolBank, monkeypatch, zone: str, said: str):
    """With no profile (a library user's LocalRouter, a session without a timezone) a time question is answered in
    the server's local time, and the answer says which: its zone's abbreviation, or its offset from UTC where the
    zone database has no abbreviation (it said "in +03 (server local time)": read aloud, no zone at all). There is no
    server-wide default timezone to use instead: a session's profile gives the user's."""
    import time

    if not hasattr(time, "tzset"):
        pytest.skip("time.tzset is POSIX only")
    monkeypatch.setenv("TZ", zone)
    time.tzset()
    try:
        result = await LocalRouter(bank).route(RouteRequest(question="what time is it"))
    finally:
        monkeypatch.undo()
        time.tzset()
    assert result.tool == "get_time" and result.arguments == {"timezone": ""}
    assert result.reference is not None and said in result.reference, result.reference
    assert result.reference.endswith("(server local time) right now.")


async def test_clock_uses_the_named_place_or_the_profile(bank: ToolBank) -> None:
    router = LocalRouter(bank)
    tokyo = await router.route(RouteRequest(question="What time is it in Tokyo right now?"))
    assert tokyo.tool == "get_time" and tokyo.arguments == {"timezone": "Asia/Tokyo"}
    assert tokyo.source == "tool:get_time" and tokyo.reference and tokyo.reference.startswith("(tool result) ")
    direct = await bank.call("get_time", {"timezone": "Asia/Tokyo"})
    assert "Asia/Tokyo" in direct.text or "Tokyo" in tokyo.reference

    profile = Profile(timezone="Europe/London")
    home = await router.route(RouteRequest(question="what's the time", profile=profile))
    assert home.arguments == {"timezone": "Europe/London"}
    sf = await router.route(RouteRequest(question="what time is it in san francisco", profile=profile))
    assert sf.arguments == {"timezone": "America/Los_Angeles"}
    unknown = await router.route(RouteRequest(question="what time is it in Narnia", profile=profile))
    assert unknown.reference is None and "Narnia" in (unknown.error or "")


@pytest.mark.parametrize(
    ("question", "expression", "value"),
    [
        ("what is two plus three", "2 + 3", "5"),
        ("What's 15 percent of 80?", "15 / 100 * 80", "12"),
        ("how much is twelve times seven", "12 * 7", "84"),
        ("what is one hundred and five divided by five", "105 / 5", "21"),
    ],
)
async def test_spoken_arithmetic_goes_to_calculate(bank: ToolBank, question: str, expression: str, value: str) -> None:
    result = await LocalRouter(bank).route(RouteRequest(question=question))
    assert result.tool == "calculate" and result.arguments == {"expression": expression}
    assert result.reference is not None and result.reference.startswith("(tool result) ")
    assert value in result.reference


async def test_profile_notes_and_db_facts(tmp_path: Path, bank: ToolBank) -> None:
    db = ContextDB(tmp_path / "ctx.sqlite")
    priya = db.user("priya")
    cid = priya.start_conversation()
    priya.add_turn(cid, "user", "Hello, my name is Priya and I live in Sydney.")
    router = LocalRouter(bank, priya)
    profile = Profile(notes="My dentist appointment is on Friday at 3 pm. I prefer window seats.")
    name = await router.route(RouteRequest(question="what's my name", profile=profile))
    assert name.reference == "The user's name is Priya." and name.source == "local:facts"
    dentist = await router.route(RouteRequest(question="when is my dentist appointment", profile=profile))
    assert dentist.reference == "My dentist appointment is on Friday at 3 pm." and dentist.source == "local:notes"
    # the stored profile is used when the request has none
    priya.put_profile(Profile(notes="The wifi password is tulip42."))
    wifi = await router.route(RouteRequest(question="what is the wifi password"))
    assert wifi.reference == "The wifi password is tulip42."
    # another user's session router (sharing the index) finds none of it, whatever the request claims
    bob_router = router.with_bank(bank, memory=db.user("bob"))
    assert bob_router.knowledge is router.knowledge
    for question in ("what's my name", "what is the wifi password"):
        claimed = Profile(user_id="priya")  # a client's message cannot pick the user
        assert (await bob_router.route(RouteRequest(question=question, profile=claimed))).reference is None
    db.close()


def test_helpers(knowledge: Path) -> None:
    assert content_words("Well, what's the weather like in London today?") == ["weather", "london", "today"]
    assert spoken_arithmetic("I have two kids") is None
    assert spoken_arithmetic("square root of sixteen") == "(16) ** 0.5"
    assert spoken_arithmetic("twenty-five point five minus 0.5") == "25.5 - 0.5"
    assert timezone_for_place("New York") == "America/New_York" and timezone_for_place("Gondor") is None
    paragraphs = read_knowledge_file(knowledge / "cities" / "london.md")
    assert paragraphs[0] == ("london London", ["Typical spring day in the capital."])
    assert paragraphs[-1] == ("london London", ["The Tower of London was founded in 1066."])


async def test_a_file_name_that_is_not_utf8_is_indexed(tmp_path: Path) -> None:
    # a Latin-1 name from an old archive: Python reads its byte 0xE9 as the lone surrogate U+DCE9, which SQLite
    # cannot store; every search of the folder failed with UnicodeEncodeError
    folder = tmp_path / "knowledge"
    folder.mkdir()
    (folder / "lib.md").write_text("The library opens at ten on Sunday.\n")
    try:
        (folder / "caf\udce9.md").write_text("# Hours\n\nThe cafe opens at nine every morning.\n")
    except (UnicodeEncodeError, OSError):
        pytest.skip("this file system takes only UTF-8 names")
    assert read_knowledge_file(folder / "caf\udce9.md") == [
        ("caf\ufffd Hours", ["The cafe opens at nine every morning."])
    ]
    router = LocalRouter(None, None, folder)
    cafe = await router.route(RouteRequest(question="when does the cafe open"))
    assert cafe.reference == "The cafe opens at nine every morning." and cafe.source == "local:knowledge"
    library = await router.route(RouteRequest(question="when does the library open"))
    assert library.reference == "The library opens at ten on Sunday."


def test_knowledge_dir_must_exist(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="knowledge folder"):
        LocalRouter(None, None, tmp_path / "missing")
