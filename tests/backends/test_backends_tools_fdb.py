"""The 12 Full-Duplex-Bench v3 tools over the SQLite mock world: realistic calls, coercion, errors, persistence."""

from __future__ import annotations

import re
import sqlite3
from collections.abc import AsyncIterator
from datetime import date
from pathlib import Path

import pytest

from cspan.backends.errors import ToolError
from cspan.backends.tools import ToolBank
from cspan.backends.tools.catalog import fdb_v3_bank
from cspan.backends.tools.fdb_v3 import FDB_V3_DOMAINS, FDB_V3_TOOL_NAMES, fdb_v3_tools
from cspan.backends.tools.world import MockWorld, parse_date

TODAY = date(2026, 5, 1)  # a Friday


@pytest.fixture
async def world() -> AsyncIterator[MockWorld]:
    w = MockWorld(None, today=TODAY)
    yield w
    w.close()


@pytest.fixture
def bank(world: MockWorld) -> ToolBank:
    return ToolBank(fdb_v3_tools(world))


def test_toolpack_matches_the_benchmark_table() -> None:
    bank = fdb_v3_bank(confirm_actions=False)
    assert bank.names() == list(FDB_V3_TOOL_NAMES)
    assert len(FDB_V3_TOOL_NAMES) == 12
    assert {d: tuple(n) for d, n in bank.domains().items()} == FDB_V3_DOMAINS
    required = {t.name: t.json_schema().get("required", []) for t in bank.tools()}
    assert required == {
        "search_flights": ["destination", "date"],
        "book_flight": ["passenger_name"],
        "update_identity_doc": ["doc_type", "doc_number"],
        "get_card_benefits": ["card_type"],
        "get_exchange_rate": ["amount", "from_currency", "to_currency"],
        "modify_autopay": ["bill_type", "source_account"],
        "search_apartments": ["city", "bedrooms", "max_price"],
        "calculate_commute": ["origin_address", "destination_address"],
        "update_search_filter": ["filter_name", "value"],
        "track_order": ["order_id"],
        "search_products": ["query"],
        "add_to_cart": ["product_id", "quantity"],
    }
    props = bank.get("search_apartments").json_schema()["properties"]
    assert (props["bedrooms"]["type"], props["max_price"]["type"]) == ("integer", "number")
    assert bank.get("calculate_commute").json_schema()["properties"]["mode"]["default"] == "driving"
    kinds = {t.name for t in bank.tools() if t.kind == "action"}
    assert kinds == {"book_flight", "update_identity_doc", "modify_autopay", "update_search_filter", "add_to_cart"}
    assert all(len(t.description) <= 300 for t in bank.tools())


async def test_search_then_book_a_flight(bank: ToolBank, world: MockWorld) -> None:
    found = await bank.call("search_flights", {"destination": "Vegas", "date": "May 6th"})
    assert found.data["destination"] == "LAS" and found.data["date"] == "2026-05-06"
    flights = found.data["flights"]
    assert len(flights) == 3
    assert all(f["flight_id"].endswith("-20260506") and f["price_usd"] > 0 for f in flights)
    assert "San Francisco (SFO) to Las Vegas (LAS) on Wednesday, May 6, 2026" in found.text
    assert flights[0]["flight_number"] in found.text

    chosen = flights[1]
    booked = await bank.call("book_flight", {"passenger_name": "maria garcia", "flight_id": chosen["flight_id"]})
    assert booked.data["passenger_name"] == "Maria Garcia"
    assert booked.data["flight_id"] == chosen["flight_id"]
    assert re.fullmatch(r"[A-Z2-9]{6}", booked.data["confirmation"])
    assert f"confirmation code {booked.data['confirmation']}" in booked.text
    assert f"${chosen['price_usd']}" in booked.text

    # without flight_id: the first flight of the last search
    default = await bank.call("book_flight", {"passenger_name": "Maria Garcia"})
    assert default.data["flight_id"] == flights[0]["flight_id"]
    assert default.data["confirmation"] != booked.data["confirmation"]
    assert [b["flight_id"] for b in world.bookings()] == [chosen["flight_id"], flights[0]["flight_id"]]


