"""URLs safe to print: credentials masked, as Celery/kombu's ``maybe_sanitize_url`` does."""

from __future__ import annotations

import re

MASK = "**"
_NEXT_URL = re.compile(r";(?=[A-Za-z][A-Za-z0-9+.-]*://)")
"""Where a list of URLs (kombu's failover form ``redis://a;redis://b``) splits."""


def mask_url(url: str) -> str:
    """``url`` with its password (and a username given alone, which some clients take as
    the password) replaced by ``**``, and any ``*password=`` query value too.

    Everything before the last ``@`` of a URL counts as its credentials, so a password
    holding ``/``, ``?`` or ``#`` unescaped is masked whole; Sentinel's several hosts
    (``redis+sentinel://:pw@h1:26379,h2:26379/0``), Unix sockets and lists joined by
    ``;`` keep their form. A string without ``://`` comes back unchanged.
    """
    if "://" not in url:
        return url
    return ";".join(_mask_one(part) for part in _NEXT_URL.split(url))


def _mask_one(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    credentials, at, location = rest.rpartition("@")
    if at:
        credentials = _mask_credentials(credentials)
    return f"{scheme}://{credentials}{at}{_mask_query(location)}"


def _mask_credentials(credentials: str) -> str:
    user, colon, password = credentials.partition(":")
    if colon:
        return f"{user}:{MASK}" if password else credentials
    return MASK if user else credentials


def _mask_query(location: str) -> str:
    base, question, rest = location.partition("?")
    if not question:
        return location
    query, hash_, fragment = rest.partition("#")
    params = [_mask_param(p) for p in query.split("&")]
    return f"{base}?{'&'.join(params)}{hash_}{fragment}"


def _mask_param(param: str) -> str:
    key, equals, value = param.partition("=")
    if equals and value and key.lower().endswith("password"):
        return f"{key}={MASK}"
    return param
