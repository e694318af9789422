"""Built-in tools: get_time through zoneinfo and calculate through the ast evaluator (never eval)."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime

import pytest

from cspan.backends.errors import ToolError
from cspan.backends.tools import ToolBank
from cspan.backends.tools.builtin import calculate_tool, evaluate_expression, get_time_tool, resolve_timezone

FIXED = datetime(2026, 6, 18, 13, 37, 5, tzinfo=UTC)


@pytest.fixture
def bank() -> ToolBank:
    return ToolBank([get_time_tool(lambda: FIXED), calculate_tool()])


@pytest.mark.parametrize(
    ("zone", "clause"),
    [
        ("Asia/Seoul", "It is Thursday, June 18, 2026 at 10:37 PM in Asia/Seoul right now."),
        ("seoul", "It is Thursday, June 18, 2026 at 10:37 PM in Asia/Seoul right now."),
        ("America/New_York", "It is Thursday, June 18, 2026 at 9:37 AM in America/New_York right now."),
        ("PST", "It is Thursday, June 18, 2026 at 6:37 AM in America/Los_Angeles right now."),
        ("UTC+5:30", "It is Thursday, June 18, 2026 at 7:07 PM in UTC+5:30 right now."),
        ("Pacific/Auckland", "It is Friday, June 19, 2026 at 1:37 AM in Pacific/Auckland right now."),
    ],
)
async def test_get_time_in_a_timezone(bank: ToolBank, zone: str, clause: str) -> None:
    result = await bank.call("get_time", {"timezone": zone})
    assert result.text == clause
    assert result.arguments == {"timezone": zone}


async def test_get_time_without_timezone_uses_server_local_time(bank: ToolBank) -> None:
    result = await bank.call("get_time", {})
    local = FIXED.astimezone()
    assert result.data["iso"] == local.isoformat()
    assert "(server local time)" in result.text and f"{local:%B} {local.day}, 2026" in result.text


@pytest.mark.parametrize("zone", ["Mars/Olympus", "Europe", "Etc", "x" * 300])
async def test_unknown_timezone_is_a_tool_error(bank: ToolBank, zone: str) -> None:
    """A folder of the zone database ("Europe") or a name too long for a file name is an unknown zone too, not an
    OSError naming where the zone files are installed."""
    with pytest.raises(ToolError, match=f"unknown timezone '{zone[:20]}") as info:
        await bank.call("get_time", {"timezone": zone})
    assert info.value.field == "timezone" and "zoneinfo" not in str(info.value)


def test_resolve_timezone_accepts_places_and_abbreviations() -> None:
    assert resolve_timezone("Tokyo")[1] == "Asia/Tokyo"
    assert resolve_timezone("new york")[1] == "America/New_York"
    assert resolve_timezone("Busan")[1] == "Asia/Seoul"
    assert resolve_timezone("KST")[1] == "Asia/Seoul"


@pytest.mark.parametrize(
    ("expression", "text"),
    [
        ("2 + 3 * 4", "2 + 3 * 4 = 14"),
        ("(12.5 * 4) / 3", "(12.5 * 4) / 3 = 16.66666667"),
        ("15 percent of 80", "15 percent of 80 = 12"),
        ("12 times 7", "12 times 7 = 84"),
        ("2 to the power of 10", "2 to the power of 10 = 1024"),
        ("square root of 81", "square root of 81 = 9"),
        ("1,250 + 40", "1,250 + 40 = 1290"),
        ("2^0.5", "2^0.5 = 1.414213562"),
        ("max(3, 9, 2) - min(4, 1)", "max(3, 9, 2) - min(4, 1) = 8"),
        ("7 // 2 + 7 % 2", "7 // 2 + 7 % 2 = 4"),
        ("round(pi, 3)", "round(pi, 3) = 3.142"),
        ("round(1234, -2)", "round(1234, -2) = 1200"),
        ("round(pi, 2.0)", "round(pi, 2.0) = 3.14"),
    ],
)
async def test_calculate(bank: ToolBank, expression: str, text: str) -> None:
    result = await bank.call("calculate", {"expression": expression})
    assert result.text == text


@pytest.mark.parametrize(
    ("expression", "match"),
    [
        ("__import__('os')", "not allowed"),
        ("__import__('os').system('true')", "not allowed"),
        ("().__class__.__bases__", "not allowed"),
        ("open('/etc/passwd')", "not allowed"),
        ("lambda: 1", "not allowed"),
        ("[1, 2, 3]", "not allowed"),
        ("log(8, base=2)", "not allowed"),
        ("9 ** 9 ** 9", "exponent .* is too large"),
        ("10 ** 1000", "more than 100 digits"),
        ("2 ** 100000", "exponent .* is too large"),
        ("factorial(1000)", "whole number from 0 to 100"),
        # int.__round__(-n) computes 10 ** n: round(5, -10**8) held the event loop for minutes before the bound
        ("round(5, -1000000)", "whole number of digits from -100 to 100"),
        ("round(5, 101)", "whole number of digits from -100 to 100"),
        ("round(1.5, 2.5)", "whole number of digits"),
        ("log(8, 1)", "log\\(\\) failed"),
        ("1 / 0", "division by zero"),
        ("sqrt(-1)", "math domain error"),
        ("1 +", "cannot parse"),
        ("1" * 201, "limit is 200"),
        ("", "empty"),
    ],
)
async def test_calculate_rejects_unsafe_or_huge_input(bank: ToolBank, expression: str, match: str) -> None:
    with pytest.raises(ToolError, match=match) as info:
        await bank.call("calculate", {"expression": expression})
    assert info.value.tool == "calculate" and info.value.field == "expression"


def test_evaluator_keeps_integers_exact() -> None:
    assert evaluate_expression("123456789 * 987654321") == 121932631112635269
    assert isinstance(evaluate_expression("6 / 3"), float)


def _tools(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cspan.core.cli", "tools", *args], capture_output=True, text=True, timeout=60
    )


def test_get_time_says_what_it_accepts() -> None:
    """The docs promised "any IANA timezone or city" and `get_time {"timezone": "Leeds"}` answered only `unknown
    timezone 'Leeds'`: a city works when an IANA name ends with it, which the schema says, and the refusal names
    what to give instead (no place is geocoded)."""
    done = _tools("call", "get_time", '{"timezone": "Leeds"}')
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr == (
        "cspan tools call: error: tool 'get_time': unknown timezone 'Leeds'; give an IANA name such as "
        "'Europe/London', the city it ends with ('London'), or a UTC offset ('UTC+1'): other places are not looked up\n"
    )
    for given in ("London", "Europe/London", "new york", "UTC+1"):
        done = _tools("call", "get_time", json.dumps({"timezone": given}))
        assert done.returncode == 0 and done.stdout.startswith("It is "), (given, done.stderr)

    listed = json.loads(_tools("list", "--json").stdout)
    (get_time,) = [t["function"] for t in listed if t["function"]["name"] == "get_time"]
    assert get_time["description"].startswith("Current date and time in an IANA time zone (or the city its name ")
    described = get_time["parameters"]["properties"]["timezone"]["description"]
    assert "IANA time zone such as 'Europe/London', or the city its name ends with ('London'" in described
    assert "(Leeds: 'Europe/London')" in described