async def test_flight_errors_name_the_field(bank: ToolBank) -> None:
    with pytest.raises(ToolError, match="no flight chosen") as info:
        await bank.call("book_flight", {"passenger_name": "Sam Lee"})
    assert info.value.field == "flight_id"
    with pytest.raises(ToolError, match="cannot read the date") as info:
        await bank.call("search_flights", {"destination": "Tokyo", "date": "someday"})
    assert info.value.field == "date"
    with pytest.raises(ToolError, match="in the past") as info:
        await bank.call("search_flights", {"destination": "Tokyo", "date": "2026-04-01"})
    assert info.value.field == "date"
    nowhere = await bank.call("search_flights", {"destination": "Atlantis", "date": "May 9"})
    assert nowhere.data["flights"] == [] and nowhere.text.startswith("No flights to Atlantis")


async def test_update_identity_doc(bank: ToolBank, world: MockWorld) -> None:
    old = world.identity_docs()["passport"]
    result = await bank.call("update_identity_doc", {"doc_type": "Passport", "doc_number": "x12 345-678"})
    assert result.data["doc_number"] == "X12345678"
    assert world.identity_docs()["passport"] == "X12345678"
    assert (
        result.text
        == f"Updated your passport number to X12345678, replacing the one ending in {old[-4:]}; reference DOC-000001."
    )
    second = await bank.call("update_identity_doc", {"doc_type": "id card", "doc_number": "D7654321"})
    assert second.data == {**second.data, "doc_type": "id_card", "reference": "DOC-000002"}
    with pytest.raises(ToolError) as info:
        await bank.call("update_identity_doc", {"doc_type": "library card", "doc_number": "1234567"})
    assert info.value.field == "doc_type"


async def test_card_benefits(bank: ToolBank) -> None:
    gold = await bank.call("get_card_benefits", {"card_type": "the gold card"})
    assert gold.data["card_type"] == "gold" and gold.data["annual_fee"] == 250
    assert gold.text.startswith("The Gold card has a $250 annual fee")
    assert "dining credit" in gold.text
    cash = await bank.call("get_card_benefits", {"card_type": "cash back"})
    assert "no annual fee" in cash.text
    unknown = await bank.call("get_card_benefits", {"card_type": "diamond"})
    assert unknown.data["card_type"] is None and "platinum" in unknown.text


async def test_exchange_rate_is_amount_times_rate(bank: ToolBank) -> None:
    result = await bank.call("get_exchange_rate", {"amount": "100", "from_currency": "dollars", "to_currency": "EUR"})
    assert result.arguments == {"amount": 100.0, "from_currency": "dollars", "to_currency": "EUR"}
    rate = 1.0 / 1.085
    assert result.data["rate"] == pytest.approx(rate, rel=1e-6)
    assert result.data["converted"] == pytest.approx(100 * rate, abs=0.005)
    assert result.text == "100 US dollars is 92.17 euros, at 1 USD = 0.9217 EUR."
    yen = await bank.call("get_exchange_rate", {"amount": 250, "from_currency": "pounds", "to_currency": "yen"})
    assert yen.data["converted"] == pytest.approx(250 * 1.27 / 0.00665, abs=0.5)
    assert "47,744 Japanese yen" in yen.text  # no decimals for yen
    with pytest.raises(ToolError) as info:
        await bank.call("get_exchange_rate", {"amount": 5, "from_currency": "USD", "to_currency": "doubloons"})
    assert info.value.field == "to_currency"
    with pytest.raises(ToolError) as info:
        await bank.call("get_exchange_rate", {"amount": -5, "from_currency": "USD", "to_currency": "EUR"})
    assert info.value.field == "amount"


async def test_modify_autopay(bank: ToolBank) -> None:
    result = await bank.call("modify_autopay", {"bill_type": "electric bill", "source_account": "my savings"})
    assert result.data == {
        "bill_type": "electricity",
        "payee": "City Power & Light",
        "account": "High-Yield Savings",
        "last4": "3307",
        "confirmation": "AP-000001",
    }
    assert "now draws from your High-Yield Savings account ending in 3307" in result.text
    again = await bank.call("modify_autopay", {"bill_type": "electricity", "source_account": "savings"})
    assert "already draws" in again.text and again.data["confirmation"] == "AP-000002"
    by_digits = await bank.call("modify_autopay", {"bill_type": "phone", "source_account": "account ending in 4821"})
    assert by_digits.data["account"] == "Everyday Checking"


