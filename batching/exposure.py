"""Whether the configured listeners would expose an unauthenticated service beyond this host."""

from __future__ import annotations

import ipaddress

from batching.settings import Settings

LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback")


def is_loopback(host: str) -> bool:
    """``host`` (an address or a name, IPv6 optionally in brackets) names this host only.

    Names are judged by their spelling, never resolved: only the loopback names and
    ``*.localhost`` (RFC 6761) count, and an empty host (every interface) does not.
    """
    bare = host.strip().strip("[]").lower().rstrip(".")
    if bare in LOOPBACK_NAMES or bare.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(bare).is_loopback
    except ValueError:
        return False


def unsafe_binding(settings: Settings) -> str | None:
    """Why listening on ``settings.host`` is refused, or None when it is allowed.

    Loopback is always allowed; anything else needs API keys (``CONVEYOR_API_KEYS_FILE``)
    or the explicit ``CONVEYOR_ALLOW_UNAUTHENTICATED=1``.
    """
    if is_loopback(settings.host) or settings.api_keys_file is not None \
            or settings.allow_unauthenticated:
        return None
    return (f"listening on {settings.host or 'every interface'} without "
            "CONVEYOR_API_KEYS_FILE: set it, or CONVEYOR_ALLOW_UNAUTHENTICATED=1")
