"""The deterministic mock world behind the Full-Duplex-Bench v3 tools, stored in SQLite.

Full-Duplex-Bench v3 (arXiv 2604.04847; ``v3/mock_apis.py`` upstream) scores *which* tool a voice agent calls
and with *which* arguments; the tools only need to answer believably and consistently. This world does that:

- At first use it is generated from a seeded :class:`random.Random` (seed ``DEFAULT_SEED`` unless given) out of the
  reference tables in :mod:`.world_data` (real airports and cities, approximate exchange rates) and written to a
  SQLite file (or an in-memory database when no path is given). A file, once built, is reused as is: two
  :class:`MockWorld` objects over the same file see the same flights, listings, orders, bookings and cart.
- Reads are pure functions of the database and the request. Things the seed did not cover (an order id nobody
  generated, a product query with no match, a city without listings) are *materialised* deterministically from
  the world seed and the request text, written to the database and reused afterwards.
- Actions write rows and return confirmations whose ids come from per-kind counters (``AP-000001``) or, for
  flight bookings, a six-letter record locator hashed from the seed and the counter.
- Dates are stored as day offsets from "today" (:meth:`MockWorld.today`, the real date unless fixed), so that an
  order "arrives in two days" stays true whenever the world is opened.

Every answer is one short English clause with digits, suitable after the ``"(tool result) "`` prefix.
Errors the caller can fix (an unknown currency, an impossible date) raise :class:`ToolError` naming the field.
"""

from __future__ import annotations

import asyncio
import calendar
import contextlib
import difflib
import hashlib
import json
import math
import random
import re
import sqlite3
import threading
from collections.abc import Iterator
from datetime import date, timedelta
from pathlib import Path
from typing import Any

from cspan.backends.errors import ToolError
from cspan.backends.tools import world_data as D
from cspan.backends.tools.bank import ToolOutput

__all__ = ["DEFAULT_SEED", "SCHEMA_VERSION", "MockWorld", "parse_date"]