async def test_search_apartments_with_coercion_and_filters(bank: ToolBank, world: MockWorld) -> None:
    result = await bank.call("search_apartments", {"city": "seattle", "bedrooms": "2", "max_price": "3000"})
    assert result.arguments == {"city": "seattle", "bedrooms": 2, "max_price": 3000.0}
    listings = result.data["listings"]
    assert listings and result.data["city"] == "Seattle"
    assert all(a["bedrooms"] == 2 and a["rent"] <= 3000 for a in listings)
    assert [a["rent"] for a in listings] == sorted(a["rent"] for a in listings)
    assert listings[0]["listing_id"] in result.text and "in Seattle at or under $3,000 a month" in result.text

    saved = await bank.call("update_search_filter", {"filter_name": "pets allowed", "value": "yes"})
    assert saved.text == "Set the pets allowed filter to yes; your next apartment search uses it."
    assert world.search_filters() == {"pets_allowed": True}
    filtered = await bank.call("search_apartments", {"city": "Seattle", "bedrooms": 2, "max_price": 3000})
    assert filtered.data["listings"] and all(a["pets_allowed"] for a in filtered.data["listings"])
    assert "(filters: pets allowed)" in filtered.text
    assert {a["listing_id"] for a in filtered.data["listings"]} <= {a["listing_id"] for a in listings}

    price = await bank.call("update_search_filter", {"filter_name": "budget", "value": "$2,500"})
    assert price.data["max_price"] == 2500.0
    cleared = await bank.call("update_search_filter", {"filter_name": "pets_allowed", "value": None})
    assert cleared.text.startswith("Cleared the pets allowed filter")
    assert world.search_filters() == {"max_price": 2500.0}
    with pytest.raises(ToolError) as info:
        await bank.call("update_search_filter", {"filter_name": "parking", "value": "purple"})
    assert info.value.field == "value"

    none = await bank.call("search_apartments", {"city": "Seattle", "bedrooms": 3, "max_price": 500})
    assert none.data["listings"] == [] and none.text.startswith("No 3-bedroom apartments in Seattle")


async def test_calculate_commute(bank: ToolBank) -> None:
    found = await bank.call("search_apartments", {"city": "Austin", "bedrooms": 1, "max_price": 2500})
    listing = found.data["listings"][0]["listing_id"]
    drive = await bank.call("calculate_commute", {"origin_address": listing, "destination_address": "downtown Austin"})
    transit = await bank.call(
        "calculate_commute", {"origin_address": listing, "destination_address": "downtown Austin", "mode": "bus"}
    )
    walk = await bank.call(
        "calculate_commute", {"origin_address": listing, "destination_address": "downtown Austin", "mode": "walking"}
    )
    assert drive.arguments["mode"] == "driving" and transit.data["mode"] == "transit"
    assert drive.data["distance_km"] == transit.data["distance_km"] == walk.data["distance_km"]
    assert 0.3 <= drive.data["distance_km"] < 30  # inside one city
    assert drive.data["duration_min"] < transit.data["duration_min"] < walk.data["duration_min"]
    assert drive.text.startswith("Driving from ") and "miles" in drive.text
    repeat = await bank.call("calculate_commute", {"origin_address": listing, "destination_address": "downtown Austin"})
    assert repeat.text == drive.text
    with pytest.raises(ToolError) as info:
        await bank.call("calculate_commute", {"origin_address": "a", "destination_address": "b", "mode": "teleport"})
    assert info.value.field == "mode"


async def test_track_order(bank: ToolBank, world: MockWorld) -> None:
    known = world._q("SELECT order_id, status FROM orders ORDER BY order_key LIMIT 1")[0]
    digits = known["order_id"].split("-")[1]
    result = await bank.call("track_order", {"order_id": int(digits)})  # a number is coerced to a string
    assert result.arguments == {"order_id": digits}
    assert result.data["order_id"] == known["order_id"] and result.data["status"] == known["status"]
    assert result.text.startswith(f"Order {known['order_id']} (")
    spoken = await bank.call("track_order", {"order_id": f"order number {digits}"})
    assert spoken.text == result.text
    fresh = await bank.call("track_order", {"order_id": "A-77 31"})
    assert fresh.data["order_id"] == "A-77-31" and fresh.data["carrier"] in {"UPS", "FedEx", "USPS", "DHL"}
    again = await bank.call("track_order", {"order_id": "a7731"})
    assert again.text == fresh.text
    with pytest.raises(ToolError) as info:
        await bank.call("track_order", {"order_id": "#"})
    assert info.value.field == "order_id"


