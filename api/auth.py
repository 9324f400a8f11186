"""API keys and scopes: who may call what (docs/security.md, "Authentication").

Keys come from ``CONVEYOR_API_KEYS_FILE``, one a line: ``<key> <scope>[,<scope>...]``
with scopes ``infer``, ``jobs`` and ``admin`` (a superset of the others); blank lines
and ``#`` comments are skipped, and so is a malformed line (logged by its line number,
never with its key). The file is looked at again, at most once a second, when a key is
checked: a changed file (modification time, size or inode) is read anew, so keys rotate
without a restart. Keys are held only as SHA-256 digests, and a presented key is found
by its digest, so the comparison takes the same time whatever key is presented.

With no keys file there is no authentication: every caller is anonymous (``None``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from batching.errors import PermissionDenied, Unauthenticated

log = logging.getLogger("conveyor.auth")

RECHECK_S = 1.0
"""A keys file is looked at (stat) at most this often."""
PRINCIPAL = "conveyor.principal"
"""The ASGI scope key under which the HTTP guard leaves the caller's :class:`Principal`."""


class Scope(StrEnum):
    INFER = "infer"
    JOBS = "jobs"
    ADMIN = "admin"


class Need(StrEnum):
    """What an endpoint asks of its caller."""

    HEALTH = "health"
    """Nothing, unless ``auth_health``: then any valid key."""
    METRICS = "metrics"
    """Nothing, unless ``auth_metrics``: then any valid key."""
    ANY = "any"
    """Any valid key (unknown paths and methods: a probe learns nothing without one)."""
    INFER = Scope.INFER.value
    JOBS = Scope.JOBS.value
    ADMIN = Scope.ADMIN.value


@dataclass(frozen=True, slots=True)
class Principal:
    """A caller with a valid key: its key's digest (a job's owner) and its scopes."""

    digest: str
    scopes: frozenset[Scope]

    @property
    def admin(self) -> bool:
        return Scope.ADMIN in self.scopes

    def allows(self, scope: Scope) -> bool:
        return self.admin or scope in self.scopes


def key_digest(key: str) -> str:
    """What is kept of a key: in the key table, and as the owner of the jobs it submits."""
    return hashlib.sha256(key.encode()).hexdigest()


def parse_keys(text: str, source: str) -> dict[str, Principal]:
    """Digest -> principal for every well-formed line of a keys file."""
    principals: dict[str, Principal] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split()
        problem = ""
        if len(fields) != 2:
            problem = "expected '<key> <scope>[,<scope>...]'"
        else:
            names = [s.strip() for s in fields[1].split(",") if s.strip()]
            unknown = sorted(set(names) - {s.value for s in Scope})
            if unknown or not names:
                problem = f"unknown scopes {unknown} (known: infer, jobs, admin)"
        if problem:
            log.error("%s line %d skipped: %s", source, number, problem)
            continue
        digest = key_digest(fields[0])
        principals[digest] = Principal(digest, frozenset(Scope(n) for n in names))
    return principals


class KeyStore:
    """The keys of one keys file, read again whenever the file changes."""

    def __init__(self, path: Path | None, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self._clock = clock
        self._principals: dict[str, Principal] = {}
        self._stamp: tuple[int, int, int] | None = None
        self._failing = False
        self._next_check = 0.0
        if path is not None:
            self._refresh()

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def lookup(self, key: str) -> Principal | None:
        now = self._clock()
        if now >= self._next_check:
            self._next_check = now + RECHECK_S
            self._refresh()
        return self._principals.get(key_digest(key))

    def _refresh(self) -> None:
        assert self.path is not None
        try:
            stat = os.stat(self.path)
            stamp = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
            if stamp == self._stamp:
                return
            text = self.path.read_text()
        except OSError as exc:  # fail closed: no file, no valid key
            if not self._failing:
                log.error("cannot read the keys file %s (%s): every key is refused",
                          self.path, exc.strerror or exc)
            self._principals, self._stamp, self._failing = {}, None, True
            return
        self._principals = parse_keys(text, str(self.path))
        self._stamp, self._failing = stamp, False
        log.info("read %d API keys from %s", len(self._principals), self.path)


class Guard:
    """The one decision HTTP and gRPC share: may these credentials call that endpoint?"""

    def __init__(self, store: KeyStore, auth_health: bool, auth_metrics: bool) -> None:
        self.store = store
        self.auth_health = auth_health
        self.auth_metrics = auth_metrics

    def check(self, need: Need, credentials: str | None) -> Principal | None:
        """The caller (None: anonymous, when there are no keys or the endpoint is open).

        Raises :class:`Unauthenticated` for a missing or unknown key and
        :class:`PermissionDenied` for a known key without the scope.
        """
        if not self.store.enabled:
            return None
        open_endpoint = ((need is Need.HEALTH and not self.auth_health)
                         or (need is Need.METRICS and not self.auth_metrics))
        key = bearer_key(credentials)
        principal = self.store.lookup(key) if key else None
        if open_endpoint:
            return principal
        if principal is None:
            raise Unauthenticated("a valid API key is required (Authorization: Bearer <key>)"
                                  if key else "an API key is required "
                                  "(Authorization: Bearer <key>)")
        if need in (Need.INFER, Need.JOBS, Need.ADMIN) and not principal.allows(Scope(need.value)):
            raise PermissionDenied(f"this API key lacks the {need.value!r} scope")
        return principal


def bearer_key(credentials: str | None) -> str:
    """The key of ``Bearer <key>`` (the scheme is case-insensitive) or of a bare key."""
    if not credentials:
        return ""
    scheme, _, rest = credentials.strip().partition(" ")
    if rest and scheme.lower() == "bearer":
        return rest.strip()
    return "" if rest else scheme
