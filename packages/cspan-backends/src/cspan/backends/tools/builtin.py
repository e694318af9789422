"""Built-in tools: ``get_time`` (IANA time zones through :mod:`zoneinfo`) and ``calculate`` (safe arithmetic).

``calculate`` never calls :func:`eval`: the expression is parsed with :mod:`ast` and only numeric literals, the
operators ``+ - * / // % **``, unary signs, the constants ``pi``/``e``/``tau`` and a short list of :mod:`math`
functions are evaluated, with limits on length, nesting, exponent size, integer size and ``round``'s digits. Spoken
forms ("12 times 7", "15 percent of 80", "2 to the power of 10", "square root of 81") are rewritten to operators first.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from collections.abc import Callable
from datetime import datetime, timedelta, tzinfo
from functools import lru_cache
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError, available_timezones

from pydantic import Field

from cspan.backends.errors import ToolError
from cspan.backends.tools.bank import Tool, ToolArgs, ToolOutput

__all__ = [
    "MAX_EXPRESSION_CHARS",
    "calculate_tool",
    "evaluate_expression",
    "format_number",
    "get_time_tool",
    "resolve_timezone",
    "utc_label",
]

MAX_EXPRESSION_CHARS = 200
_MAX_DEPTH = 40
_MAX_INT_DIGITS = 100
_MAX_POW_DIGITS = 100

# --------------------------------------------------------------------------------------------------- get_time

_TZ_ABBREVIATIONS = {
    "utc": "UTC", "gmt": "Etc/GMT", "z": "UTC", "zulu": "UTC",
    "est": "America/New_York", "edt": "America/New_York", "et": "America/New_York", "eastern": "America/New_York",
    "cst": "America/Chicago", "cdt": "America/Chicago", "ct": "America/Chicago", "central": "America/Chicago",
    "mst": "America/Denver", "mdt": "America/Denver", "mt": "America/Denver", "mountain": "America/Denver",
    "pst": "America/Los_Angeles", "pdt": "America/Los_Angeles", "pt": "America/Los_Angeles",
    "pacific": "America/Los_Angeles", "akst": "America/Anchorage", "hst": "Pacific/Honolulu",
    "bst": "Europe/London", "cet": "Europe/Paris", "cest": "Europe/Paris", "eet": "Europe/Athens",
    "ist": "Asia/Kolkata", "kst": "Asia/Seoul", "jst": "Asia/Tokyo", "sgt": "Asia/Singapore",
    "hkt": "Asia/Hong_Kong", "aest": "Australia/Sydney", "aedt": "Australia/Sydney", "nzst": "Pacific/Auckland",
    # places whose zone is not named after them
    "san francisco": "America/Los_Angeles", "seattle": "America/Los_Angeles", "las vegas": "America/Los_Angeles",
    "portland": "America/Los_Angeles", "san diego": "America/Los_Angeles", "boston": "America/New_York",
    "washington": "America/New_York", "miami": "America/New_York", "atlanta": "America/New_York",
    "philadelphia": "America/New_York", "dallas": "America/Chicago", "houston": "America/Chicago",
    "austin": "America/Chicago", "nashville": "America/Chicago", "minneapolis": "America/Chicago",
    "beijing": "Asia/Shanghai", "china": "Asia/Shanghai", "india": "Asia/Kolkata", "delhi": "Asia/Kolkata",
    "mumbai": "Asia/Kolkata", "busan": "Asia/Seoul", "korea": "Asia/Seoul", "south korea": "Asia/Seoul",
    "japan": "Asia/Tokyo", "osaka": "Asia/Tokyo", "kyoto": "Asia/Tokyo", "uk": "Europe/London",
    "england": "Europe/London", "france": "Europe/Paris", "germany": "Europe/Berlin", "spain": "Europe/Madrid",
    "italy": "Europe/Rome", "barcelona": "Europe/Madrid", "munich": "Europe/Berlin", "frankfurt": "Europe/Berlin",
    "milan": "Europe/Rome", "geneva": "Europe/Zurich", "hawaii": "Pacific/Honolulu", "honolulu": "Pacific/Honolulu",
    "australia": "Australia/Sydney", "melbourne": "Australia/Melbourne", "new zealand": "Pacific/Auckland",
    "brazil": "America/Sao_Paulo", "rio de janeiro": "America/Sao_Paulo", "mexico": "America/Mexico_City",
    "dubai": "Asia/Dubai", "uae": "Asia/Dubai", "hanoi": "Asia/Bangkok", "thailand": "Asia/Bangkok",
    "vietnam": "Asia/Ho_Chi_Minh", "new york city": "America/New_York", "nyc": "America/New_York",
    "la": "America/Los_Angeles", "sf": "America/Los_Angeles",
}  # fmt: skip


@lru_cache(maxsize=1)
def _zone_index() -> dict[str, str]:
    """Lower-cased zone names and their last components ("seoul" -> "Asia/Seoul")."""
    index: dict[str, str] = {}
    for name in sorted(available_timezones()):
        if name.startswith(("Etc/", "SystemV/", "posix/", "right/")) or name in ("localtime", "Factory"):
            continue
        index.setdefault(name.lower(), name)
        index.setdefault(name.rsplit("/", 1)[-1].replace("_", " ").lower(), name)
    return index


def utc_label(offset: timedelta) -> str:
    """A UTC offset as spoken: ``"UTC+9"``, ``"UTC-3"``, ``"UTC+5:45"`` (whole minutes; ``"UTC+0"`` for none)."""
    minutes = round(offset.total_seconds() / 60)
    sign = "-" if minutes < 0 else "+"
    hours, minutes = divmod(abs(minutes), 60)
    return f"UTC{sign}{hours}" + (f":{minutes:02d}" if minutes else "")


def resolve_timezone(text: str) -> tuple[tzinfo, str]:
    """Resolve an IANA zone ("Asia/Seoul"), a zone's city ("Seoul", "new york": the last part of an IANA name), a
    common abbreviation or one of a few well-known places whose zone is named otherwise ("PST", "San Francisco",
    "Japan": :data:`_TZ_ABBREVIATIONS`) or a UTC offset ("UTC+9", "GMT-05:30") to a ``tzinfo`` and the name to speak.
    Nothing else: no geocoding ("Leeds" is refused; its zone is "Europe/London").

    Raises:
        ToolError: nothing matches (``field`` is ``"timezone"``).
    """
    raw = " ".join(str(text).split())
    try:
        return ZoneInfo(raw), raw
    except (ZoneInfoNotFoundError, ValueError, OSError):  # OSError: a folder ("Europe"), a name too long for a file
        pass
    key = raw.lower().replace("_", " ").strip(" .")
    key = re.sub(r"^(the )?(time )?(in |at )?", "", key)
    key = re.sub(r" (time|timezone|time zone|standard time|daylight time)$", "", key).strip()
    if m := re.fullmatch(r"(?:utc|gmt)\s*([+-])\s*(\d{1,2})(?::?(\d{2}))?", key):
        from datetime import timezone

        hours, minutes = int(m.group(2)), int(m.group(3) or 0)
        if hours > 14 or minutes >= 60:
            raise ToolError(f"timezone offset {raw!r} is out of range", field="timezone")
        sign = 1 if m.group(1) == "+" else -1
        offset = sign * timedelta(hours=hours, minutes=minutes)
        label = utc_label(offset)
        return timezone(offset, label), label
    name = _TZ_ABBREVIATIONS.get(key) or _zone_index().get(key)
    if name is None and "," in key:
        first = key.split(",")[0].strip()
        name = _TZ_ABBREVIATIONS.get(first) or _zone_index().get(first)
    if name is None:
        raise ToolError(
            f"unknown timezone {raw!r}; give an IANA name such as 'Europe/London', the city it ends with ('London'), "
            "or a UTC offset ('UTC+1'): other places are not looked up",
            field="timezone",
        )
    return ZoneInfo(name), name


class GetTimeArgs(ToolArgs):
    timezone: str = Field(
        default="",
        description="An IANA time zone such as 'Europe/London', or the city its name ends with ('London', 'New "
        "York'), a UTC offset ('UTC+9') or an abbreviation ('PST'); for any other place give its zone's IANA name "
        "(Leeds: 'Europe/London'). Empty means the server's local time.",
    )


def _speak_time(moment: datetime, zone_name: str) -> str:
    hour = moment.hour % 12 or 12
    ampm = "AM" if moment.hour < 12 else "PM"
    return f"It is {moment:%A}, {moment:%B} {moment.day}, {moment.year} at {hour}:{moment:%M} {ampm} in {zone_name} right now."


def get_time_tool(now: Callable[[], datetime] | None = None) -> Tool:
    """The ``get_time(timezone="")`` tool.

    Args:
        now: clock returning an aware ``datetime`` (default: the system clock in UTC); tests pass a fixed one.

    Result clause, as in the original time server: ``"It is Thursday, June 18, 2026 at 10:37 PM in Asia/Seoul
    right now."``
    """
    from datetime import UTC

    clock = now or (lambda: datetime.now(UTC))

    async def get_time(timezone: str = "") -> ToolOutput:
        instant = clock()
        if instant.tzinfo is None:
            raise ToolError("get_time clock returned a naive datetime; it must be timezone-aware")
        if not timezone.strip():
            local = instant.astimezone()
            name = local.tzname() or ""
            offset = local.utcoffset()
            if offset is not None and (not name or name[0] in "+-"):  # the zone database's "+03": said as UTC+3
                name = utc_label(offset)
            return ToolOutput(_speak_time(local, f"{name} (server local time)"), {"iso": local.isoformat()})
        zone, name = resolve_timezone(timezone)
        moment = instant.astimezone(zone)
        return ToolOutput(_speak_time(moment, name), {"iso": moment.isoformat(), "timezone": name})

    return Tool(
        name="get_time",
        description=(
            "Current date and time in an IANA time zone (or the city its name ends with). Only for the current "
            "time; never guess it. Typical: 'what time is it in Tokyo' -> get_time(timezone='Asia/Tokyo')."
        ),
        parameters=GetTimeArgs,
        fn=get_time,
        kind="read",
        timeout_s=5.0,
        domain="utility",
    )


# --------------------------------------------------------------------------------------------------- calculate

_BIN_OPS: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY_OPS: dict[type[ast.unaryop], Callable[[float], float]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_CONSTANTS = {"pi": math.pi, "e": math.e, "tau": math.tau}
_FUNCTIONS: dict[str, tuple[Callable[..., float], int, int]] = {  # name -> (function, min args, max args)
    "sqrt": (math.sqrt, 1, 1),
    "abs": (abs, 1, 1),
    "round": (round, 1, 2),
    "floor": (math.floor, 1, 1),
    "ceil": (math.ceil, 1, 1),
    "exp": (math.exp, 1, 1),
    "ln": (math.log, 1, 1),
    "log": (math.log, 1, 2),
    "log10": (math.log10, 1, 1),
    "log2": (math.log2, 1, 1),
    "sin": (math.sin, 1, 1),
    "cos": (math.cos, 1, 1),
    "tan": (math.tan, 1, 1),
    "asin": (math.asin, 1, 1),
    "acos": (math.acos, 1, 1),
    "atan": (math.atan, 1, 1),
    "degrees": (math.degrees, 1, 1),
    "radians": (math.radians, 1, 1),
    "min": (min, 1, 10),
    "max": (max, 1, 10),
    "factorial": (math.factorial, 1, 1),
}

_WORDS = [
    (r"\bwhat(?:'s| is)\b", " "),
    (r"\b(?:raised )?to the power of\b|\braised to\b", "**"),
    (r"\bcalculate\b|\bcompute\b|\bequals?\b|\bthe\b|\?", " "),
    (r"\bsquare root of\s*(\d+(?:\.\d+)?|\([^()]*\))", r" sqrt(\1) "),
    (r"\bcube root of\s*(\d+(?:\.\d+)?|\([^()]*\))", r" (\1)**(1/3) "),
    (r"(\d+(?:\.\d+)?)\s*(?:%|percent)\s+of\b", r"(\1/100)*"),
    (r"(\d+(?:\.\d+)?)\s*percent\b", r"(\1/100)"),
    (r"(\d+(?:\.\d+)?)\s*%(?!\s*[\d(.])", r"(\1/100)"),  # "7 % 2" stays a modulo
    (r"\bsquared\b", "**2"),
    (r"\bcubed\b", "**3"),
    (r"\bmultiplied by\b|\btimes\b|×|(?<=[\d)\s])x(?=[\s\d(])", "*"),
    (r"\bdivided by\b|\bover\b|÷", "/"),
    (r"\bplus\b|\band\b", "+"),
    (r"\bminus\b|−", "-"),
    (r"\bmod(?:ulo)?\b", "%"),
    (r"\^", "**"),
]


def _rewrite_spoken(expression: str) -> str:
    text = expression.strip().lower()
    text = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", text)  # 1,234 -> 1234
    text = text.replace("$", "")
    for pattern, repl in _WORDS:
        text = re.sub(pattern, repl, text)
    return text.strip()


def _check_int(value: float, expression: str) -> float:
    if isinstance(value, int) and abs(value).bit_length() > _MAX_INT_DIGITS * 3.33:
        raise ToolError(f"the result of {expression!r} has more than {_MAX_INT_DIGITS} digits", field="expression")
    if isinstance(value, float) and math.isnan(value):
        raise ToolError(f"{expression!r} is not a number (NaN)", field="expression")
    return value


def _safe_pow(base: float, exp: float, expression: str) -> float:
    if base == 0 and exp < 0:
        raise ToolError(f"division by zero in {expression!r}", field="expression")
    if abs(exp) > 10_000:
        raise ToolError(f"exponent {exp:g} is too large in {expression!r}", field="expression")
    if abs(base) > 1 and abs(exp) * math.log10(abs(base)) > _MAX_POW_DIGITS:
        raise ToolError(f"{base:g} ** {exp:g} would have more than {_MAX_POW_DIGITS} digits", field="expression")
    result = operator.pow(base, exp)
    if isinstance(result, complex):
        raise ToolError(f"{expression!r} has no real result", field="expression")
    return result


def evaluate_expression(expression: str) -> float:
    """Evaluate an arithmetic expression safely (no ``eval``; see the module docstring for what is allowed).

    Returns:
        an ``int`` when the result is integral and came from integer arithmetic, else a ``float``.

    Raises:
        ToolError: empty or too long input, a syntax error, any name, attribute, call or construct outside the
            allowed set, division by zero, an exponent or result that is too large, or a math domain error.
    """
    if not isinstance(expression, str) or not expression.strip():
        raise ToolError("the expression is empty", field="expression")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(
            f"the expression has {len(expression)} characters, the limit is {MAX_EXPRESSION_CHARS}",
            field="expression",
        )
    text = _rewrite_spoken(expression)
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ToolError(f"cannot parse {expression!r} as arithmetic", field="expression") from None

    def ev(node: ast.AST, depth: int) -> float:
        if depth > _MAX_DEPTH:
            raise ToolError(f"{expression!r} is nested too deeply", field="expression")
        if isinstance(node, ast.Expression):
            return ev(node.body, depth + 1)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return _check_int(node.value, expression)
        if isinstance(node, ast.BinOp) and type(node.op) in _BIN_OPS:
            left, right = ev(node.left, depth + 1), ev(node.right, depth + 1)
            if isinstance(node.op, ast.Pow):
                return _check_int(_safe_pow(left, right, expression), expression)
            if isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod) and right == 0:
                raise ToolError(f"division by zero in {expression!r}", field="expression")
            if (
                isinstance(node.op, ast.Mult)
                and isinstance(left, int)
                and isinstance(right, int)
                and left.bit_length() + right.bit_length() > _MAX_INT_DIGITS * 3.33 + 2
            ):
                raise ToolError(
                    f"the result of {expression!r} has more than {_MAX_INT_DIGITS} digits", field="expression"
                )
            return _check_int(_BIN_OPS[type(node.op)](left, right), expression)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY_OPS:
            return _UNARY_OPS[type(node.op)](ev(node.operand, depth + 1))
        if isinstance(node, ast.Name) and node.id in _CONSTANTS:
            return _CONSTANTS[node.id]
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in _FUNCTIONS
            and not node.keywords
        ):
            fn, lo, hi = _FUNCTIONS[node.func.id]
            if not lo <= len(node.args) <= hi:
                raise ToolError(
                    f"{node.func.id}() takes {lo}" + (f" to {hi}" if hi != lo else "") + " arguments",
                    field="expression",
                )
            args = [ev(a, depth + 1) for a in node.args]
            if node.func.id == "factorial" and (not float(args[0]).is_integer() or not 0 <= args[0] <= 100):
                raise ToolError("factorial() takes a whole number from 0 to 100", field="expression")
            if node.func.id == "factorial":
                args = [int(args[0])]
            if node.func.id == "round" and len(args) == 2:
                # int.__round__ with ndigits = -n computes 10 ** n: round(5, -10**8) would hold the event loop for
                # minutes and take gigabytes; a float ndigits is a TypeError
                if not float(args[1]).is_integer() or not -_MAX_INT_DIGITS <= args[1] <= _MAX_INT_DIGITS:
                    raise ToolError(
                        f"round() takes a whole number of digits from -{_MAX_INT_DIGITS} to {_MAX_INT_DIGITS}",
                        field="expression",
                    )
                args[1] = int(args[1])
            if node.func.id == "exp" and args[0] > 230:
                raise ToolError(f"exp({args[0]:g}) is too large", field="expression")
            try:
                return _check_int(fn(*args), expression)
            except (ValueError, OverflowError, ZeroDivisionError) as exc:
                raise ToolError(f"{node.func.id}() failed on {expression!r}: {exc}", field="expression") from None
        what = ast.unparse(node) if hasattr(ast, "unparse") else type(node).__name__
        if len(what) > 40:
            what = what[:37] + "..."
        raise ToolError(
            f"{what!r} is not allowed; use numbers, + - * / // % ** and math functions like sqrt",
            field="expression",
        )

    try:
        result = ev(tree, 0)
    except OverflowError:
        raise ToolError(f"{expression!r} overflows", field="expression") from None
    if isinstance(result, float) and math.isinf(result):
        raise ToolError(f"{expression!r} is infinite", field="expression")
    return result


def format_number(value: float) -> str:
    """Digits for speech: integers as is, floats to at most 10 significant digits without trailing zeros."""
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int):
        return str(value)
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    text = f"{value:.10g}"
    if "e" in text:
        mantissa, exponent = text.split("e")
        return f"{mantissa} times 10 to the {int(exponent)}"
    return text


class CalculateArgs(ToolArgs):
    expression: str = Field(description="Arithmetic expression, e.g. '(12.5 * 4) / 3' or '15% of 80'.")


def calculate_tool() -> Tool:
    """The ``calculate(expression)`` tool; the clause reads ``"<expression> = <result>"``."""

    async def calculate(expression: str) -> ToolOutput:
        result = evaluate_expression(expression)
        shown = " ".join(expression.split())
        return ToolOutput(f"{shown} = {format_number(result)}", {"result": result})

    return Tool(
        name="calculate",
        description=(
            "Exact arithmetic: + - * / % **, parentheses, percentages, sqrt and other math functions. Typical: "
            "'what is 17 percent of 240' -> calculate(expression='17% of 240')."
        ),
        parameters=CalculateArgs,
        fn=calculate,
        kind="read",
        timeout_s=2.0,
        domain="utility",
    )