DEFAULT_SEED = 20260506
SCHEMA_VERSION = "1"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS airports (
    code TEXT PRIMARY KEY, city TEXT NOT NULL, country TEXT NOT NULL, lat REAL NOT NULL, lon REAL NOT NULL,
    aliases TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS flights (
    flight_no TEXT PRIMARY KEY, airline TEXT NOT NULL, origin TEXT NOT NULL, destination TEXT NOT NULL,
    depart_min INTEGER NOT NULL, duration_min INTEGER NOT NULL, base_fare REAL NOT NULL, seats INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS passengers (name TEXT PRIMARY KEY, first_booking TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS bookings (
    id INTEGER PRIMARY KEY, confirmation TEXT UNIQUE NOT NULL, flight_id TEXT NOT NULL, flight_no TEXT NOT NULL,
    flight_date TEXT NOT NULL, passenger_name TEXT NOT NULL, fare REAL NOT NULL, status TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS identity_docs (
    doc_type TEXT PRIMARY KEY, doc_number TEXT NOT NULL, holder TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS doc_updates (
    id INTEGER PRIMARY KEY, reference TEXT NOT NULL, doc_type TEXT NOT NULL, old_number TEXT NOT NULL,
    new_number TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS cards (
    card_type TEXT PRIMARY KEY, display_name TEXT NOT NULL, annual_fee INTEGER NOT NULL, apr REAL NOT NULL,
    benefits TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS currencies (
    code TEXT PRIMARY KEY, singular TEXT NOT NULL, plural TEXT NOT NULL, usd_per_unit REAL NOT NULL,
    decimals INTEGER NOT NULL, aliases TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS accounts (
    account_id TEXT PRIMARY KEY, kind TEXT NOT NULL, name TEXT NOT NULL, last4 TEXT NOT NULL, balance REAL NOT NULL);
CREATE TABLE IF NOT EXISTS autopay (
    bill_type TEXT PRIMARY KEY, payee TEXT NOT NULL, amount REAL, due_day INTEGER NOT NULL,
    account_id TEXT NOT NULL, reference TEXT);
CREATE TABLE IF NOT EXISTS cities (
    name TEXT PRIMARY KEY, state TEXT NOT NULL, lat REAL NOT NULL, lon REAL NOT NULL, base_rent INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS neighborhoods (
    city TEXT NOT NULL, name TEXT NOT NULL, lat REAL NOT NULL, lon REAL NOT NULL, PRIMARY KEY (city, name));
CREATE TABLE IF NOT EXISTS apartments (
    listing_id TEXT PRIMARY KEY, city TEXT NOT NULL, neighborhood TEXT NOT NULL, address TEXT NOT NULL,
    bedrooms INTEGER NOT NULL, bathrooms REAL NOT NULL, rent INTEGER NOT NULL, sqft INTEGER NOT NULL,
    pets INTEGER NOT NULL, parking INTEGER NOT NULL, laundry INTEGER NOT NULL, furnished INTEGER NOT NULL,
    available_offset INTEGER NOT NULL, lat REAL NOT NULL, lon REAL NOT NULL);
CREATE TABLE IF NOT EXISTS search_filters (filter_name TEXT PRIMARY KEY, value TEXT NOT NULL, seq INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS products (
    product_id TEXT PRIMARY KEY, name TEXT NOT NULL, brand TEXT NOT NULL, category TEXT NOT NULL,
    keywords TEXT NOT NULL, price REAL NOT NULL, rating REAL NOT NULL, stock INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS cart (product_id TEXT PRIMARY KEY, quantity INTEGER NOT NULL, seq INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS orders (
    order_key TEXT PRIMARY KEY, order_id TEXT NOT NULL, product_id TEXT NOT NULL, item TEXT NOT NULL,
    quantity INTEGER NOT NULL, total REAL NOT NULL, status TEXT NOT NULL, carrier TEXT NOT NULL,
    tracking TEXT NOT NULL, placed_offset INTEGER NOT NULL, ship_offset INTEGER NOT NULL,
    eta_offset INTEGER NOT NULL);
"""

_MONTHS = {name.lower(): i for i, name in enumerate(calendar.month_name) if name}
_MONTHS.update({name.lower(): i for i, name in enumerate(calendar.month_abbr) if name})
_MONTHS["sept"] = 9
_WEEKDAYS = {name.lower(): i for i, name in enumerate(calendar.day_name)}
_WEEKDAYS.update({name.lower(): i for i, name in enumerate(calendar.day_abbr)})
_ORDINAL_WORDS = {
    "first": 1, "second": 2, "third": 3, "fourth": 4, "fifth": 5, "sixth": 6, "seventh": 7, "eighth": 8,
    "ninth": 9, "tenth": 10, "eleventh": 11, "twelfth": 12, "thirteenth": 13, "fourteenth": 14, "fifteenth": 15,
    "sixteenth": 16, "seventeenth": 17, "eighteenth": 18, "nineteenth": 19, "twentieth": 20,
    "twenty first": 21, "twenty second": 22, "twenty third": 23, "twenty fourth": 24, "twenty fifth": 25,
    "twenty sixth": 26, "twenty seventh": 27, "twenty eighth": 28, "twenty ninth": 29, "thirtieth": 30,
    "thirty first": 31,
}  # fmt: skip
_LOCATOR_ALPHABET = "ABCDEFGHJKLMNPQRSTUVWXYZ23456789"
_STOPWORDS = {
    "a", "an", "the", "for", "some", "me", "my", "under", "below", "less", "than", "cheap", "good", "best", "new",
    "with", "and", "of", "to", "i", "need", "want", "find", "buy", "looking", "search", "show", "any", "pair",
    "please", "in", "on", "that", "is", "are", "get", "dollars", "bucks", "around", "about",
}  # fmt: skip

_FILTER_ALIASES = {
    "pets": "pets_allowed", "pet": "pets_allowed", "pet_friendly": "pets_allowed", "allows_pets": "pets_allowed",
    "pets_allowed": "pets_allowed", "dogs": "pets_allowed", "dog_friendly": "pets_allowed",
    "cats": "pets_allowed", "parking": "parking", "garage": "parking", "parking_spot": "parking",
    "laundry": "laundry", "in_unit_laundry": "laundry", "washer": "laundry", "washer_dryer": "laundry",
    "furnished": "furnished", "max_price": "max_price", "price": "max_price", "budget": "max_price",
    "max_rent": "max_price", "rent": "max_price", "price_limit": "max_price", "maximum_price": "max_price",
    "min_sqft": "min_sqft", "sqft": "min_sqft", "square_feet": "min_sqft", "size": "min_sqft",
    "bathrooms": "bathrooms", "baths": "bathrooms", "min_bathrooms": "bathrooms", "neighborhood": "neighborhood",
    "neighbourhood": "neighborhood", "area": "neighborhood", "location": "neighborhood",
    "bedrooms": "bedrooms", "beds": "bedrooms", "min_bedrooms": "bedrooms",
}  # fmt: skip
_BOOL_FILTERS = {"pets_allowed", "parking", "laundry", "furnished"}
_NUMBER_FILTERS = {"max_price", "min_sqft", "bathrooms", "bedrooms"}
_VAGUE = {
    "something", "anything", "stuff", "thing", "things", "item", "items", "gift", "present", "nice", "cool",
    "product", "products", "recommend", "recommendation", "idea", "ideas", "mom", "dad", "birthday",
}  # fmt: skip


# ---------------------------------------------------------------------------------------------------- helpers


def _hash_int(*parts: object) -> int:
    digest = hashlib.sha256("|".join(str(p) for p in parts).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big")


def _rng(*parts: object) -> random.Random:
    return random.Random(_hash_int(*parts))


def _norm(text: str) -> str:
    """Lower case, punctuation to spaces (apostrophes dropped), single spaces."""
    text = text.lower().replace("'", "").replace("\u2019", "")
    return " ".join(re.sub(r"[^\w$€£¥₩.]+", " ", text).replace(".", " ").split())


def _tokens(text: str) -> list[str]:
    return [_stem(t) for t in _norm(text).split() if t not in _STOPWORDS]


def _stem(token: str) -> str:
    if len(token) > 4 and token.endswith("ies"):
        return token[:-3] + "y"
    if len(token) > 3 and token.endswith("es") and token[-3] in "sxz":
        return token[:-2]
    if len(token) > 3 and token.endswith("s") and not token.endswith("ss"):
        return token[:-1]
    return token


def _money(value: float) -> str:
    if abs(value - round(value)) < 0.005:
        return f"${round(value):,}"
    return f"${value:,.2f}"


def _amount(value: float, decimals: int) -> str:
    text = f"{value:,.{decimals}f}"
    if "." in text:
        text = text.rstrip("0").rstrip(".") if decimals and value == round(value) else text
    return text


def _rate(value: float) -> str:
    if value <= 0:
        return "0"
    decimals = max(0, 3 - math.floor(math.log10(value)))
    text = f"{value:.{decimals}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def _fmt_date(d: date) -> str:
    return f"{d:%A}, {d:%B} {d.day}, {d.year}"


def _fmt_short_date(d: date) -> str:
    return f"{d:%A}, {d:%B} {d.day}"


def _fmt_clock(minutes: int) -> str:
    hours, mins = divmod(minutes % (24 * 60), 60)
    suffix = "AM" if hours < 12 else "PM"
    return f"{(hours % 12) or 12}:{mins:02d} {suffix}"


def _fmt_duration(minutes: float) -> str:
    hours, mins = divmod(round(minutes), 60)
    if hours == 0:
        return f"{mins} min"
    return f"{hours} h {mins} min" if mins else f"{hours} h"


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _haversine_km(lat1: float, lon1: float, lat2: float, lon2: float) -> float:
    """Great-circle distance on a sphere of radius 6371 km."""
    p1, p2 = math.radians(lat1), math.radians(lat2)
    dp, dl = p2 - p1, math.radians(lon2 - lon1)
    a = math.sin(dp / 2) ** 2 + math.cos(p1) * math.cos(p2) * math.sin(dl / 2) ** 2
    return 2 * 6371.0 * math.asin(min(1.0, math.sqrt(a)))


def _offset_point(lat: float, lon: float, max_km: float, *seed: object) -> tuple[float, float]:
    rng = _rng("offset", *seed)
    dist = max_km * math.sqrt(rng.random())
    angle = rng.uniform(0, 2 * math.pi)
    dlat = dist * math.cos(angle) / 111.0
    dlon = dist * math.sin(angle) / (111.0 * max(0.2, math.cos(math.radians(lat))))
    return round(lat + dlat, 5), round(lon + dlon, 5)


def _parse_number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    text = str(value).strip().lower().replace(",", "").replace("$", "").replace("usd", "").strip()
    match = re.fullmatch(r"(-?\d+(?:\.\d+)?)\s*(k|thousand)?", text)
    if not match:
        return None
    number = float(match.group(1))
    return number * 1000 if match.group(2) else number


def _parse_bool(value: Any) -> bool | None:
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float):
        return bool(value)
    text = _norm(str(value))
    if text in {"true", "yes", "y", "1", "on", "allowed", "required", "must", "enabled", "include", "with"}:
        return True
    if text in {"false", "no", "n", "0", "off", "not allowed", "none", "disabled", "exclude", "without"}:
        return False
    return None


def parse_date(text: str, today: date) -> date:
    """Read a spoken or written travel date relative to ``today``.

    Accepts ISO ``2026-05-06``, ``5/6`` or ``5/6/2026`` (US order), ``May 6``, ``May 6th, 2026``, ``6 May``,
    ``the sixth of May``, ``today``, ``tomorrow``, ``day after tomorrow``, ``in 3 days``, ``next week``,
    ``Friday``/``this Friday``/``next Friday``. Without a year, the next such day on or after ``today`` is meant.

    Raises:
        ToolError: the text is not a date this function understands, or names an impossible day (``field`` is
            ``"date"``).
    """
    raw = str(text).strip()
    t = _norm(raw.replace("/", " slash ").replace("-", " dash "))
    t = t.replace(" slash ", "/").replace(" dash ", "-")
    t = re.sub(r"^(on|for|the|this coming)\s+", "", t)

    def build(year: int | None, month: int, day: int) -> date:
        try:
            if year is not None:
                return date(year, month, day)
            candidate = date(today.year, month, day)
            return candidate if candidate >= today else date(today.year + 1, month, day)
        except ValueError:
            raise ToolError(f"date {raw!r} is not a real calendar day", field="date") from None

    if not t:
        raise ToolError("date is empty; say e.g. 'May 6' or '2026-05-06'", field="date")
    if m := re.fullmatch(r"(\d{4})-(\d{1,2})-(\d{1,2})", t):
        return build(int(m.group(1)), int(m.group(2)), int(m.group(3)))
    if m := re.fullmatch(r"(\d{1,2})/(\d{1,2})(?:/(\d{2,4}))?", t):
        year = int(m.group(3)) if m.group(3) else None
        if year is not None and year < 100:
            year += 2000
        return build(year, int(m.group(1)), int(m.group(2)))
    if t == "today" or t == "tonight":
        return today
    if t == "tomorrow":
        return today + timedelta(days=1)
    if t in {"day after tomorrow", "the day after tomorrow"}:
        return today + timedelta(days=2)
    if m := re.fullmatch(r"in (\d+) days?", t):
        return today + timedelta(days=int(m.group(1)))
    if t == "next week":
        return today + timedelta(days=7)
    if m := re.fullmatch(r"(this |next |coming )?(\w+)", t):
        wd = _WEEKDAYS.get(m.group(2))
        if wd is not None:
            ahead = (wd - today.weekday()) % 7
            if m.group(1) == "next " and ahead == 0:
                ahead = 7
            return today + timedelta(days=ahead)
    day_words = "|".join(sorted(_ORDINAL_WORDS, key=len, reverse=True))
    day_re = rf"(?P<day>\d{{1,2}}(?:st|nd|rd|th)?|{day_words})"
    month_re = "(?P<month>" + "|".join(sorted(_MONTHS, key=len, reverse=True)) + ")"
    year_re = r"(?: (?P<year>\d{4}))?"
    for pattern in (
        rf"(?:\w+ )?{month_re} (?:the )?{day_re}{year_re}",
        rf"(?:\w+ )?(?:the )?{day_re} (?:of )?{month_re}{year_re}",
    ):
        if m := re.fullmatch(pattern, t):
            token = m.group("day")
            day = int(re.sub(r"(st|nd|rd|th)$", "", token)) if token[0].isdigit() else _ORDINAL_WORDS[token]
            year = int(m.group("year")) if m.group("year") else None
            return build(year, _MONTHS[m.group("month")], day)
    raise ToolError(f"cannot read the date {raw!r}; say e.g. 'May 6', 'next Friday' or '2026-05-06'", field="date")


# ---------------------------------------------------------------------------------------------------- the world


class MockWorld:
    """A seeded, persistent mock world of flights, documents, cards, money, apartments, orders and products.

    Args:
        path: SQLite file (created with its parent folder and seeded at first use); ``None`` or ``":memory:"``
            keeps the world in memory for the life of this object.
        seed: generator seed used when the file is first built (an existing file keeps the seed it was built
            with; it is stored in its ``meta`` table).
        today: the world's "today" for relative dates; ``None`` means the real local date at each call.

    Thread-safe (one lock around the connection). Methods named like the tools return :class:`ToolOutput`.

    Raises:
        ToolError: the file exists but is not a mock-world database of this schema version.
    """

    def __init__(self, path: str | Path | None = None, *, seed: int = DEFAULT_SEED, today: date | None = None):
        self.path = None if path in (None, ":memory:") else Path(path)
        self._fixed_today = today
        self._lock = threading.RLock()
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            target = str(self.path)
        else:
            target = ":memory:"
        self._conn = sqlite3.connect(target, check_same_thread=False, isolation_level=None, timeout=10.0)
        self._conn.row_factory = sqlite3.Row
        self._conn.execute("PRAGMA busy_timeout = 10000")
        if self.path is not None:
            self._conn.execute("PRAGMA journal_mode = WAL")
        self._ensure_seeded(seed)
        self.seed = int(self._meta("seed") or seed)

    # ------------------------------------------------------------------ plumbing

    def today(self) -> date:
        """The world's current date (fixed at construction, or the real local date)."""
        return self._fixed_today or date.today()

    @contextlib.contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    def _q(self, sql: str, params: tuple | list = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._conn.execute(sql, params).fetchall()

    def _meta(self, key: str) -> str | None:
        rows = self._q("SELECT value FROM meta WHERE key = ?", (key,))
        return rows[0]["value"] if rows else None

    @staticmethod
    def _set_meta(conn: sqlite3.Connection, key: str, value: str) -> None:
        conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, value))

    @staticmethod
    def _next(conn: sqlite3.Connection, name: str) -> int:
        conn.execute(
            "INSERT INTO counters (name, value) VALUES (?, 1) ON CONFLICT(name) DO UPDATE SET value = value + 1",
            (name,),
        )
        return int(conn.execute("SELECT value FROM counters WHERE name = ?", (name,)).fetchone()[0])

    def close(self) -> None:
        """Close the database connection (idempotent)."""
        with self._lock, contextlib.suppress(sqlite3.ProgrammingError):
            self._conn.close()

    async def aclose(self) -> None:
        """Async form of :meth:`close`, for :meth:`ToolBank.add_closer`."""
        self.close()

    async def run(self, method: str, **kwargs: Any) -> ToolOutput:
        """Run a tool method in a worker thread so that SQLite never blocks the event loop."""
        return await asyncio.to_thread(getattr(self, method), **kwargs)

    # ------------------------------------------------------------------ seeding

    def _ensure_seeded(self, seed: int) -> None:
        with self._tx() as conn:
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    conn.execute(statement)
            row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
            if row is not None:
                if row[0] != SCHEMA_VERSION:
                    raise ToolError(
                        f"mock world {self.path} has schema version {row[0]}, this code needs {SCHEMA_VERSION}; "
                        "delete the file to rebuild it"
                    )
                return
            self._seed(conn, seed)
            self._set_meta(conn, "seed", str(seed))
            self._set_meta(conn, "schema_version", SCHEMA_VERSION)

    def _seed(self, conn: sqlite3.Connection, seed: int) -> None:
        rng = random.Random(seed)
        airports = {a[0]: a for a in D.AIRPORTS}
        for code, city, country, lat, lon, aliases, _carriers in D.AIRPORTS:
            conn.execute(
                "INSERT INTO airports VALUES (?, ?, ?, ?, ?, ?)", (code, city, country, lat, lon, ",".join(aliases))
            )
        # flights: three a day from the traveller's home airport to every other airport, and back from New York
        home = D.TRAVELLER["home_airport"]
        used: set[str] = set()
        routes = [(home, code) for code in airports if code != home] + [("JFK", home)]
        for origin, dest in routes:
            o, d = airports[origin], airports[dest]
            km = _haversine_km(o[3], o[4], d[3], d[4])
            domestic = d[2] == "United States" and o[2] == "United States"
            carriers = list(D.US_CARRIERS) if domestic else list(d[6]) + list(D.INTERNATIONAL_US_CARRIERS)
            if dest == "HNL":
                carriers = ["HA", "UA", "AS", "WN"]
            slots = (
                sorted(rng.sample(range(6 * 12, 22 * 12), 3))
                if domestic
                else sorted(rng.sample(range(9 * 12, 23 * 12), 3))
            )
            for slot in slots:
                airline = rng.choice(carriers)
                while True:
                    number = rng.randint(100, 2999) if domestic else rng.randint(1, 999)
                    flight_no = f"{airline}{number}"
                    if flight_no not in used:
                        used.add(flight_no)
                        break
                speed = 700.0 if km < 2500 else 820.0
                duration = int(round((km / speed * 60 + 28) / 5) * 5)
                fare = (79 + 0.09 * km) if domestic else (320 + 0.075 * km)
                fare = round(fare * rng.uniform(0.85, 1.2))
                conn.execute(
                    "INSERT INTO flights VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (flight_no, airline, origin, dest, slot * 5, duration, fare, rng.randint(2, 38)),
                )
        conn.execute(
            "INSERT INTO identity_docs VALUES ('passport', ?, ?)", (D.TRAVELLER["passport"], D.TRAVELLER["name"])
        )
        conn.execute(
            "INSERT INTO identity_docs VALUES ('id_card', ?, ?)", (D.TRAVELLER["id_card"], D.TRAVELLER["name"])
        )
        for card_type, name, fee, apr, benefits in D.CARDS:
            conn.execute("INSERT INTO cards VALUES (?, ?, ?, ?, ?)", (card_type, name, fee, apr, json.dumps(benefits)))
        for code, singular, plural, usd, decimals, aliases in D.CURRENCIES:
            conn.execute(
                "INSERT INTO currencies VALUES (?, ?, ?, ?, ?, ?)",
                (code, singular, plural, usd, decimals, json.dumps(aliases)),
            )
        for account in D.ACCOUNTS:
            conn.execute("INSERT INTO accounts VALUES (?, ?, ?, ?, ?)", account)
        for bill_type, payee, amount, due_day, account_id in D.BILLS:
            conn.execute(
                "INSERT INTO autopay VALUES (?, ?, ?, ?, ?, NULL)", (bill_type, payee, amount, due_day, account_id)
            )
        for city, state, lat, lon, base_rent, hoods in D.RENT_CITIES:
            self._add_city(conn, seed, city, state, lat, lon, base_rent, hoods)
        index = 1001
        for category, keywords, stems in D.PRODUCT_CATALOG:
            brands = rng.sample(D.BRANDS, len(stems))
            for (stem, base), brand in zip(stems, brands, strict=True):
                price = max(4.99, round(base * rng.uniform(0.9, 1.12)) - 0.01)
                conn.execute(
                    "INSERT INTO products VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        f"P-{index}",
                        f"{brand} {stem}",
                        brand,
                        category,
                        json.dumps(keywords),
                        price,
                        round(rng.uniform(3.6, 4.9), 1),
                        rng.randint(4, 250),
                    ),
                )
                index += 1
        product_ids = [r[0] for r in conn.execute("SELECT product_id FROM products ORDER BY product_id")]
        order_numbers = rng.sample(range(10000, 99999), 24)
        for number in order_numbers:
            self._add_order(conn, seed, f"ORD-{number}", rng.choice(product_ids))

    def _add_city(
        self,
        conn: sqlite3.Connection,
        seed: int,
        city: str,
        state: str,
        lat: float,
        lon: float,
        base_rent: int,
        hoods: tuple[str, ...],
    ) -> None:
        conn.execute("INSERT INTO cities VALUES (?, ?, ?, ?, ?)", (city, state, lat, lon, base_rent))
        rng = _rng(seed, "city", city)
        centers = {}
        for hood in hoods:
            hlat, hlon = _offset_point(lat, lon, 7.0, seed, city, hood)
            centers[hood] = (hlat, hlon, rng.uniform(0.82, 1.22))
            conn.execute("INSERT INTO neighborhoods VALUES (?, ?, ?, ?)", (city, hood, hlat, hlon))
        bedroom_mix = [0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2, 3, 3, 3, 4]
        factor = {0: 0.78, 1: 1.0, 2: 1.36, 3: 1.74, 4: 2.15}
        for i in range(24):
            hood = rng.choice(hoods)
            hlat, hlon, hood_factor = centers[hood]
            bedrooms = rng.choice(bedroom_mix)
            rent = int(round(base_rent * factor[bedrooms] * hood_factor * rng.uniform(0.9, 1.12) / 25) * 25)
            listing_no = self._next(conn, "listing") + 1000
            alat, alon = _offset_point(hlat, hlon, 0.8, seed, city, i)
            conn.execute(
                "INSERT INTO apartments VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    f"APT-{listing_no}",
                    city,
                    hood,
                    f"{rng.randint(100, 4999)} {rng.choice(D.STREETS)}",
                    bedrooms,
                    max(1.0, bedrooms - rng.choice([0, 0.5, 1])) if bedrooms > 1 else 1.0,
                    rent,
                    int(round((430 + 340 * bedrooms) * rng.uniform(0.85, 1.2) / 10) * 10),
                    int(rng.random() < 0.6),
                    int(rng.random() < 0.5),
                    int(rng.random() < 0.55),
                    int(rng.random() < 0.15),
                    rng.choice([0, 0, 3, 7, 10, 14, 21, 30, 45]),
                    alat,
                    alon,
                ),
            )

    def _add_order(self, conn: sqlite3.Connection, seed: int, order_id: str, product_id: str | None = None) -> None:
        key = re.sub(r"[^A-Z0-9]", "", order_id.upper())
        rng = _rng(seed, "order", key)
        if product_id is None:
            ids = [r[0] for r in conn.execute("SELECT product_id FROM products ORDER BY product_id")]
            product_id = ids[rng.randrange(len(ids))]
        product = conn.execute("SELECT name, price FROM products WHERE product_id = ?", (product_id,)).fetchone()
        quantity = rng.choice([1, 1, 1, 2])
        status = rng.choice(D.ORDER_STATUSES)
        carrier, style = rng.choice(D.CARRIERS)
        if style == "ups":
            tracking = "1Z" + "".join(rng.choice("0123456789ABCDEFGHJKLMNPRSTVWXY") for _ in range(16))
        elif style == "usps":
            tracking = "9400" + "".join(rng.choice("0123456789") for _ in range(18))
        elif style == "fedex":
            tracking = "".join(rng.choice("0123456789") for _ in range(12))
        else:
            tracking = "".join(rng.choice("0123456789") for _ in range(10))
        placed = -rng.randint(1, 6) if status in ("processing", "shipped") else -rng.randint(3, 14)
        ship = placed + rng.randint(1, 2)
        eta = {
            "processing": rng.randint(3, 6),
            "shipped": rng.randint(2, 5),
            "in transit": rng.randint(1, 3),
            "out for delivery": 0,
            "delivered": -rng.randint(0, 2),
        }[status]
        if status == "processing":
            ship = rng.randint(1, 2)
        conn.execute(
            "INSERT INTO orders VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                key,
                order_id,
                product_id,
                product["name"],
                quantity,
                round(product["price"] * quantity, 2),
                status,
                carrier,
                tracking,
                placed,
                ship,
                eta,
            ),
        )

    # ------------------------------------------------------------------ lookups shared by tools

    def _airport(self, text: str) -> sqlite3.Row | None:
        rows = self._q("SELECT * FROM airports ORDER BY code")
        raw = str(text).strip()
        t = _norm(raw)
        t = re.sub(r"\b(airport|international|intl|city)\b", "", t).strip() or t
        names: dict[str, sqlite3.Row] = {}
        for row in rows:
            if raw.upper() == row["code"]:
                return row
            names[_norm(row["city"])] = row
            for alias in filter(None, row["aliases"].split(",")):
                names[_norm(alias)] = row
        if t in names:
            return names[t]
        for name, row in names.items():  # "las vegas nevada", "paris france"
            if len(name) > 3 and re.search(rf"\b{re.escape(name)}\b", t):
                return row
        close = difflib.get_close_matches(t, list(names), n=1, cutoff=0.85)
        return names[close[0]] if close else None

    def _flight_price(self, flight: sqlite3.Row, day: date) -> int:
        factor = 0.82 + (_hash_int(self.seed, "fare", flight["flight_no"], day.isoformat()) % 48) / 100
        if day.weekday() in (4, 6):
            factor += 0.1
        return round(flight["base_fare"] * factor)

    def _flight_dict(self, flight: sqlite3.Row, day: date) -> dict[str, Any]:
        return {
            "flight_id": f"{flight['flight_no']}-{day:%Y%m%d}",
            "flight_number": flight["flight_no"],
            "airline": D.AIRLINES.get(flight["airline"], flight["airline"]),
            "origin": flight["origin"],
            "destination": flight["destination"],
            "date": day.isoformat(),
            "departure": _fmt_clock(flight["depart_min"]),
            "duration_min": flight["duration_min"],
            "price_usd": self._flight_price(flight, day),
            "seats_left": 1 + _hash_int(self.seed, "seats", flight["flight_no"], day) % flight["seats"],
        }

    # ------------------------------------------------------------------ travel_identity

    def search_flights(self, destination: str, date: str) -> ToolOutput:
        """Flights from the traveller's home airport (San Francisco) to ``destination`` on ``date``."""
        day = parse_date(date, self.today())
        if day < self.today():
            raise ToolError(f"date {date!r} ({day.isoformat()}) is in the past; give a future date", field="date")
        airport = self._airport(destination)
        if airport is None:
            where = str(destination).strip() or "that destination"
            return ToolOutput(
                f"No flights to {where} on {_fmt_date(day)}: it is not a destination this airline network serves.",
                {"destination": where, "date": day.isoformat(), "flights": []},
            )
        home = D.TRAVELLER["home_airport"]
        origin = "JFK" if airport["code"] == home else home
        rows = self._q(
            "SELECT * FROM flights WHERE origin = ? AND destination = ? ORDER BY depart_min",
            (origin, airport["code"]),
        )
        flights = [self._flight_dict(r, day) for r in rows]
        origin_city = self._q("SELECT city FROM airports WHERE code = ?", (origin,))[0]["city"]
        with self._tx() as conn:
            self._set_meta(conn, "last_flights", json.dumps([f["flight_id"] for f in flights]))
        parts = [
            f"{f['flight_number']} {f['airline']} at {f['departure']}, {_fmt_duration(f['duration_min'])}, "
            f"${f['price_usd']}"
            for f in flights
        ]
        cheapest = min(flights, key=lambda f: f["price_usd"])
        text = (
            f"{len(flights)} flights from {origin_city} ({origin}) to {airport['city']} ({airport['code']}) on "
            f"{_fmt_date(day)}: " + "; ".join(parts) + f". Cheapest is {cheapest['flight_number']}."
        )
        data = {
            "origin": origin,
            "destination": airport["code"],
            "destination_city": airport["city"],
            "date": day.isoformat(),
            "flights": flights,
        }
        return ToolOutput(text, data)

    def _resolve_flight(self, flight_id: str | None) -> tuple[sqlite3.Row, date]:
        last = json.loads(self._meta("last_flights") or "[]")
        if not flight_id:
            if not last:
                raise ToolError(
                    "no flight chosen: call search_flights first or pass flight_id (e.g. 'UA1523-20260506')",
                    field="flight_id",
                )
            flight_id = last[0]
        compact = re.sub(r"[^A-Z0-9]", "", str(flight_id).upper())
        match = re.fullmatch(r"([A-Z0-9]{2}?)(\d{1,4})(\d{8})?", compact)
        if match is None:
            match = re.fullmatch(r"([A-Z]{2}|[A-Z]\d|\d[A-Z])(\d{1,4})(\d{8})?", compact)
        if match is None:
            raise ToolError(f"cannot read flight id {flight_id!r}; use one from search_flights", field="flight_id")
        flight_no = f"{match.group(1)}{int(match.group(2))}"
        rows = self._q("SELECT * FROM flights WHERE flight_no = ?", (flight_no,))
        if not rows:
            raise ToolError(f"there is no flight {flight_no}; use an id from search_flights", field="flight_id")
        if match.group(3):
            try:
                day = date(int(match.group(3)[:4]), int(match.group(3)[4:6]), int(match.group(3)[6:]))
            except ValueError:
                raise ToolError(f"flight id {flight_id!r} has an impossible date", field="flight_id") from None
        else:
            same = [fid for fid in last if fid.split("-")[0] == flight_no]
            if not same:
                raise ToolError(
                    f"flight {flight_no} needs a date: pass the id from search_flights (e.g. '{flight_no}-"
                    f"{self.today():%Y%m%d}')",
                    field="flight_id",
                )
            tail = same[0].split("-")[1]
            day = date(int(tail[:4]), int(tail[4:6]), int(tail[6:]))
        return rows[0], day

    def book_flight(self, passenger_name: str, flight_id: str | None = None) -> ToolOutput:
        """Book ``passenger_name`` on ``flight_id`` (default: the first flight of the last search)."""
        name = " ".join(str(passenger_name).split())
        if len(re.sub(r"[^A-Za-z]", "", name)) < 2:
            raise ToolError(f"passenger_name {passenger_name!r} is not a name", field="passenger_name")
        if name.islower() or name.isupper():
            name = name.title()
        flight, day = self._resolve_flight(flight_id)
        info = self._flight_dict(flight, day)
        airports = {r["code"]: r["city"] for r in self._q("SELECT code, city FROM airports")}
        with self._tx() as conn:
            seq = self._next(conn, "booking")
            value = _hash_int(self.seed, "booking", seq)
            locator = "".join(_LOCATOR_ALPHABET[(value >> (5 * i)) & 31] for i in range(6))
            conn.execute(
                "INSERT INTO bookings (confirmation, flight_id, flight_no, flight_date, passenger_name, fare, status)"
                " VALUES (?, ?, ?, ?, ?, ?, 'confirmed')",
                (locator, info["flight_id"], flight["flight_no"], day.isoformat(), name, info["price_usd"]),
            )
            conn.execute("INSERT OR IGNORE INTO passengers (name, first_booking) VALUES (?, ?)", (name, locator))
        text = (
            f"Booked {name} on {info['airline']} {flight['flight_no']} from {airports[flight['origin']]} to "
            f"{airports[flight['destination']]} on {_fmt_date(day)}, departing {info['departure']}; fare "
            f"${info['price_usd']}, confirmation code {locator}."
        )
        return ToolOutput(text, {**info, "passenger_name": name, "confirmation": locator, "status": "confirmed"})

    def update_identity_doc(self, doc_type: str, doc_number: str) -> ToolOutput:
        """Replace the traveller's passport or ID-card number on file."""
        t = _norm(doc_type).replace(" ", "_")
        if "passport" in t:
            kind, label = "passport", "passport"
        elif t in {"id", "id_card", "idcard", "identity_card", "national_id", "id_number", "state_id"} or any(
            w in t for w in ("identity", "license", "licence", "id_card")
        ):
            kind, label = "id_card", "ID card"
        else:
            raise ToolError(f"doc_type must be 'passport' or 'id_card', got {doc_type!r}", field="doc_type")
        number = re.sub(r"[^A-Za-z0-9]", "", str(doc_number)).upper()
        if not 5 <= len(number) <= 12:
            raise ToolError(f"doc_number {doc_number!r} should have 5 to 12 letters or digits", field="doc_number")
        with self._tx() as conn:
            old = conn.execute("SELECT doc_number FROM identity_docs WHERE doc_type = ?", (kind,)).fetchone()[0]
            seq = self._next(conn, "doc_update")
            reference = f"DOC-{seq:06d}"
            conn.execute("UPDATE identity_docs SET doc_number = ? WHERE doc_type = ?", (number, kind))
            conn.execute(
                "INSERT INTO doc_updates (reference, doc_type, old_number, new_number) VALUES (?, ?, ?, ?)",
                (reference, kind, old, number),
            )
        if old == number:
            text = f"Your {label} number {number} was already on file; nothing changed (reference {reference})."
        else:
            text = (
                f"Updated your {label} number to {number}, replacing the one ending in {old[-4:]}; "
                f"reference {reference}."
            )
        return ToolOutput(text, {"doc_type": kind, "doc_number": number, "previous": old, "reference": reference})

    # ------------------------------------------------------------------ finance_billing

    def get_card_benefits(self, card_type: str) -> ToolOutput:
        """Annual fee, APR and benefits of a card product."""
        rows = {r["card_type"]: r for r in self._q("SELECT * FROM cards ORDER BY rowid")}
        t = _norm(card_type)
        t = re.sub(r"\b(credit|debit|card|cards|the|my|one|rewards? card)\b", " ", t).strip() or t
        key = t.replace(" ", "_")
        if key not in rows:
            key = D.CARD_ALIASES.get(t, "")
        if key not in rows:
            for candidate in sorted(rows, key=len, reverse=True):
                if candidate.replace("_", " ") in t:
                    key = candidate
                    break
        if key not in rows:
            for alias, target in D.CARD_ALIASES.items():
                if re.search(rf"\b{re.escape(alias)}\b", t):
                    key = target
                    break
        if key not in rows:
            close = difflib.get_close_matches(t.replace(" ", "_"), list(rows), n=1, cutoff=0.7)
            key = close[0] if close else ""
        if key not in rows:
            names = ", ".join(c.replace("_", " ") for c in rows)
            return ToolOutput(
                f"There is no {str(card_type).strip()} card; the cards offered are {names}.",
                {"card_type": None, "available": list(rows)},
            )
        card = rows[key]
        benefits = json.loads(card["benefits"])
        fee = "no annual fee" if card["annual_fee"] == 0 else f"a ${card['annual_fee']} annual fee"
        listed = ", ".join(benefits[:-1]) + f" and {benefits[-1]}" if len(benefits) > 1 else benefits[0]
        text = f"The {card['display_name']} has {fee} and a {card['apr']}% purchase APR; it includes {listed}."
        return ToolOutput(
            text,
            {"card_type": key, "annual_fee": card["annual_fee"], "apr": card["apr"], "benefits": benefits},
        )

    def _currency(self, text: str, field: str) -> sqlite3.Row:
        rows = self._q("SELECT * FROM currencies ORDER BY rowid")
        raw = str(text).strip()
        if raw.upper() in {r["code"] for r in rows}:
            return next(r for r in rows if r["code"] == raw.upper())
        t = _norm(raw)
        names: dict[str, sqlite3.Row] = {}
        for row in rows:
            for name in (row["code"], row["singular"], row["plural"], *json.loads(row["aliases"])):
                names[_norm(name)] = row
        if t in names:
            return names[t]
        if raw in names:
            return names[raw]
        for name in sorted(names, key=len, reverse=True):
            if len(name) > 2 and re.search(rf"\b{re.escape(name)}\b", t):
                return names[name]
        close = difflib.get_close_matches(t, list(names), n=1, cutoff=0.8)
        if close:
            return names[close[0]]
        raise ToolError(f"unknown currency {raw!r}; use an ISO code like USD, EUR or JPY", field=field)

    def get_exchange_rate(self, amount: float, from_currency: str, to_currency: str) -> ToolOutput:
        """Convert ``amount`` between currencies at the world's fixed rates (``amount * rate``)."""
        if not math.isfinite(amount) or amount <= 0:
            raise ToolError(f"amount must be a positive number, got {amount}", field="amount")
        src = self._currency(from_currency, "from_currency")
        dst = self._currency(to_currency, "to_currency")
        rate = src["usd_per_unit"] / dst["usd_per_unit"]
        converted = amount * rate
        src_name = src["singular"] if amount == 1 else src["plural"]
        dst_name = dst["singular"] if round(converted, dst["decimals"]) == 1 else dst["plural"]
        amount_text = _amount(amount, 2 if amount != round(amount) else 0)
        converted_text = f"{converted:,.{dst['decimals']}f}"
        text = (
            f"{amount_text} {src_name} is {converted_text} {dst_name}, at 1 {src['code']} = "
            f"{_rate(rate)} {dst['code']}."
        )
        return ToolOutput(
            text,
            {
                "amount": amount,
                "from": src["code"],
                "to": dst["code"],
                "rate": round(rate, 8),
                "converted": round(converted, max(2, dst["decimals"])),
            },
        )

    def _account(self, text: str) -> dict[str, Any]:
        rows = [dict(r) for r in self._q("SELECT * FROM accounts ORDER BY rowid")]
        t = _norm(text)
        digits = re.findall(r"\d{4}", t.replace(" ", ""))
        for row in rows:
            if digits and digits[-1] == row["last4"]:
                return row
        for row in rows:
            if _norm(row["name"]) in t or t == _norm(row["account_id"]):
                return row
        for row in sorted(rows, key=lambda r: len(r["kind"]), reverse=True):
            if re.search(rf"\b{re.escape(row['kind'])}\b", t) or (row["kind"] == "credit card" and "credit" in t):
                return row
        if not t:
            raise ToolError("source_account is empty; say e.g. 'checking' or 'savings'", field="source_account")
        last4 = digits[-1] if digits else f"{_hash_int(self.seed, 'account', t) % 10000:04d}"
        name = re.sub(r"(?i)\b(my|the|account|acct|ending|in|number|no)\b|\d+|[^\w' &-]", " ", str(text))
        return {
            "account_id": f"EXT-{last4}",
            "kind": "external",
            "name": " ".join(name.split()) or "external",
            "last4": last4,
            "balance": 0.0,
        }

    def modify_autopay(self, bill_type: str, source_account: str) -> ToolOutput:
        """Point the autopay of ``bill_type`` at ``source_account`` (creating the autopay if it is new)."""
        t = _norm(bill_type)
        t = re.sub(r"\b(bill|bills|payment|payments|autopay|auto pay|automatic|my|the|monthly)\b", " ", t)
        t = " ".join(t.split())
        if not t:
            raise ToolError(f"bill_type {bill_type!r} names no bill; say e.g. 'electricity'", field="bill_type")
        known = {r["bill_type"]: dict(r) for r in self._q("SELECT * FROM autopay ORDER BY rowid")}
        key = t.replace(" ", "_")
        if key not in known:
            key = D.BILL_ALIASES.get(t, key)
        if key not in known:
            for alias, target in sorted(D.BILL_ALIASES.items(), key=lambda kv: -len(kv[0])):
                if re.search(rf"\b{re.escape(alias)}\b", t):
                    key = target
                    break
        if key not in known:
            for candidate in known:
                if candidate.replace("_", " ") in t:
                    key = candidate
                    break
        account = self._account(source_account)
        with self._tx() as conn:
            if account["kind"] == "external":
                conn.execute(
                    "INSERT OR IGNORE INTO accounts VALUES (?, ?, ?, ?, ?)",
                    (account["account_id"], "external", account["name"], account["last4"], 0.0),
                )
            if key not in known:
                conn.execute(
                    "INSERT INTO autopay VALUES (?, ?, NULL, ?, ?, NULL)",
                    (key, f"{t.title()} provider", 1 + _hash_int(self.seed, "due", key) % 28, account["account_id"]),
                )
                bill = {"bill_type": key, "payee": f"{t.title()} provider", "amount": None,
                        "due_day": 1 + _hash_int(self.seed, "due", key) % 28, "account_id": None}  # fmt: skip
            else:
                bill = known[key]
            seq = self._next(conn, "autopay")
            reference = f"AP-{seq:06d}"
            conn.execute(
                "UPDATE autopay SET account_id = ?, reference = ? WHERE bill_type = ?",
                (account["account_id"], reference, key),
            )
        label = key.replace("_", " ")
        amount = f", about {_money(bill['amount'])} a month" if bill["amount"] else ""
        unchanged = bill["account_id"] == account["account_id"]
        verb = "already draws" if unchanged else "now draws"
        text = (
            f"Autopay for your {label} bill ({bill['payee']}{amount}, due on the {_ordinal(bill['due_day'])}) "
            f"{verb} from your {account['name']} account ending in {account['last4']}; confirmation {reference}."
        )
        return ToolOutput(
            text,
            {
                "bill_type": key,
                "payee": bill["payee"],
                "account": account["name"],
                "last4": account["last4"],
                "confirmation": reference,
            },
        )

    # ------------------------------------------------------------------ housing_location

    def _city(self, text: str, *, create: bool) -> sqlite3.Row | None:
        rows = self._q("SELECT * FROM cities ORDER BY rowid")
        t = _norm(text)
        t = re.sub(r"\b(city of|downtown|area|metro)\b", " ", t).strip()
        t = re.sub(r"\s+(wa|ca|ny|tx|ma|il|co|or|fl|ga|dc|az|tn|mn|pa)$", "", t).strip()
        names = {_norm(r["name"]): r for r in rows}
        for airport in self._q("SELECT city, aliases FROM airports"):
            for alias in filter(None, airport["aliases"].split(",")):
                if _norm(airport["city"]) in names:
                    names.setdefault(_norm(alias), names[_norm(airport["city"])])
        if t in names:
            return names[t]
        for name in sorted(names, key=len, reverse=True):
            if len(name) > 3 and re.search(rf"\b{re.escape(name)}\b", t):
                return names[name]
        close = difflib.get_close_matches(t, list(names), n=1, cutoff=0.82)
        if close:
            return names[close[0]]
        if not create:
            return None
        if not re.fullmatch(r"[a-z][a-z .-]{1,40}", t):
            raise ToolError(f"city {text!r} is not a place name", field="city")
        name = " ".join(w.capitalize() for w in t.split())
        rng = _rng(self.seed, "new-city", name)
        with self._tx() as conn:
            self._add_city(
                conn,
                self.seed,
                name,
                "",
                round(rng.uniform(30.0, 46.0), 4),
                round(rng.uniform(-121.0, -75.0), 4),
                int(round(rng.uniform(1200, 2000) / 50) * 50),
                D.GENERIC_NEIGHBORHOODS,
            )
        return self._q("SELECT * FROM cities WHERE name = ?", (name,))[0]

    def _filters(self) -> dict[str, Any]:
        return {r["filter_name"]: json.loads(r["value"]) for r in self._q("SELECT * FROM search_filters ORDER BY seq")}

    def search_apartments(self, city: str, bedrooms: int, max_price: float) -> ToolOutput:
        """Listings in ``city`` with ``bedrooms`` bedrooms (0 = studio) at or under ``max_price`` a month.

        Saved search filters (:meth:`update_search_filter`) apply too: pets_allowed, parking, laundry, furnished,
        neighborhood, min_sqft, max_price (the lower price wins) and bathrooms.
        """
        if bedrooms < 0 or bedrooms > 10:
            raise ToolError(f"bedrooms must be between 0 and 10, got {bedrooms}", field="bedrooms")
        if max_price <= 0:
            raise ToolError(f"max_price must be positive, got {max_price}", field="max_price")
        place = self._city(city, create=True)
        assert place is not None
        filters = self._filters()
        limit = float(max_price)
        where = ["city = ?", "bedrooms = ?"]
        params: list[Any] = [place["name"], int(bedrooms)]
        applied = []
        for name, column in (("pets_allowed", "pets"), ("parking", "parking"), ("laundry", "laundry"),
                             ("furnished", "furnished")):  # fmt: skip
            if filters.get(name) is True:
                where.append(f"{column} = 1")
                applied.append(name.replace("_", " "))
        if isinstance(filters.get("max_price"), int | float):
            limit = min(limit, float(filters["max_price"]))
            applied.append(f"max price {_money(float(filters['max_price']))}")
        if isinstance(filters.get("min_sqft"), int | float):
            where.append("sqft >= ?")
            params.append(float(filters["min_sqft"]))
            applied.append(f"at least {int(filters['min_sqft'])} sq ft")
        if isinstance(filters.get("bathrooms"), int | float):
            where.append("bathrooms >= ?")
            params.append(float(filters["bathrooms"]))
            applied.append(f"{filters['bathrooms']:g}+ bathrooms")
        if isinstance(filters.get("neighborhood"), str) and filters["neighborhood"]:
            where.append("lower(neighborhood) LIKE ?")
            params.append(f"%{filters['neighborhood'].lower()}%")
            applied.append(f"in {filters['neighborhood']}")
        base_sql = f"SELECT * FROM apartments WHERE {' AND '.join(where)}"
        matches = self._q(base_sql + " AND rent <= ? ORDER BY rent, listing_id", [*params, limit])
        kind = "studio" if bedrooms == 0 else f"{bedrooms}-bedroom"
        plural = "" if len(matches) == 1 else "s"
        counted = (
            f"studio listing{plural}"
            if bedrooms == 0
            else f"listing{plural} with {bedrooms} bedroom" + ("s" if bedrooms > 1 else "")
        )
        note = f" (filters: {', '.join(applied)})" if applied else ""
        with self._tx() as conn:
            self._set_meta(conn, "last_apartments", json.dumps([r["listing_id"] for r in matches[:3]]))
        if not matches:
            cheaper = self._q(base_sql + " ORDER BY rent, listing_id LIMIT 1", params)
            tail = (
                f"; the cheapest is {cheaper[0]['listing_id']} in {cheaper[0]['neighborhood']} at "
                f"{_money(cheaper[0]['rent'])} a month"
                if cheaper
                else ""
            )
            return ToolOutput(
                f"No {kind} apartments in {place['name']} at or under {_money(limit)} a month{note}{tail}.",
                {"city": place["name"], "listings": []},
            )
        listings = [
            {
                "listing_id": r["listing_id"],
                "neighborhood": r["neighborhood"],
                "address": f"{r['address']}, {place['name']}",
                "bedrooms": r["bedrooms"],
                "bathrooms": r["bathrooms"],
                "rent": r["rent"],
                "sqft": r["sqft"],
                "pets_allowed": bool(r["pets"]),
                "parking": bool(r["parking"]),
                "in_unit_laundry": bool(r["laundry"]),
                "available": "now"
                if r["available_offset"] == 0
                else _fmt_short_date(self.today() + timedelta(days=r["available_offset"])),
            }
            for r in matches
        ]
        parts = [
            f"{a['listing_id']} in {a['neighborhood']}, {a['address'].split(',')[0]}, {_money(a['rent'])}, "
            f"{a['sqft']} sq ft"
            for a in listings[:3]
        ]
        text = (
            f"{len(listings)} {counted} in {place['name']} at or under {_money(limit)} a month{note}: "
            + "; ".join(parts)
            + "."
        )
        return ToolOutput(text, {"city": place["name"], "listings": listings[:5], "total": len(listings)})

    def _locate(self, text: str, hint_city: str | None) -> tuple[float, float, str, str | None]:
        """Coordinates, spoken label and city of an address, listing id, neighbourhood, landmark or city."""
        raw = " ".join(str(text).split())
        if not raw:
            raise ToolError("address is empty", field="origin_address")
        t = _norm(raw)
        compact = re.sub(r"[^A-Z0-9]", "", raw.upper())
        if m := re.fullmatch(r"(?:APT|APARTMENT|LISTING)?(\d{4})", compact):
            rows = self._q("SELECT * FROM apartments WHERE listing_id = ?", (f"APT-{m.group(1)}",))
            if rows:
                r = rows[0]
                return r["lat"], r["lon"], f"{r['address']}, {r['neighborhood']}", r["city"]
        cities = {_norm(r["name"]): r for r in self._q("SELECT * FROM cities")}
        city_row = None
        for name in sorted(cities, key=len, reverse=True):
            if re.search(rf"\b{re.escape(name)}\b", t):
                city_row = cities[name]
                break
        explicit = city_row is not None
        if city_row is None and hint_city is not None:
            city_row = next((c for c in cities.values() if c["name"] == hint_city), None)
        if "airport" in t:
            airport = self._airport(city_row["name"] if city_row is not None else t)
            if airport is not None:
                return airport["lat"], airport["lon"], raw, airport["city"]
        hoods = sorted(self._q("SELECT * FROM neighborhoods"), key=lambda h: -len(h["name"]))
        scopes = [[h for h in hoods if h["city"] == city_row["name"]]] if city_row is not None else []
        if not explicit:
            scopes.append(hoods)
        for scope in scopes:
            for hood in scope:
                if re.search(rf"\b{re.escape(_norm(hood['name']))}\b", t):
                    lat, lon = _offset_point(hood["lat"], hood["lon"], 0.7, self.seed, "addr", t)
                    return lat, lon, raw, hood["city"]
        if city_row is None:
            city_row = cities[_norm("San Francisco")]
        spread = 1.0 if re.search(r"\b(downtown|city hall|city center|centre)\b", t) else 9.0
        lat, lon = _offset_point(city_row["lat"], city_row["lon"], spread, self.seed, "addr", t)
        return lat, lon, raw, city_row["name"]

    def calculate_commute(self, origin_address: str, destination_address: str, mode: str = "driving") -> ToolOutput:
        """Distance and travel time between two places by ``mode`` (driving, transit, walking, bicycling).

        Distances are great-circle distances times 1.3 (a typical road detour factor); speeds are fixed per mode
        (driving 32 km/h door to door plus 5 min parking, transit 18 km/h plus 9 min waiting, walking 4.8 km/h,
        bicycling 15 km/h plus 2 min).
        """
        m = _norm(mode or "driving")
        modes = {
            "driving": ("drive", "driving", "car", "auto", "taxi", "uber", "lyft"),
            "transit": ("transit", "public", "bus", "subway", "metro", "train", "rail", "light rail", "tram"),
            "walking": ("walk", "walking", "foot", "on foot"),
            "bicycling": ("bike", "biking", "bicycle", "bicycling", "cycling", "cycle", "scooter"),
        }
        chosen = next((k for k, words in modes.items() if any(re.search(rf"\b{w}", m) for w in words)), None)
        if chosen is None:
            raise ToolError(f"mode must be driving, transit, walking or bicycling, got {mode!r}", field="mode")
        try:
            lat1, lon1, label1, city1 = self._locate(origin_address, None)
        except ToolError as exc:
            raise ToolError(str(exc), field="origin_address") from None
        try:
            lat2, lon2, label2, _ = self._locate(destination_address, city1)
        except ToolError as exc:
            raise ToolError(str(exc).replace("address", "destination_address"), field="destination_address") from None
        km = max(0.3, _haversine_km(lat1, lon1, lat2, lon2) * 1.3)
        minutes = {
            "driving": km / 32 * 60 + 5,
            "transit": km / 18 * 60 + 9,
            "walking": km / 4.8 * 60,
            "bicycling": km / 15 * 60 + 2,
        }[chosen]
        miles = km / 1.609344
        verb = {"driving": "Driving", "transit": "Transit", "walking": "Walking", "bicycling": "Cycling"}[chosen]
        text = (
            f"{verb} from {label1} to {label2} is about {miles:.1f} miles ({km:.1f} km) and takes about "
            f"{_fmt_duration(max(1, round(minutes)))}."
        )
        return ToolOutput(
            text,
            {
                "mode": chosen,
                "distance_km": round(km, 1),
                "distance_miles": round(miles, 1),
                "duration_min": max(1, round(minutes)),
            },
        )

    def update_search_filter(self, filter_name: str, value: Any) -> ToolOutput:
        """Save (or clear, with a null/"none" value) one apartment-search filter; later searches apply it."""
        key = _norm(filter_name).replace(" ", "_")
        if not key:
            raise ToolError("filter_name is empty; say e.g. 'pets_allowed' or 'max_price'", field="filter_name")
        key = _FILTER_ALIASES.get(key, key)
        label = key.replace("_", " ")
        clear = value is None or (
            isinstance(value, str) and _norm(value) in {"", "none", "null", "clear", "remove", "any"}
        )
        if key in _BOOL_FILTERS and isinstance(value, str) and _norm(value) in {"none", "no"}:
            clear = False
        if clear:
            with self._tx() as conn:
                conn.execute("DELETE FROM search_filters WHERE filter_name = ?", (key,))
            return ToolOutput(f"Cleared the {label} filter; apartment searches no longer use it.", {key: None})
        if key in _BOOL_FILTERS:
            parsed = _parse_bool(value)
            if parsed is None:
                raise ToolError(f"filter {key} takes yes or no, got {value!r}", field="value")
            shown = "yes" if parsed else "no"
        elif key in _NUMBER_FILTERS:
            parsed = _parse_number(value)
            if parsed is None or parsed < 0:
                raise ToolError(f"filter {key} takes a number, got {value!r}", field="value")
            shown = _money(parsed) if key == "max_price" else f"{parsed:g}"
        else:
            parsed = value if isinstance(value, int | float | bool | list | dict) else " ".join(str(value).split())
            shown = json.dumps(parsed) if isinstance(parsed, list | dict) else str(parsed)
        with self._tx() as conn:
            seq = self._next(conn, "filter")
            conn.execute(
                "INSERT OR REPLACE INTO search_filters (filter_name, value, seq) VALUES (?, ?, ?)",
                (key, json.dumps(parsed), seq),
            )
        return ToolOutput(
            f"Set the {label} filter to {shown}; your next apartment search uses it.", {key: parsed, "seq": seq}
        )

    # ------------------------------------------------------------------ ecommerce_support

    def track_order(self, order_id: str) -> ToolOutput:
        """Status, carrier, tracking number and delivery date of an order (unknown ids are materialised)."""
        raw = str(order_id).strip()
        cleaned = re.sub(r"(?i)\b(order|number|no|num|id|hash|pound)\b\.?", " ", raw)
        key = re.sub(r"[^A-Z0-9]", "", cleaned.upper())
        if not key:
            raise ToolError(f"order_id {order_id!r} has no letters or digits", field="order_id")
        row = self._order_row(key)
        if row is None:
            display = "-".join(re.findall(r"[A-Z0-9]+", cleaned.upper()))
            if key.isdigit():
                display = f"ORD-{key}"
                key = f"ORD{key}"
            with self._tx() as conn:
                if conn.execute("SELECT 1 FROM orders WHERE order_key = ?", (key,)).fetchone() is None:
                    self._add_order(conn, self.seed, display)
            row = self._order_row(key)
            assert row is not None
        today = self.today()
        placed = today + timedelta(days=row["placed_offset"])
        ship = today + timedelta(days=row["ship_offset"])
        eta = today + timedelta(days=row["eta_offset"])
        item = f"{row['quantity']} x {row['item']}" if row["quantity"] > 1 else row["item"]
        status = row["status"]
        if status == "processing":
            text = (
                f"Order {row['order_id']} ({item}, {_money(row['total'])}) was placed on {_fmt_short_date(placed)} "
                f"and is being prepared; it should ship by {_fmt_short_date(ship)} with {row['carrier']} and "
                f"arrive around {_fmt_short_date(eta)}."
            )
        elif status in ("shipped", "in transit"):
            text = (
                f"Order {row['order_id']} ({item}) shipped with {row['carrier']} on {_fmt_short_date(ship)} and is "
                f"in transit, tracking number {row['tracking']}; expected delivery {_fmt_short_date(eta)}."
            )
        elif status == "out for delivery":
            text = (
                f"Order {row['order_id']} ({item}) is out for delivery today with {row['carrier']}, tracking "
                f"number {row['tracking']}."
            )
        else:
            text = f"Order {row['order_id']} ({item}) was delivered by {row['carrier']} on {_fmt_short_date(eta)}."
        return ToolOutput(
            text,
            {
                "order_id": row["order_id"],
                "status": status,
                "item": row["item"],
                "quantity": row["quantity"],
                "total": row["total"],
                "carrier": row["carrier"],
                "tracking_number": row["tracking"],
                "estimated_delivery": eta.isoformat(),
            },
        )

    def _order_row(self, key: str) -> sqlite3.Row | None:
        rows = self._q("SELECT * FROM orders WHERE order_key = ?", (key,))
        if rows:
            return rows[0]
        digits = re.sub(r"\D", "", key)
        if len(digits) >= 4 and digits == key:
            rows = self._q("SELECT * FROM orders WHERE order_key = ?", (f"ORD{digits}",))
            if rows:
                return rows[0]
        return None

    def _score_products(self, query: str) -> list[tuple[float, sqlite3.Row]]:
        words = _tokens(query)
        text = " " + " ".join(words) + " "
        scored = []
        for row in self._q("SELECT * FROM products ORDER BY product_id"):
            name_tokens = set(_tokens(row["name"])) | {_norm(row["brand"])}
            category_tokens = set(_tokens(row["category"]))
            score = sum(1.0 for w in words if w in name_tokens) + sum(1.0 for w in words if w in category_tokens)
            for keyword in json.loads(row["keywords"]):
                kw = " ".join(_tokens(keyword))
                if kw and f" {kw} " in text:
                    score += 1.5 if " " in kw else 0.75
            if score > 0:
                scored.append((score, row))
        scored.sort(key=lambda sr: (-sr[0], -sr[1]["rating"], sr[1]["price"]))
        return scored

    def search_products(self, query: str, max_price: float | None = None) -> ToolOutput:
        """Best-matching products for ``query`` (optionally at or under ``max_price``), top three."""
        q = " ".join(str(query).split())
        if not _tokens(q):
            raise ToolError(f"query {query!r} has no searchable words", field="query")
        if max_price is not None and max_price <= 0:
            raise ToolError(f"max_price must be positive, got {max_price}", field="max_price")
        scored = self._score_products(q)
        if not scored and self._materialisable(q):
            self._materialise_products(q)
            scored = self._score_products(q)
        best = scored[0][0] if scored else 0
        relevant = [row for score, row in scored if score >= best * 0.5]
        within = [row for row in relevant if max_price is None or row["price"] <= max_price + 1e-9]
        under = f" under {_money(max_price)}" if max_price is not None else ""
        with self._tx() as conn:
            self._set_meta(conn, "last_products", json.dumps([r["product_id"] for r in within[:3]]))
        if not within:
            if relevant:
                cheapest = min(relevant, key=lambda r: r["price"])
                text = (
                    f"No {q} found{under}; the cheapest match is {cheapest['product_id']} {cheapest['name']} at "
                    f"{_money(cheapest['price'])}."
                )
            else:
                text = f"No products match {q}{under}."
            return ToolOutput(text, {"query": q, "products": []})
        products = [
            {
                "product_id": r["product_id"],
                "name": r["name"],
                "price": r["price"],
                "rating": r["rating"],
                "in_stock": r["stock"],
            }
            for r in within[:3]
        ]
        parts = [f"{p['product_id']} {p['name']}, {_money(p['price'])}, rated {p['rating']}" for p in products]
        head = "Top result" if len(products) == 1 else f"Top {len(products)} results"
        text = f"{head} for {q}{under}: " + "; ".join(parts) + "."
        return ToolOutput(text, {"query": q, "products": products})

    def _materialisable(self, query: str) -> bool:
        """A short concrete noun phrase ("garden hose"), not a vague wish ("something nice for my mom")."""
        if not re.fullmatch(r"[A-Za-z][A-Za-z '\-]{1,40}", query):
            return False
        words = [w for w in _norm(query).split() if w not in _STOPWORDS]
        return 0 < len(words) <= 3 and not any(w in _VAGUE for w in _norm(query).split())

    def _materialise_products(self, query: str) -> None:
        words = [w for w in _norm(query).split() if w not in _STOPWORDS]
        if not words:
            return
        stem = " ".join(w.capitalize() for w in words)
        rng = _rng(self.seed, "product", stem.lower())
        base = rng.uniform(15, 180)
        with self._tx() as conn:
            if conn.execute("SELECT 1 FROM products WHERE lower(category) = ?", (stem.lower(),)).fetchone():
                return
            brands = rng.sample(D.BRANDS, 3)
            for tier, factor, brand in zip(("", " Plus", " Pro"), (0.8, 1.0, 1.6), brands, strict=True):
                number = 2000 + self._next(conn, "product")
                conn.execute(
                    "INSERT INTO products VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        f"P-{number}",
                        f"{brand} {stem}{tier}",
                        brand,
                        stem.lower(),
                        json.dumps([stem.lower()]),
                        max(4.99, round(base * factor) - 0.01),
                        round(rng.uniform(3.5, 4.8), 1),
                        rng.randint(5, 120),
                    ),
                )

    def _product(self, text: str) -> sqlite3.Row:
        raw = str(text).strip()
        compact = re.sub(r"[^A-Z0-9]", "", raw.upper())
        if m := re.fullmatch(r"(?:P|PRODUCT|SKU|ITEM)?(\d{3,6})", compact):
            rows = self._q("SELECT * FROM products WHERE product_id = ?", (f"P-{int(m.group(1))}",))
            if rows:
                return rows[0]
        if re.search(r"[A-Za-z]{3}", raw):
            last = json.loads(self._meta("last_products") or "[]")
            scored = self._score_products(raw)
            if scored:
                top = scored[0][0]
                best = [row for score, row in scored if score == top]
                best.sort(key=lambda r: (r["product_id"] not in last, -difflib.SequenceMatcher(
                    None, _norm(raw), _norm(r["name"])).ratio()))  # fmt: skip
                return best[0]
        raise ToolError(
            f"no product {raw!r}; use a product_id from search_products (like 'P-1001')", field="product_id"
        )

    def add_to_cart(self, product_id: str, quantity: int) -> ToolOutput:
        """Put ``quantity`` of a product in the cart; reports the cart's item count and subtotal."""
        if quantity < 1 or quantity > 99:
            raise ToolError(f"quantity must be between 1 and 99, got {quantity}", field="quantity")
        product = self._product(product_id)
        with self._tx() as conn:
            have = conn.execute("SELECT quantity FROM cart WHERE product_id = ?", (product["product_id"],)).fetchone()
            total_qty = quantity + (have[0] if have else 0)
            if total_qty > product["stock"]:
                raise ToolError(
                    f"only {product['stock']} of {product['product_id']} in stock (cart would hold {total_qty})",
                    field="quantity",
                )
            seq = self._next(conn, "cart")
            conn.execute(
                "INSERT INTO cart (product_id, quantity, seq) VALUES (?, ?, ?) ON CONFLICT(product_id) DO UPDATE "
                "SET quantity = quantity + excluded.quantity, seq = excluded.seq",
                (product["product_id"], quantity, seq),
            )
            items, subtotal = conn.execute(
                "SELECT COALESCE(SUM(c.quantity), 0), COALESCE(SUM(c.quantity * p.price), 0) FROM cart c "
                "JOIN products p ON p.product_id = c.product_id"
            ).fetchone()
        noun = "item" if items == 1 else "items"
        text = (
            f"Added {quantity} x {product['name']} ({product['product_id']}) at {_money(product['price'])} each to "
            f"your cart; the cart now has {items} {noun}, subtotal {_money(subtotal)}."
        )
        return ToolOutput(
            text,
            {
                "product_id": product["product_id"],
                "name": product["name"],
                "quantity": quantity,
                "cart_items": int(items),
                "cart_subtotal": round(float(subtotal), 2),
            },
        )

    # ------------------------------------------------------------------ inspection (tests, debugging)

    def cart(self) -> list[dict[str, Any]]:
        """Cart rows: product_id, name, quantity, price (oldest first)."""
        rows = self._q(
            "SELECT c.product_id, p.name, c.quantity, p.price FROM cart c JOIN products p "
            "ON p.product_id = c.product_id ORDER BY c.rowid"
        )
        return [dict(r) for r in rows]

    def bookings(self) -> list[dict[str, Any]]:
        """Flight bookings, oldest first."""
        return [dict(r) for r in self._q("SELECT * FROM bookings ORDER BY id")]

    def search_filters(self) -> dict[str, Any]:
        """Saved apartment-search filters by name."""
        return self._filters()

    def identity_docs(self) -> dict[str, str]:
        """Document numbers on file by type (``passport``, ``id_card``)."""
        return {r["doc_type"]: r["doc_number"] for r in self._q("SELECT * FROM identity_docs")}
