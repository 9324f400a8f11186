"""``CONVEYOR_REDIS_URL`` read once: one Redis, a Sentinel-watched primary, or a Cluster,
and the redis-py clients for each.

The forms (docs/configuration.md):

* ``redis://``, ``rediss://``, ``unix://``: one server, as redis-py reads them.
* ``redis+sentinel://[user:pass@]h1:26379,h2:26379/mymaster[/db]``: ask the sentinels
  for the primary of ``mymaster``; ``sentinel://`` is the same, and kombu's list
  ``sentinel://h1:26379;sentinel://h2:26379/db`` works with ``?master_name=mymaster``.
  The credentials are the data nodes'; ``sentinel_username`` and ``sentinel_password``
  query options log in to the sentinels. ``rediss+sentinel://`` speaks TLS to the
  sentinels and the data nodes alike, with the usual ``ssl_*`` options.
* ``redis+cluster://[user:pass@]h1:7000,h2:7001``: a Redis Cluster, found from any of
  these seed nodes (``rediss+cluster://`` with TLS).

Every Redis client of conveyor comes from here: the redis-py ones through
:func:`sync_redis` and :func:`async_redis`, the lean hot-path ones through
:mod:`batching.redis_links`, which read the same :class:`Topology`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal, cast
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

import redis
import redis.asyncio as aioredis
import redis.asyncio.cluster as aiocluster
import redis.asyncio.sentinel as aiosentinel
import redis.cluster
import redis.sentinel

from batching.resp import Address
from batching.urls import mask_url

Kind = Literal["single", "sentinel", "cluster"]
SENTINEL_SCHEMES = {"redis+sentinel": False, "sentinel": False, "rediss+sentinel": True}
"""Sentinel URL schemes, and whether the data nodes speak TLS."""
CLUSTER_SCHEMES = {"redis+cluster": False, "rediss+cluster": True}
SENTINEL_PORT = 26379
SENTINEL_OPTIONS = ("sentinel_username", "sentinel_password", "master_name")
"""Query options read here, not passed on to the data nodes' connections."""


@dataclass(frozen=True, slots=True)
class Topology:
    """Where conveyor's Redis is and how to reach its data nodes."""

    kind: Kind
    node: Address
    """The data nodes' login, database and TLS options; for ``single`` the server itself,
    otherwise at the first host's address (a placeholder: the primary or the slot's node
    is looked up)."""
    hosts: tuple[tuple[str, int], ...] = ()
    """The sentinels, or the cluster's seed nodes."""
    service: str = ""
    """The name the sentinels know the primary by (``mymaster``)."""
    sentinel_username: str | None = None
    sentinel_password: str | None = field(default=None, repr=False)

    def sentinel_address(self, host: str, port: int) -> Address:
        """How to reach one sentinel: its own login, the data nodes' TLS options."""
        return replace(self.node, host=host, port=port, path=None, db=0,
                       username=self.sentinel_username, password=self.sentinel_password)

    def sentinel_kwargs(self) -> dict[str, Any]:
        """redis-py keywords for the sentinels: their own login, and TLS as the data nodes
        speak it (``rediss+sentinel://``); what ``redis.sentinel.Sentinel`` and kombu's
        ``sentinel_kwargs`` option take."""
        login = {"username": self.sentinel_username, "password": self.sentinel_password}
        return {**{k: v for k, v in login.items() if v is not None},
                **_tls_kwargs(self.node)}

    def node_address(self, host: str, port: int) -> Address:
        """A data node at ``host:port`` with the data nodes' login, database and TLS."""
        return replace(self.node, host=host, port=port, path=None)


def parse_topology(url: str) -> Topology:
    """``url`` read into a :class:`Topology`; ``ValueError`` (credentials masked) for a
    URL that is none of the forms."""
    parts = urlsplit(url)
    scheme = parts.scheme
    if scheme in SENTINEL_SCHEMES:
        return _sentinel(url, SENTINEL_SCHEMES[scheme])
    if scheme in CLUSTER_SCHEMES:
        return _cluster(url, CLUSTER_SCHEMES[scheme])
    return Topology("single", Address.from_url(url))


def _split(url: str) -> tuple[str, list[tuple[str, int]], str, dict[str, str]]:
    """A several-host URL's credentials, hosts, path and query options. Hosts are
    separated by ``,``, or by ``;`` between whole URLs (kombu's list, whose path and
    options are the last one's)."""
    pieces = [urlsplit(piece) for piece in url.split(";")]
    credentials = next((p.netloc.rpartition("@")[0] for p in pieces if "@" in p.netloc), "")
    hosts = [_host(item, url) for p in pieces
             for item in p.netloc.rpartition("@")[2].split(",") if item]
    if not hosts:
        raise ValueError(f"no host in the Redis URL: {mask_url(url)}")
    return credentials, hosts, pieces[-1].path, dict(parse_qsl(pieces[-1].query))


def _host(item: str, url: str) -> tuple[str, int]:
    """``host[:port]`` or ``[v6]:port``; port 0 when none is given."""
    host, colon, port = item.rpartition(":")
    if not colon or (host.count(":") and not host.endswith("]")):
        host, port = item, ""
    try:
        return host.strip("[]"), int(port) if port else 0
    except ValueError:
        raise ValueError(f"bad port in the Redis URL: {mask_url(url)}") from None


