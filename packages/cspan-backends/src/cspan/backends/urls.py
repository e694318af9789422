"""URLs in messages and logs without their secrets.

A backend URL an operator gives (``--router``, ``--asr``, ``--mcp``, ``--db``) may carry a credential: a password in
its user part (``https://bob:pw@host/``) or a query parameter (``?api_key=...``, ``&password=...``, libpq's
``sslpassword``). Every error message and log line that names such a URL shows :func:`redact_url` of it.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

SECRET_PARAM = re.compile(r"(?i)((?:^|&)[^=&]*(?:pass|secret|token|key|auth|sig|credential|session)[^=&]*=)[^&]*")
"""A query parameter whose name says it holds a secret (``password``, ``api_key``, ``access_token``, ``sig``...)."""


def redact_url(url: str) -> str:
    """``url`` with the password of its user part and the values of its secret-looking query parameters
    (:data:`SECRET_PARAM`) replaced by ``***``: ``"https://bob:***@host/mcp?api_key=***&v=2"``. Anything that is no
    URL comes back as it is."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:  # not a URL (an unbalanced "[" in a host): nothing to find
        return url
    netloc = parts.netloc
    if password is not None:
        user, _, host = netloc.rpartition("@")
        netloc = f"{user.partition(':')[0]}:***@{host}"
    query = SECRET_PARAM.sub(r"\1***", parts.query)
    if (netloc, query) == (parts.netloc, parts.query):
        return url
    return urlunsplit(parts._replace(netloc=netloc, query=query))


__all__ = ["SECRET_PARAM", "redact_url"]
