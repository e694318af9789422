"""``get_weather`` through Open-Meteo's public API (no key): geocoding, then the current forecast.

Endpoints (https://open-meteo.com/en/docs and https://open-meteo.com/en/docs/geocoding-api):

- ``{geocoding_base}/v1/search?name=<city>&count=1&language=en&format=json`` -> ``results[0]`` with ``name``,
  ``latitude``, ``longitude``, ``country``, ``country_code``, ``admin1``;
- ``{base}/v1/forecast?latitude=..&longitude=..&current=temperature_2m,relative_humidity_2m,wind_speed_10m,
  weather_code`` -> ``current`` with those fields (degrees Celsius, percent, km/h, WMO code).

Behaviour follows the original weather server (``docs/reference/context-spanning-original.md`` section 4.7):
geocoding results are cached for the life of the client, forecasts for 60 s, and the clause reads
``"Busan, South Korea: 26.1°C (79°F), humidity 68%, wind 3.8 km/h, clear sky."``. Requests follow
:mod:`cspan.backends.http_client` (one try to connect): connections time out after ``connect_timeout_s`` (3 s),
whole requests (a 429 or 503's ``Retry-After`` waited out included) after ``timeout_s``, replies over 1 MiB are
refused; any transport or HTTP failure raises :class:`ToolError` quickly instead of hanging.
"""

from __future__ import annotations

import os
import time
from typing import Any

import httpx
from pydantic import Field

from cspan.backends.errors import ToolError
from cspan.backends.http_client import HTTPFailure, HTTPPolicy, request
from cspan.backends.tools.bank import Tool, ToolArgs, ToolOutput
from cspan.backends.untrusted import JSONInputError, loads

__all__ = ["DEFAULT_GEOCODING_URL", "DEFAULT_WEATHER_URL", "WMO_CODES", "WeatherClient", "describe_wmo_code"]

DEFAULT_WEATHER_URL = "https://api.open-meteo.com"
DEFAULT_GEOCODING_URL = "https://geocoding-api.open-meteo.com"

WMO_CODES: dict[int, str] = {
    0: "clear sky",
    1: "mainly clear",
    2: "partly cloudy",
    3: "overcast",
    45: "fog",
    48: "freezing fog",
    51: "light drizzle",
    53: "drizzle",
    55: "heavy drizzle",
    56: "light freezing drizzle",
    57: "heavy freezing drizzle",
    61: "light rain",
    63: "rain",
    65: "heavy rain",
    66: "light freezing rain",
    67: "heavy freezing rain",
    71: "light snow",
    73: "snow",
    75: "heavy snow",
    77: "snow grains",
    80: "light rain showers",
    81: "rain showers",
    82: "violent rain showers",
    85: "light snow showers",
    86: "heavy snow showers",
    95: "thunderstorm",
    96: "thunderstorm with light hail",
    99: "thunderstorm with heavy hail",
}
"""WMO weather interpretation codes (WW) as used by Open-Meteo's ``weather_code``, in words."""


def describe_wmo_code(code: Any) -> str:
    """Words for a WMO weather code; ``"unknown conditions"`` for anything not in :data:`WMO_CODES`."""
    try:
        return WMO_CODES.get(int(code), "unknown conditions")
    except (TypeError, ValueError):
        return "unknown conditions"


class GetWeatherArgs(ToolArgs):
    city: str = Field(default="", description="City name, e.g. 'Busan' or 'Portland, Oregon'.")
    lat: float | None = Field(default=None, ge=-90, le=90, description="Latitude in degrees (with lon).")
    lon: float | None = Field(default=None, ge=-180, le=180, description="Longitude in degrees (with lat).")


def _fmt(value: Any, digits: int = 1) -> str:
    number = float(value)
    text = f"{number:.{digits}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