def _node_url(tls: bool, credentials: str, host: str, port: int, db: int,
              options: dict[str, str]) -> str:
    """A ``redis://`` URL for one data node, so redis-py's own parser reads its options."""
    login = f"{credentials}@" if credentials else ""
    kept = {k: v for k, v in options.items() if k not in SENTINEL_OPTIONS}
    query = f"?{urlencode(kept)}" if kept else ""
    where = f"[{host}]" if ":" in host else host
    return f"{'rediss' if tls else 'redis'}://{login}{where}:{port}/{db}{query}"


def _sentinel(url: str, tls: bool) -> Topology:
    credentials, hosts, path, options = _split(url)
    segments = [unquote(s) for s in path.split("/") if s]
    service = options.get("master_name", "")
    if segments and not segments[0].isdigit():
        service = segments.pop(0)
    if not service:
        raise ValueError(f"the Sentinel URL names no primary (…/mymaster/0 or "
                         f"?master_name=): {mask_url(url)}")
    try:
        db = int(segments[0]) if segments else 0
    except ValueError:
        raise ValueError(f"bad database number in the Redis URL: {mask_url(url)}") from None
    hosts = [(h, p or SENTINEL_PORT) for h, p in hosts]
    node = Address.from_url(_node_url(tls, credentials, *hosts[0], db, options))
    return Topology("sentinel", node, tuple(hosts), service,
                    options.get("sentinel_username"), options.get("sentinel_password"))


def _cluster(url: str, tls: bool) -> Topology:
    credentials, hosts, path, options = _split(url)
    if path.strip("/") not in ("", "0"):
        raise ValueError(f"a Redis Cluster has database 0 only: {mask_url(url)}")
    hosts = [(h, p or 6379) for h, p in hosts]
    node = Address.from_url(_node_url(tls, credentials, *hosts[0], 0, options))
    return Topology("cluster", node, tuple(hosts))


def _tls_kwargs(node: Address) -> dict[str, Any]:
    """redis-py's TLS keywords for a ``rediss`` address; none for a plain one."""
    return {"ssl": True, **dict(node.tls_options)} if node.tls else {}


def _node_kwargs(node: Address) -> dict[str, Any]:
    """redis-py connection keywords for the data nodes: login and TLS."""
    return {"username": node.username, "password": node.password, **_tls_kwargs(node)}


def _sentinel_kwargs(topology: Topology, kwargs: dict[str, Any]) -> dict[str, Any]:
    timeouts = {k: v for k, v in kwargs.items()
                if k in ("socket_timeout", "socket_connect_timeout")}
    return {**timeouts, **topology.sentinel_kwargs()}


def sync_redis(url: str, **kwargs: Any) -> redis.Redis:
    """A redis-py client for ``url`` with ``kwargs`` (timeouts, retries...): a plain one,
    the primary as the sentinels name it (re-asked after a failover), or a cluster client
    that routes each command by its key's slot. A cluster client is typed as ``Redis``:
    conveyor calls only what both offer, one slot per command (keys.py's hash tags)."""
    topology = parse_topology(url)
    if topology.kind == "single":
        return redis.Redis.from_url(url, **kwargs)
    if topology.kind == "sentinel":
        sentinel = redis.sentinel.Sentinel(  # type: ignore[no-untyped-call, unused-ignore]
            list(topology.hosts), sentinel_kwargs=_sentinel_kwargs(topology, kwargs))
        return cast(redis.Redis, sentinel.master_for(  # type: ignore[no-untyped-call, unused-ignore]
            topology.service, db=topology.node.db, **_node_kwargs(topology.node), **kwargs))
    kwargs.pop("health_check_interval", None)
    nodes = [redis.cluster.ClusterNode(h, p)  # type: ignore[no-untyped-call]
             for h, p in topology.hosts]
    return cast(redis.Redis, redis.cluster.RedisCluster(
        startup_nodes=nodes, **_node_kwargs(topology.node), **kwargs))


def async_redis(url: str, **kwargs: Any) -> aioredis.Redis:
    """:func:`sync_redis` for asyncio (``redis.asyncio``)."""
    topology = parse_topology(url)
    if topology.kind == "single":
        return aioredis.Redis.from_url(url, **kwargs)
    if topology.kind == "sentinel":
        sentinel = aiosentinel.Sentinel(  # type: ignore[no-untyped-call, unused-ignore]
            list(topology.hosts), sentinel_kwargs=_sentinel_kwargs(topology, kwargs))
        return cast(aioredis.Redis, sentinel.master_for(
            topology.service, db=topology.node.db, **_node_kwargs(topology.node), **kwargs))
    kwargs.pop("health_check_interval", None)
    nodes = [aiocluster.ClusterNode(h, p) for h, p in topology.hosts]
    return cast(aioredis.Redis, aiocluster.RedisCluster(
        startup_nodes=nodes, **_node_kwargs(topology.node), **kwargs))
