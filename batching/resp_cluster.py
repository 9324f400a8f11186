"""The lean hot-path client on a Redis Cluster: each command goes to the node that holds
its key's slot.

A key's slot is the CRC16 (XMODEM) of its hash tag (the part between the first ``{`` and
the next ``}``, when not empty; else the whole key) modulo 16384, as the Redis Cluster
specification defines it. conveyor's keys carry the model (or the API process, or the
job) as hash tag (:mod:`batching.keys`), so each command of the hot path has its keys in
one slot; the commands of one write may go to several nodes. The slot map comes from
``CLUSTER SLOTS``; a ``MOVED`` reply updates it and sends the command again to the node
named, an ``ASK`` reply sends it there once after ``ASKING``.

:class:`ClusterConnection` is :class:`batching.resp.Connection`'s interface (an
inference process's), :class:`ClusterLink` :class:`batching.resp.Link`'s part the
API's dispatcher uses. Replies of one write come back in the order of its commands,
whichever nodes answered them. Each node applies its part of a write on its own, and one
part can fail (a lost connection, ``CLUSTERDOWN``, a redirection too many) while another
is applied: a write orders nothing across nodes (:attr:`ClusterConnection.splits`). An
inference process's answer therefore releases its entries in a second write, once it has
read that every reply was pushed (:meth:`workers.streams.ModelStreams.answer`).
"""

from __future__ import annotations

import asyncio
import binascii
from collections.abc import Iterable, Sequence
from typing import Any

from batching.redis_topology import Topology
from batching.resp import (
    Command,
    Connection,
    Link,
    LinkHandler,
    ReplyHandler,
    RespError,
    check,
    open_link,
    resolver,
)

SLOTS = 16384
MAX_REDIRECTS = 5
Node = tuple[str, int]
FIRST_KEY = {b"EVAL": 3, b"EVALSHA": 3, b"BLMPOP": 3, b"LMPOP": 2}
"""Commands whose first key is not their first argument: its position (scripts and
``*MPOP`` give a key count first; a count of 0 means no key)."""
NO_KEY = frozenset({b"PING", b"ROLE", b"AUTH", b"SELECT", b"ASKING", b"CLUSTER", b"TIME",
                    b"SCRIPT", b"INFO"})


def key_slot(key: bytes | str) -> int:
    """The cluster slot of ``key``."""
    data = key.encode() if isinstance(key, str) else key
    start = data.find(b"{")
    if start >= 0:
        end = data.find(b"}", start + 1)
        if end > start + 1:
            data = data[start + 1:end]
    return binascii.crc_hqx(data, 0) % SLOTS


def _bytes(arg: Any) -> bytes:
    return arg if isinstance(arg, bytes) else str(arg).encode()


def command_key(command: Command) -> bytes | None:
    """The first key of ``command`` (all of a command's keys share its slot), or None for
    a command without keys."""
    name = _bytes(command[0]).upper()
    if name in NO_KEY:
        return None
    if name == b"XREADGROUP":
        upper = [_bytes(a).upper() for a in command]
        return _bytes(command[upper.index(b"STREAMS") + 1])
    at = FIRST_KEY.get(name, 1)
    if at > 1 and int(command[at - 1]) == 0:
        return None
    return _bytes(command[at])


def redirect(reply: Any) -> tuple[str, int, Node] | None:
    """``("MOVED" | "ASK", slot, node)`` for a redirection reply, else None."""
    if not isinstance(reply, RespError):
        return None
    kind, _, rest = str(reply).partition(" ")
    if kind not in ("MOVED", "ASK"):
        return None
    slot, _, where = rest.partition(" ")
    host, _, port = where.rpartition(":")
    return kind, int(slot), (host.strip("[]"), int(port))


def slot_map(reply: Any) -> list[Node | None]:
    """``CLUSTER SLOTS``'s reply as the primary of each slot."""
    nodes: list[Node | None] = [None] * SLOTS
    for start, end, primary, *_replicas in reply:
        node = (_bytes(primary[0]).decode(), int(primary[1]))
        nodes[int(start):int(end) + 1] = [node] * (int(end) - int(start) + 1)
    return nodes


