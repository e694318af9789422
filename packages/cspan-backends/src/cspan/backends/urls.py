"""URLs in messages and logs without their secrets.

A backend URL an operator gives (``--router``, ``--asr``, ``--mcp``, ``--db``) may carry a credential: a password in
its user part (``https://bob:pw@host/``) or a query parameter (``?api_key=...``, ``&password=...``, libpq's
``sslpassword``). Every error message and log line that names such a URL shows :func:`redact_url` of it.
"""

from __future__ import annotations

import logging
import re
from urllib.parse import urlsplit, urlunsplit

SECRET_PARAM = re.compile(r"(?i)((?:^|&)[^=&]*(?:pass|secret|token|key|auth|sig|credential|session)[^=&]*=)[^&]*")
"""A query parameter whose name says it holds a secret (``password``, ``api_key``, ``access_token``, ``sig``...)."""


def redact_url(url: str) -> str:
    """``url`` with the password of its user part and the values of its secret-looking query parameters
    (:data:`SECRET_PARAM`) replaced by ``***``: ``"https://bob:***@host/mcp?api_key=***&v=2"``. Anything that is no
    URL comes back as it is."""
    scheme, sep, rest = url.partition("://")
    userinfo, at, after = rest.rpartition("@")
    user, colon, _ = userinfo.partition(":")
    if sep and at and colon and not any(c in user for c in "/?#@"):
        # the password runs to the last "@": one holding an unencoded "/", "?", "#" or "@" (which splits the URL
        # elsewhere) is hidden whole, not shown from that character on
        url = f"{scheme}://{user}:***@{after}"
    try:
        parts = urlsplit(url)
    except ValueError:  # not a URL (an unbalanced "[" in a host): nothing to find
        return url
    query = SECRET_PARAM.sub(r"\1***", parts.query)
    if query == parts.query:
        return url
    return urlunsplit(parts._replace(query=query))


def check_http_url(value: str) -> str:
    """``value`` if it is an http(s) URL with a host and a valid port; ``ValueError`` saying what is wrong (the URL
    shown by :func:`redact_url`)."""
    shown = repr(redact_url(value))  # a password in the URL is not echoed
    try:
        parts = urlsplit(value)
        _ = parts.port  # raises ValueError when out of range or not a number
    except ValueError as exc:
        raise ValueError(f"{shown} is not a valid URL ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{shown} is not an http(s) URL with a host name")
    return value


HTTP_LOGGERS = ("httpx", "httpx2")
"""The HTTP clients' loggers that name every request's URL at INFO (``cspan -v``): httpx, and the MCP SDK's httpx2."""


class RedactURLs(logging.Filter):
    """A log filter that passes every record with the URLs among its arguments shown by :func:`redact_url`."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and any(_names_url(a) for a in args):
            record.args = tuple(redact_url(str(a)) if _names_url(a) else a for a in args)
        return True


def _names_url(value: object) -> bool:
    """Whether ``value`` is a URL (httpx's ``URL``, or a string of one) that may carry a credential."""
    if type(value).__name__ == "URL":
        return True
    return isinstance(value, str) and "://" in value[:16]


def redact_http_logs() -> None:
    """Put :class:`RedactURLs` on the loggers of :data:`HTTP_LOGGERS` (once): ``cspan -v`` logs every request's URL,
    which would otherwise show a backend URL's password and secret query parameters."""
    for name in HTTP_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactURLs) for f in logger.filters):
            logger.addFilter(RedactURLs())


__all__ = ["HTTP_LOGGERS", "SECRET_PARAM", "RedactURLs", "check_http_url", "redact_http_logs", "redact_url"]
