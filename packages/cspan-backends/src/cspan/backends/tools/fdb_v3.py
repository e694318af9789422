"""The 12 Full-Duplex-Bench v3 tools over the mock world.

Names, domains and parameters follow the benchmark's toolpack (``docs/reference/context-spanning-original.md``
section 4.7, table "Full-Duplex-Bench v3 toolpack"; upstream ``Full-Duplex-Bench/v3/mock_apis.py``): the required
parameters are exactly the table's. One optional parameter is added where a chain needs it and the table leaves
it implicit: ``book_flight.flight_id`` (a ``flight_id`` from ``search_flights``; default the first flight of the
last search), since the benchmark's expected calls may reference ``$RESULT_0.flights[0].flight_id``. Each
description stays under 300 characters and gives one typical call and the chain it belongs to, with made-up
values that are not benchmark answers.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from cspan.backends.tools.bank import Tool, ToolArgs, ToolOutput
from cspan.backends.tools.world import MockWorld

__all__ = ["FDB_V3_DOMAINS", "FDB_V3_TOOL_NAMES", "fdb_v3_tools"]

FDB_V3_DOMAINS: dict[str, tuple[str, ...]] = {
    "travel_identity": ("search_flights", "book_flight", "update_identity_doc"),
    "finance_billing": ("get_card_benefits", "get_exchange_rate", "modify_autopay"),
    "housing_location": ("search_apartments", "calculate_commute", "update_search_filter"),
    "ecommerce_support": ("track_order", "search_products", "add_to_cart"),
}
FDB_V3_TOOL_NAMES: tuple[str, ...] = tuple(name for names in FDB_V3_DOMAINS.values() for name in names)


class SearchFlightsArgs(ToolArgs):
    destination: str = Field(description="Destination city or airport code, e.g. 'Denver' or 'DEN'.")
    date: str = Field(description="Travel date as spoken or ISO, e.g. 'March 3' or '2026-03-03'.")


class BookFlightArgs(ToolArgs):
    passenger_name: str = Field(description="Full name of the traveller.")
    flight_id: str | None = Field(
        default=None, description="flight_id from search_flights; omit to book the first flight of the last search."
    )


class UpdateIdentityDocArgs(ToolArgs):
    doc_type: str = Field(description="'passport' or 'id_card'.")
    doc_number: str = Field(description="The new document number, letters and digits.")


class CardBenefitsArgs(ToolArgs):
    card_type: str = Field(description="Card product, e.g. 'gold' or 'travel_rewards'.")


class ExchangeRateArgs(ToolArgs):
    amount: float = Field(description="Amount to convert (a number).")
    from_currency: str = Field(description="Source currency, ISO code or name, e.g. 'USD'.")
    to_currency: str = Field(description="Target currency, ISO code or name, e.g. 'EUR'.")


class ModifyAutopayArgs(ToolArgs):
    bill_type: str = Field(description="Which bill, e.g. 'electricity', 'internet', 'phone'.")
    source_account: str = Field(description="Account to pay from, e.g. 'savings' or 'checking'.")


class SearchApartmentsArgs(ToolArgs):
    city: str = Field(description="City to search in.")
    bedrooms: int = Field(description="Number of bedrooms (0 for a studio).")
    max_price: float = Field(description="Maximum monthly rent in US dollars.")


class CalculateCommuteArgs(ToolArgs):
    origin_address: str = Field(description="Start address, place or listing id.")
    destination_address: str = Field(description="End address or place, e.g. a workplace.")
    mode: str = Field(default="driving", description="driving, transit, walking or bicycling.")


class UpdateSearchFilterArgs(ToolArgs):
    filter_name: str = Field(description="Filter in snake_case, e.g. 'pets_allowed', 'parking', 'max_price'.")
    value: Any = Field(description="New value: true/false, a number or text; null clears the filter.")


class TrackOrderArgs(ToolArgs):
    order_id: str = Field(description="Order number as given by the user.")


class SearchProductsArgs(ToolArgs):
    query: str = Field(description="What to look for, e.g. 'wireless mouse'.")
    max_price: float | None = Field(default=None, description="Optional price ceiling in US dollars.")


class AddToCartArgs(ToolArgs):
    product_id: str = Field(description="product_id from search_products, e.g. 'P-1001'.")
    quantity: int = Field(description="How many units (1-99).")


_SPECS: list[tuple[str, str, str, type[ToolArgs], str]] = [
    (
        "search_flights",
        "travel_identity",
        "read",
        SearchFlightsArgs,
        "Find flights from the user's home airport to a destination on a date; returns flight_ids, times, fares. "
        "Typical: 'flights to Denver on March 3' -> search_flights(destination='Denver', date='March 3'). "
        "Precedes book_flight.",
    ),
    (
        "book_flight",
        "travel_identity",
        "action",
        BookFlightArgs,
        "Book a flight for a passenger; flight_id comes from search_flights (default: first result of the last "
        "search). Typical: 'book it for Sam Lee' -> book_flight(passenger_name='Sam Lee'). "
        "Call after search_flights.",
    ),
    (
        "update_identity_doc",
        "travel_identity",
        "action",
        UpdateIdentityDocArgs,
        "Update the traveller's passport or ID card number on file. Typical: 'my new passport number is "
        "X1234567' -> update_identity_doc(doc_type='passport', doc_number='X1234567'). Often before booking.",
    ),
    (
        "get_card_benefits",
        "finance_billing",
        "read",
        CardBenefitsArgs,
        "Annual fee, APR and benefits of a credit card product. Typical: 'what does the gold card give me' -> "
        "get_card_benefits(card_type='gold').",
    ),
    (
        "get_exchange_rate",
        "finance_billing",
        "read",
        ExchangeRateArgs,
        "Convert an amount between currencies (amount times rate). Typical: 'how much is 80 dollars in yen' -> "
        "get_exchange_rate(amount=80, from_currency='USD', to_currency='JPY').",
    ),
    (
        "modify_autopay",
        "finance_billing",
        "action",
        ModifyAutopayArgs,
        "Change which account pays a bill automatically. Typical: 'pay my water bill from checking' -> "
        "modify_autopay(bill_type='water', source_account='checking').",
    ),
    (
        "search_apartments",
        "housing_location",
        "read",
        SearchApartmentsArgs,
        "Apartment listings in a city by bedrooms and maximum monthly rent; saved filters apply. Typical: "
        "'a one-bedroom in Austin under 1500' -> search_apartments(city='Austin', bedrooms=1, max_price=1500). "
        "Before calculate_commute.",
    ),
    (
        "calculate_commute",
        "housing_location",
        "read",
        CalculateCommuteArgs,
        "Distance and travel time between two addresses or a listing_id and a place, by driving, transit, walking "
        "or bicycling. Typical: 'how long by bus from APT-1001 to downtown' -> calculate_commute(origin_address="
        "'APT-1001', destination_address='downtown', mode='transit').",
    ),
    (
        "update_search_filter",
        "housing_location",
        "action",
        UpdateSearchFilterArgs,
        "Save an apartment search filter used by later searches (pets_allowed, parking, laundry, furnished, "
        "max_price, min_sqft, neighborhood). Typical: 'only places with parking' -> "
        "update_search_filter(filter_name='parking', value=true).",
    ),
    (
        "track_order",
        "ecommerce_support",
        "read",
        TrackOrderArgs,
        "Status, carrier, tracking number and delivery date of an order. Typical: 'where is order 55123' -> "
        "track_order(order_id='55123').",
    ),
    (
        "search_products",
        "ecommerce_support",
        "read",
        SearchProductsArgs,
        "Search the store; returns product_ids, prices, ratings. Typical: 'a desk lamp under 50 dollars' -> "
        "search_products(query='desk lamp', max_price=50). Precedes add_to_cart.",
    ),
    (
        "add_to_cart",
        "ecommerce_support",
        "action",
        AddToCartArgs,
        "Add a product to the shopping cart; product_id comes from search_products. Typical: 'add two of the "
        "first one' -> add_to_cart(product_id='P-1001', quantity=2). Call after search_products.",
    ),
]


def _make_fn(world: MockWorld, method: str):
    async def call(**kwargs: Any) -> ToolOutput:
        return await world.run(method, **kwargs)

    call.__name__ = method
    call.__doc__ = getattr(MockWorld, method).__doc__
    return call


def fdb_v3_tools(world: MockWorld, *, timeout_s: float = 10.0) -> list[Tool]:
    """The 12 Full-Duplex-Bench v3 tools bound to ``world``, in the benchmark's domain order."""
    return [
        Tool(
            name=name,
            description=description,
            parameters=params,
            fn=_make_fn(world, name),
            kind=kind,  # type: ignore[arg-type]
            timeout_s=timeout_s,
            domain=domain,
        )
        for name, domain, kind, params, description in _SPECS
    ]