class SlotRoutes:
    """The slot map and where each command of a write goes."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self.slots: list[Node | None] = [None] * SLOTS
        self.stale = True

    def known(self) -> list[Node]:
        """Nodes to ask for the slot map: those of the map, then the seeds."""
        nodes = {n: None for n in self.slots if n is not None}
        nodes.update({seed: None for seed in self.topology.hosts})
        return list(nodes)

    def node(self, command: Command) -> Node:
        key = command_key(command)
        if key is None:
            return next(n for n in [*self.slots, *self.topology.hosts] if n is not None)
        node = self.slots[key_slot(key)]
        if node is None:
            raise ConnectionError(f"no node of the cluster serves slot {key_slot(key)}")
        return node

    def split(self, commands: Sequence[Command]) -> dict[Node, list[int]]:
        """The commands' positions, by node."""
        parts: dict[Node, list[int]] = {}
        for i, command in enumerate(commands):
            parts.setdefault(self.node(command), []).append(i)
        return parts

    def moved(self, slot: int, node: Node) -> None:
        self.slots[slot] = node
        self.stale = True  # the rest of the map may have moved too: read it again


class ClusterConnection:
    """A blocking connection per node, opened on first use; the interface of
    :class:`batching.resp.Connection` (``spin_s`` is not used: replies come from several
    sockets)."""

    splits = True
    """The commands of one write go to their slots' nodes, each part applied on its own."""

    def __init__(self, topology: Topology, timeout_s: float, connect_timeout_s: float = 1.0) -> None:
        self.routes = SlotRoutes(topology)
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._nodes: dict[Node, Connection] = {}

    def send(self, commands: Sequence[Command], on_replies: ReplyHandler | None = None) -> None:
        self._fresh()
        replies: list[Any] = [None] * len(commands)
        parts = self.routes.split(commands)
        left = [len(parts)]

        def part(positions: list[int]) -> ReplyHandler:
            def take(got: list[Any]) -> None:
                for i, reply in zip(positions, got, strict=True):
                    replies[i] = self._follow(commands[i], reply)
                left[0] -= 1
                if left[0] == 0 and on_replies is not None:
                    on_replies(replies)
            return take
        try:
            for node, positions in parts.items():
                self._link(node).send([commands[i] for i in positions], part(positions))
        except OSError:
            self.routes.stale = True
            raise

    def execute(self, commands: Sequence[Command], spin_s: float = 0.0) -> list[Any]:
        got: list[list[Any]] = []
        self.send(commands, got.append)
        self.flush()
        return [check(reply) for reply in got[0]]

    def call(self, *command: Any) -> Any:
        return self.execute([command])[0]

    def flush(self) -> None:
        try:
            for link in list(self._nodes.values()):
                link.flush()
        except OSError:
            self.routes.stale = True
            raise

    def close(self) -> None:
        for link in self._nodes.values():
            link.close()
        self._nodes.clear()

    def _link(self, node: Node) -> Connection:
        link = self._nodes.get(node)
        if link is None:
            link = Connection(self.routes.topology.node_address(*node), self.timeout_s,
                              self.connect_timeout_s)
            self._nodes[node] = link
        return link

    def _follow(self, command: Command, reply: Any) -> Any:
        """The reply, after following up to MAX_REDIRECTS redirections."""
        for _ in range(MAX_REDIRECTS):
            moved = redirect(reply)
            if moved is None:
                return reply
            kind, slot, node = moved
            if kind == "MOVED":
                self.routes.moved(slot, node)
                reply = self._link(node).exchange([command])[0]
            else:
                reply = self._link(node).exchange([("ASKING",), command])[1]
        return reply

    def _fresh(self) -> None:
        """Read the slot map when it may be out of date."""
        if not self.routes.stale:
            return
        errors: list[str] = []
        for node in self.routes.known():
            link = self._link(node)
            try:
                self.routes.slots = slot_map(link.call("CLUSTER", "SLOTS"))
                self.routes.stale = False
                return
            except (OSError, RespError) as exc:
                errors.append(f"{node[0]}:{node[1]}: {exc}")
                link.close()
                self._nodes.pop(node, None)
        raise ConnectionError(f"no node of the cluster answers: {'; '.join(errors)}")