async def test_search_products_and_add_to_cart(bank: ToolBank, world: MockWorld) -> None:
    found = await bank.call("search_products", {"query": "running shoes", "max_price": "150"})
    products = found.data["products"]
    assert products and all(p["price"] <= 150 for p in products)
    assert any("Running Shoes" in p["name"] for p in products)
    first = products[0]
    assert found.text.startswith("Top ") and first["product_id"] in found.text

    added = await bank.call("add_to_cart", {"product_id": first["product_id"], "quantity": "2"})
    assert added.arguments == {"product_id": first["product_id"], "quantity": 2}
    assert added.data["cart_items"] == 2
    assert added.data["cart_subtotal"] == pytest.approx(2 * first["price"])
    spoken_id = first["product_id"].replace("-", " ").lower()  # "p 1040"
    more = await bank.call("add_to_cart", {"product_id": spoken_id, "quantity": 1})
    assert more.data["cart_items"] == 3
    assert world.cart() == [
        {"product_id": first["product_id"], "name": first["name"], "quantity": 3, "price": first["price"]}
    ]
    with pytest.raises(ToolError) as info:
        await bank.call("add_to_cart", {"product_id": "Q-9", "quantity": 1})
    assert info.value.field == "product_id"
    with pytest.raises(ToolError) as info:
        await bank.call("add_to_cart", {"product_id": first["product_id"], "quantity": 0})
    assert info.value.field == "quantity"
    none = await bank.call("search_products", {"query": "something nice for my mom"})
    assert none.data["products"] == []


async def test_same_seed_same_world() -> None:
    a, b = MockWorld(None, today=TODAY), MockWorld(None, today=TODAY)
    try:
        bank_a, bank_b = ToolBank(fdb_v3_tools(a)), ToolBank(fdb_v3_tools(b))
        calls = [
            ("search_flights", {"destination": "Tokyo", "date": "June 10"}),
            ("book_flight", {"passenger_name": "Kim Lee"}),
            ("search_apartments", {"city": "Boise", "bedrooms": 1, "max_price": 2000}),
            ("track_order", {"order_id": "88213"}),
            ("search_products", {"query": "garden hose"}),
        ]
        for name, args in calls:
            ra, rb = await bank_a.call(name, args), await bank_b.call(name, args)
            assert (ra.text, ra.data) == (rb.text, rb.data)
    finally:
        a.close()
        b.close()


async def test_world_persists_in_sqlite_across_banks(tmp_path: Path) -> None:
    path = tmp_path / "state" / "world.sqlite"
    bank = fdb_v3_bank(path, confirm_actions=False)
    found = await bank.call("search_products", {"query": "desk lamp"})
    product = found.data["products"][0]["product_id"]
    await bank.call("add_to_cart", {"product_id": product, "quantity": 2})
    await bank.call("update_search_filter", {"filter_name": "parking", "value": True})
    await bank.call("search_flights", {"destination": "Boston", "date": "2031-03-03"})
    first = await bank.call("book_flight", {"passenger_name": "Ana Silva"})
    await bank.aclose()
    assert path.is_file()

    again = fdb_v3_bank(path, confirm_actions=False)
    try:
        more = await again.call("add_to_cart", {"product_id": product, "quantity": 1})
        assert more.data["cart_items"] == 3
        rentals = await again.call("search_apartments", {"city": "Denver", "bedrooms": 1, "max_price": 4000})
        assert "(filters: parking)" in rentals.text
        second = await again.call("book_flight", {"passenger_name": "Ana Silva"})  # last search survived too
        assert second.data["flight_id"] == first.data["flight_id"]
        assert second.data["confirmation"] != first.data["confirmation"]
    finally:
        await again.aclose()
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT COUNT(*) FROM bookings").fetchone()[0] == 2
        assert conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0] == "1"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2026-05-06", date(2026, 5, 6)),
        ("May 6th", date(2026, 5, 6)),
        ("the 20th of August", date(2026, 8, 20)),
        ("March 3", date(2027, 3, 3)),  # already passed this year
        ("5/6/2027", date(2027, 5, 6)),
        ("tomorrow", date(2026, 5, 2)),
        ("next Friday", date(2026, 5, 8)),
        ("Tuesday", date(2026, 5, 5)),
        ("in 10 days", date(2026, 5, 11)),
    ],
)
def test_parse_date(text: str, expected: date) -> None:
    assert parse_date(text, TODAY) == expected


def test_parse_date_rejects_impossible_days() -> None:
    with pytest.raises(ToolError, match="not a real calendar day"):
        parse_date("February 30", TODAY)
