"""Which node the lean hot-path client writes to: the one server of a plain URL, or the
primary the sentinels name now (``SENTINEL get-master-addr-by-name``).

Asked again before every connection, so a link lost in a failover (the primary killed)
or dropped on a ``READONLY`` reply (the old primary back as a replica) reconnects to the
new primary. The sentinels are asked in turn; the first to answer moves to the front.
"""

from __future__ import annotations

import asyncio
from typing import Any

from batching.redis_topology import Topology
from batching.resp import Address, Connection, RespError, open_link

SENTINEL_TIMEOUT_S = 0.5


class PrimaryLocator:
    def __init__(self, topology: Topology, timeout_s: float = SENTINEL_TIMEOUT_S) -> None:
        if topology.kind == "cluster":
            raise ValueError("a Redis Cluster has no one primary")
        self.topology = topology
        self.timeout_s = timeout_s
        self._sentinels = list(topology.hosts)

    @property
    def watched(self) -> bool:
        """Whether the primary is looked up (Sentinel), so a link checks it reached one."""
        return self.topology.kind == "sentinel"

    def address(self) -> Address:
        """The primary's address now; ``ConnectionError`` when no sentinel names one."""
        if not self.watched:
            return self.topology.node
        errors: list[str] = []
        for host, port in list(self._sentinels):
            link = Connection(self.topology.sentinel_address(host, port), self.timeout_s,
                              self.timeout_s)
            try:
                reply = link.call("SENTINEL", "get-master-addr-by-name", self.topology.service)
            except (OSError, RespError) as exc:
                errors.append(f"{host}:{port}: {exc}")
                continue
            finally:
                link.close()
            found = self._primary(reply, host, port, errors)
            if found is not None:
                return found
        raise ConnectionError(self._none_found(errors))

    async def address_async(self) -> Address:
        """:meth:`address` for the event loop."""
        if not self.watched:
            return self.topology.node
        errors: list[str] = []
        for host, port in list(self._sentinels):
            try:
                link = await open_link(self.topology.sentinel_address(host, port),
                                       self.timeout_s)
            except (OSError, RespError, TimeoutError) as exc:
                errors.append(f"{host}:{port}: {exc}")
                continue
            try:
                (reply,) = await asyncio.wait_for(link.execute(
                    ("SENTINEL", "get-master-addr-by-name", self.topology.service)),
                    self.timeout_s)
            except (OSError, RespError, TimeoutError) as exc:
                errors.append(f"{host}:{port}: {exc}")
                continue
            finally:
                link.abort()
            found = self._primary(reply, host, port, errors)
            if found is not None:
                return found
        raise ConnectionError(self._none_found(errors))

    def _primary(self, reply: Any, host: str, port: int, errors: list[str]) -> Address | None:
        if not reply:
            errors.append(f"{host}:{port}: knows no primary {self.topology.service!r}")
            return None
        self._sentinels.remove((host, port))
        self._sentinels.insert(0, (host, port))
        return self.topology.node_address(reply[0].decode(), int(reply[1]))

    def _none_found(self, errors: list[str]) -> str:
        return (f"no sentinel names the primary {self.topology.service!r}: "
                f"{'; '.join(errors)}")