class ClusterLink:
    """One lean link per primary of the cluster, behind the interface the API's dispatcher
    uses (:class:`batching.redis_links.AsyncLink`). Closed once any node's link is: the
    dispatcher then opens a new one, on a fresh slot map."""

    def __init__(self, routes: SlotRoutes, links: dict[Node, Link]) -> None:
        self.routes = routes
        self._links = links
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        for link in links.values():
            link.closed.add_done_callback(lambda _: self.abort())

    def prepare(self, commands: Sequence[Command]) -> tuple[Command, ...]:
        return tuple(commands)

    def write(self, prepared: tuple[Command, ...], handlers: list[LinkHandler]) -> None:
        try:
            parts = self.routes.split(prepared)
        except ConnectionError as exc:
            for handler in handlers:
                handler(exc)
            self.abort()
            return
        for node, positions in parts.items():
            self._send(node, [prepared[i] for i in positions],
                       [self._following(prepared[i], handlers[i]) for i in positions])

    def abort(self) -> None:
        for link in self._links.values():
            link.abort()
        self.routes.stale = True  # whatever dropped a link may have moved slots
        if not self.closed.done():
            self.closed.set_result(None)

    async def execute(self, *commands: Command) -> list[Any]:
        """Send ``commands`` and await their replies; error replies raise."""
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[Any]] = [loop.create_future() for _ in commands]
        self.write(commands, [resolver(f) for f in futures])
        return [check(reply) for reply in await asyncio.gather(*futures)]

    def _send(self, node: Node, commands: list[Command], handlers: list[LinkHandler]) -> None:
        link = self._links.get(node)
        if link is None:  # a node this link never met: reconnect with a fresh map
            error = ConnectionError(f"cluster node {node[0]}:{node[1]} is new to this link")
            for handler in handlers:
                handler(error)
            self.routes.stale = True
            self.abort()
            return
        link.write(link.prepare(commands), handlers)

    def _following(self, command: Command, handler: LinkHandler,
                   left: int = MAX_REDIRECTS) -> LinkHandler:
        """``handler``, behind a follower of MOVED and ASK replies."""
        def follow(reply: Any) -> None:
            moved = redirect(reply) if left else None
            if moved is None:
                handler(reply)
                return
            kind, slot, node = moved
            then = self._following(command, handler, left - 1)
            if kind == "MOVED":
                self.routes.moved(slot, node)
                self._send(node, [command], [then])
            else:
                self._send(node, [("ASKING",), command], [_ignore, then])
        return follow


def _ignore(_reply: Any) -> None:
    """The reply to ``ASKING``."""


async def open_cluster_link(topology: Topology, routes: SlotRoutes | None = None,
                            timeout_s: float = 1.0) -> ClusterLink:
    """A :class:`ClusterLink` to every primary, on the slot map read from the first node
    that answers (``routes``: a map to reuse while it is not stale)."""
    routes = routes or SlotRoutes(topology)
    if routes.stale:
        await _read_map(routes, timeout_s)
    links: dict[Node, Link] = {}
    try:
        for node in _primaries(routes.slots):
            links[node] = await open_link(topology.node_address(*node), timeout_s)
    except BaseException:
        for link in links.values():
            link.abort()
        routes.stale = True
        raise
    return ClusterLink(routes, links)


async def _read_map(routes: SlotRoutes, timeout_s: float) -> None:
    errors: list[str] = []
    for node in routes.known():
        try:
            link = await open_link(routes.topology.node_address(*node), timeout_s)
        except (OSError, RespError, TimeoutError) as exc:
            errors.append(f"{node[0]}:{node[1]}: {exc}")
            continue
        try:
            (reply,) = await asyncio.wait_for(link.execute(("CLUSTER", "SLOTS")), timeout_s)
        except (OSError, RespError, TimeoutError) as exc:
            errors.append(f"{node[0]}:{node[1]}: {exc}")
            continue
        finally:
            link.abort()
        routes.slots = slot_map(reply)
        routes.stale = False
        return
    raise ConnectionError(f"no node of the cluster answers: {'; '.join(errors)}")


def _primaries(slots: Iterable[Node | None]) -> list[Node]:
    return list({node: None for node in slots if node is not None})