class WeatherClient:
    """Open-Meteo client behind the ``get_weather`` tool.

    Args:
        base_url: forecast API base (default env ``CSPAN_WEATHER_URL`` or :data:`DEFAULT_WEATHER_URL`).
        geocoding_base_url: geocoding API base (default env ``CSPAN_GEOCODING_URL``, else ``base_url`` when it was
            given explicitly, else :data:`DEFAULT_GEOCODING_URL`); one local test server can serve both paths.
        connect_timeout_s: TCP/TLS connect limit in seconds.
        timeout_s: limit for each whole request in seconds.
        forecast_ttl_s: how long a forecast is reused, in seconds.
    """

    def __init__(
        self,
        base_url: str | None = None,
        geocoding_base_url: str | None = None,
        *,
        connect_timeout_s: float = 3.0,
        timeout_s: float = 6.0,
        forecast_ttl_s: float = 60.0,
    ) -> None:
        explicit = base_url or os.environ.get("CSPAN_WEATHER_URL")
        self.base_url = (explicit or DEFAULT_WEATHER_URL).rstrip("/")
        geo = geocoding_base_url or os.environ.get("CSPAN_GEOCODING_URL") or (base_url if base_url else None)
        self.geocoding_base_url = (geo or DEFAULT_GEOCODING_URL).rstrip("/")
        self.policy = HTTPPolicy(
            deadline_s=timeout_s, connect_timeout_s=min(connect_timeout_s, timeout_s), max_attempts=1
        )
        self.timeout_s = timeout_s
        self.forecast_ttl_s = forecast_ttl_s
        self._places: dict[str, dict[str, Any]] = {}
        self._forecasts: dict[tuple[float, float], tuple[float, dict[str, Any]]] = {}

    async def _get_json(self, client: httpx.AsyncClient, url: str, params: dict[str, Any]) -> dict[str, Any]:
        try:
            reply = await request(client, "GET", url, policy=self.policy, params=params)
        except HTTPFailure as exc:
            said = {"deadline": f"{url} did not answer in time", "connect": f"cannot reach {url}"}.get(exc.kind, url)
            raise ToolError(f"{said} ({exc}); check the network or CSPAN_WEATHER_URL / CSPAN_GEOCODING_URL") from None
        if reply.status != 200:
            raise ToolError(f"{url} answered HTTP {reply.status}: {reply.shown(120)!r}")
        try:
            payload = loads(reply.body)
        except JSONInputError:
            raise ToolError(f"{url} answered something that is not JSON") from None
        if not isinstance(payload, dict):
            raise ToolError(f"{url} answered a JSON {type(payload).__name__}, expected an object")
        if payload.get("error"):
            raise ToolError(f"{url} reported an error: {payload.get('reason', 'no reason given')}")
        return payload

    async def geocode(self, client: httpx.AsyncClient, city: str) -> dict[str, Any]:
        """``{"name", "latitude", "longitude", "label"}`` of the best Open-Meteo match for ``city``.

        ``"Portland, Oregon"`` searches ``Portland`` and prefers the result whose region or country contains
        ``Oregon``.

        Raises:
            ToolError: transport/HTTP failure, or no place of that name (``field`` is ``"city"``).
        """
        key = " ".join(city.lower().split())
        if key in self._places:
            return self._places[key]
        head, _, qualifier = city.partition(",")
        head, qualifier = head.strip(), qualifier.strip().lower()
        params = {"name": head, "count": 10 if qualifier else 1, "language": "en", "format": "json"}
        payload = await self._get_json(client, f"{self.geocoding_base_url}/v1/search", params)
        results = [r for r in payload.get("results") or [] if isinstance(r, dict)]
        if not results:
            raise ToolError(f"no place called {city!r} was found", field="city")
        best = results[0]
        if qualifier:
            for result in results:
                haystack = " ".join(
                    str(result.get(k, "")) for k in ("admin1", "admin2", "country", "country_code")
                ).lower()
                if qualifier in haystack:
                    best = result
                    break
        try:
            lat, lon = float(best["latitude"]), float(best["longitude"])
        except (KeyError, TypeError, ValueError):
            raise ToolError(f"the geocoding answer for {city!r} has no coordinates") from None
        name = str(best.get("name") or head)
        if best.get("country_code") == "US" and best.get("admin1"):
            label = f"{name}, {best['admin1']}"
        elif best.get("country"):
            label = f"{name}, {best['country']}"
        else:
            label = name
        place = {"name": name, "latitude": lat, "longitude": lon, "label": label}
        if len(self._places) < 512:
            self._places[key] = place
        return place

    async def current(self, client: httpx.AsyncClient, lat: float, lon: float) -> dict[str, Any]:
        """The ``current`` block of the forecast at (``lat``, ``lon``), cached for ``forecast_ttl_s`` seconds."""
        key = (round(lat, 3), round(lon, 3))
        cached = self._forecasts.get(key)
        now = time.monotonic()
        if cached is not None and now - cached[0] < self.forecast_ttl_s:
            return cached[1]
        params = {
            "latitude": f"{lat:.4f}",
            "longitude": f"{lon:.4f}",
            "current": "temperature_2m,relative_humidity_2m,wind_speed_10m,weather_code",
        }
        payload = await self._get_json(client, f"{self.base_url}/v1/forecast", params)
        current = payload.get("current")
        if not isinstance(current, dict) or "temperature_2m" not in current:
            raise ToolError(f"the forecast answer from {self.base_url} has no current conditions")
        if len(self._forecasts) > 256:
            self._forecasts.clear()
        self._forecasts[key] = (now, current)
        return current

    async def get_weather(self, city: str = "", lat: float | None = None, lon: float | None = None) -> ToolOutput:
        """Current conditions for ``city`` or for (``lat``, ``lon``); see the module docstring for the clause.

        Raises:
            ToolError: neither a city nor both coordinates, an unknown place, or Open-Meteo unreachable or
                answering an error.
        """
        city = " ".join((city or "").split())
        if not city and (lat is None or lon is None):
            field = "lon" if lat is not None else "lat" if lon is not None else "city"
            raise ToolError("get_weather needs a city, or both lat and lon", field=field)
        async with httpx.AsyncClient(timeout=self.policy.timeout(), follow_redirects=True) as client:
            if city:
                place = await self.geocode(client, city)
                lat_, lon_, label = place["latitude"], place["longitude"], place["label"]
            else:
                assert lat is not None and lon is not None
                lat_, lon_ = float(lat), float(lon)
                label = f"{lat_:.2f}, {lon_:.2f}"
            now = await self.current(client, lat_, lon_)
        parts = []
        celsius = now.get("temperature_2m")
        if celsius is not None:
            fahrenheit = float(celsius) * 9 / 5 + 32
            parts.append(f"{_fmt(celsius)}°C ({round(fahrenheit)}°F)")
        if now.get("relative_humidity_2m") is not None:
            parts.append(f"humidity {_fmt(now['relative_humidity_2m'], 0)}%")
        if now.get("wind_speed_10m") is not None:
            parts.append(f"wind {_fmt(now['wind_speed_10m'])} km/h")
        parts.append(describe_wmo_code(now.get("weather_code")))
        text = f"{label}: " + ", ".join(parts) + "."
        data = {
            "place": label,
            "latitude": lat_,
            "longitude": lon_,
            "temperature_c": celsius,
            "relative_humidity": now.get("relative_humidity_2m"),
            "wind_speed_kmh": now.get("wind_speed_10m"),
            "weather_code": now.get("weather_code"),
            "conditions": describe_wmo_code(now.get("weather_code")),
            "time": now.get("time"),
        }
        return ToolOutput(text, data)

    def tool(self) -> Tool:
        """The ``get_weather(city="", lat=None, lon=None)`` tool bound to this client."""

        async def get_weather(city: str = "", lat: float | None = None, lon: float | None = None) -> ToolOutput:
            return await self.get_weather(city=city, lat=lat, lon=lon)

        return Tool(
            name="get_weather",
            description=(
                "Current weather (temperature, humidity, wind, conditions) for a city or coordinates, live from "
                "Open-Meteo. Only for current weather; never guess it. Typical: 'is it raining in Busan' -> "
                "get_weather(city='Busan')."
            ),
            parameters=GetWeatherArgs,
            fn=get_weather,
            kind="read",
            timeout_s=2 * self.timeout_s + 1.0,
            domain="utility",
        )
