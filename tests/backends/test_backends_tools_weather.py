"""get_weather against a local FastAPI server that mimics Open-Meteo's geocoding and forecast endpoints."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import uvicorn
from banks import make_mixed_bank
from fastapi import FastAPI, Query
from fastapi.responses import JSONResponse

from cspan.backends.errors import ToolError
from cspan.backends.tools import ToolBank
from cspan.backends.tools.weather import WeatherClient, describe_wmo_code

PLACES = {
    "busan": [
        {"name": "Busan", "latitude": 35.10278, "longitude": 129.04028, "country": "South Korea",
         "country_code": "KR", "admin1": "Busan"},
    ],
    "ratelimit": [
        {"name": "Ratelimit", "latitude": 35.1, "longitude": 129.0, "country": "Wonderland", "country_code": "WL"},
    ],
    "portland": [
        {"name": "Portland", "latitude": 43.66147, "longitude": -70.25533, "country": "United States",
         "country_code": "US", "admin1": "Maine"},
        {"name": "Portland", "latitude": 45.52345, "longitude": -122.67621, "country": "United States",
         "country_code": "US", "admin1": "Oregon"},
    ],
}  # fmt: skip


def fake_open_meteo() -> tuple[FastAPI, list[tuple[str, dict[str, Any]]]]:
    app = FastAPI()
    seen: list[tuple[str, dict[str, Any]]] = []

    @app.get("/v1/search", response_model=None)
    def search(name: str, count: int = 10, language: str = "en", format: str = "json") -> dict[str, Any] | JSONResponse:
        seen.append(("search", {"name": name, "count": count, "language": language, "format": format}))
        if name == "Ratelimit" and sum(args["name"] == name for _, args in seen) % 2:  # 429 every other time
            return JSONResponse({"error": True, "reason": "too many requests"}, 429, {"Retry-After": "1"})
        results = PLACES.get(name.lower(), [])[:count]
        return {"results": results, "generationtime_ms": 0.5} if results else {"generationtime_ms": 0.4}

    @app.get("/v1/forecast")
    def forecast(latitude: float, longitude: float, current: str = Query("")) -> dict[str, Any]:
        seen.append(("forecast", {"latitude": latitude, "longitude": longitude, "current": current}))
        if latitude > 90:
            return {"error": True, "reason": "Latitude must be in range of -90 to 90°."}
        warm = latitude < 40
        return {
            "latitude": latitude,
            "longitude": longitude,
            "current_units": {"temperature_2m": "°C", "relative_humidity_2m": "%", "wind_speed_10m": "km/h"},
            "current": {
                "time": "2026-06-18T13:30",
                "interval": 900,
                "temperature_2m": 26.1 if warm else 14.0,
                "relative_humidity_2m": 68 if warm else 81,
                "wind_speed_10m": 3.8 if warm else 12.34,
                "weather_code": 0 if warm else 61,
            },
        }

    return app, seen


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def open_meteo() -> Iterator[tuple[str, list]]:
    app, seen = fake_open_meteo()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            pytest.fail("the fake Open-Meteo server did not start")
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", seen
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture
async def bank(open_meteo: tuple[str, list]) -> AsyncIterator[ToolBank]:
    base, seen = open_meteo
    seen.clear()
    tools = make_mixed_bank(weather_base_url=base)
    yield tools
    await tools.aclose()


async def test_weather_for_a_city(bank: ToolBank, open_meteo: tuple[str, list]) -> None:
    _, seen = open_meteo
    result = await bank.call("get_weather", {"city": "Busan"})
    assert result.text == "Busan, South Korea: 26.1°C (79°F), humidity 68%, wind 3.8 km/h, clear sky."
    assert result.data["latitude"] == pytest.approx(35.10278)
    assert result.data["conditions"] == "clear sky"
    assert seen[0] == ("search", {"name": "Busan", "count": 1, "language": "en", "format": "json"})
    assert seen[1][0] == "forecast"
    assert seen[1][1]["current"] == "temperature_2m,relative_humidity_2m,wind_speed_10m,weather_code"
    assert seen[1][1]["latitude"] == pytest.approx(35.1028, abs=1e-4)

    again = await bank.call("get_weather", {"city": "busan"})
    assert again.text == result.text
    assert len(seen) == 2  # geocoding cached for good, forecast for 60 s


async def test_weather_qualified_city_and_coordinates(bank: ToolBank, open_meteo: tuple[str, list]) -> None:
    _, seen = open_meteo
    oregon = await bank.call("get_weather", {"city": "Portland, Oregon"})
    assert oregon.text == "Portland, Oregon: 14°C (57°F), humidity 81%, wind 12.3 km/h, light rain."
    assert seen[0][1]["count"] == 10
    point = await bank.call("get_weather", {"lat": "37.57", "lon": "126.98"})  # strings coerced to floats
    assert point.arguments == {"city": "", "lat": 37.57, "lon": 126.98}
    assert point.text.startswith("37.57, 126.98: 26.1°C")


async def test_weather_errors(bank: ToolBank) -> None:
    with pytest.raises(ToolError, match="no place called 'Atlantis'") as info:
        await bank.call("get_weather", {"city": "Atlantis"})
    assert info.value.field == "city"
    with pytest.raises(ToolError, match="needs a city, or both lat and lon") as info:
        await bank.call("get_weather", {"lat": 10})
    assert info.value.field == "lon"
    with pytest.raises(ToolError) as info:
        await bank.call("get_weather", {"lat": 91, "lon": 0})
    assert info.value.field == "lat"


async def test_closed_port_fails_with_tool_error() -> None:
    port = free_port()  # nothing listens there
    bank = make_mixed_bank(weather_base_url=f"http://127.0.0.1:{port}")
    try:
        with pytest.raises(
            ToolError, match=r"cannot reach http://127\.0\.0\.1:\d+/v1/search \(could not connect .*ConnectError"
        ):
            await bank.call("get_weather", {"city": "Busan"})
    finally:
        await bank.aclose()


async def test_silent_server_times_out_with_tool_error() -> None:
    async def accept_and_stay_silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1024)
        await asyncio.sleep(30)

    server = await asyncio.start_server(accept_and_stay_silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = WeatherClient(f"http://127.0.0.1:{port}", timeout_s=0.3)
    try:
        with pytest.raises(ToolError, match="did not answer in time"):
            await ToolBank([client.tool()]).call("get_weather", {"city": "Busan"})
    finally:
        server.close()


async def test_a_rate_limit_s_retry_after_is_waited_out(bank: ToolBank, open_meteo: tuple[str, list]) -> None:
    """Open-Meteo answers 429 when over its limits: the advised wait fits the tool's 6 s, so the call succeeds."""
    _, seen = open_meteo
    t0 = time.monotonic()
    result = await bank.call("get_weather", {"city": "Ratelimit"})
    assert 0.95 <= time.monotonic() - t0 < 2.5
    assert result.text.startswith("Ratelimit, Wonderland: 26.1°C")
    assert [args["name"] for kind, args in seen if kind == "search"] == ["Ratelimit", "Ratelimit"]


def test_wmo_codes_in_words() -> None:
    assert describe_wmo_code(0) == "clear sky"
    assert describe_wmo_code("95") == "thunderstorm"
    assert describe_wmo_code(42) == "unknown conditions"
