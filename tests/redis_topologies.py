"""Redis topologies for the high-availability tests, started from scratch on free ports:
a primary with a replica watched by three sentinels, and a three-primary cluster.

Every server is a throwaway ``redis-server`` (Debian's binary; a sentinel is
``redis-server <conf> --sentinel``) under the test's own folder, never the machine's Redis.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import redis

from conveyor.harness import ProcessGroup, RedisServer, free_port, redis_pings
from tests.procs import wait_for

SERVICE = "mymaster"
DOWN_AFTER_MS = 1000
"""How long the sentinels wait before they call the primary down."""


class SentinelSet:
    """A primary, its replica and three sentinels that agree (quorum 2) on failing over."""

    def __init__(self, workdir: Path, sentinels: int = 3) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not on PATH")
        self.workdir = workdir
        self.servers = [RedisServer(_folder(workdir, "primary"))]
        self.servers.append(RedisServer(_folder(workdir, "replica"), "--replicaof", "127.0.0.1",
                                        str(self.servers[0].port)))
        self.sentinel_ports = [free_port() for _ in range(sentinels)]
        self.sentinels = [self._sentinel(binary, port) for port in self.sentinel_ports]
        for port in self.sentinel_ports:
            wait_for(lambda p=port: redis_pings(p), 10, f"sentinel {port}")  # type: ignore[misc]
        self.wait_watched()

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{SERVICE}/0"

    def _sentinel(self, binary: str, port: int) -> ProcessGroup:
        folder = _folder(self.workdir, f"sentinel-{port}")
        conf = folder / "sentinel.conf"
        conf.write_text(
            f"port {port}\nbind 127.0.0.1\ndir {folder}\n"
            f"sentinel monitor {SERVICE} 127.0.0.1 {self.servers[0].port} 2\n"
            f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}\n"
            f"sentinel failover-timeout {SERVICE} 10000\n")
        return ProcessGroup(f"sentinel-{port}", [binary, str(conf), "--sentinel"],
                            log=folder / "sentinel.log")

    def primary_port(self) -> int:
        """The primary as the first sentinel that answers names it."""
        for port in self.sentinel_ports:
            try:
                with redis.Redis(port=port, socket_timeout=1) as sentinel:
                    _, primary = sentinel.sentinel_get_master_addr_by_name(SERVICE)
                    return int(primary)
            except (redis.RedisError, OSError, TypeError):
                continue
        raise AssertionError("no sentinel names a primary")

    def primary(self) -> RedisServer:
        port = self.primary_port()
        return next(s for s in self.servers if s.port == port)

    def wait_watched(self, timeout: float = 30) -> None:
        """Until every sentinel knows the others, one replica, and that replica is in sync."""
        def watched() -> bool:
            for port in self.sentinel_ports:
                with redis.Redis(port=port, socket_timeout=1) as sentinel:
                    state = sentinel.sentinel_master(SERVICE)
                    if (int(state["num-other-sentinels"]) < len(self.sentinel_ports) - 1
                            or int(state["num-slaves"]) < 1):
                        return False
            with redis.Redis(port=self.primary_port(), socket_timeout=1) as primary:
                info = primary.info("replication")
            return bool(info.get("connected_slaves")) and info["slave0"]["state"] == "online"
        wait_for(watched, timeout, "the sentinels to watch the primary and its replica",
                 interval=0.2)

    def logs(self) -> str:
        return "".join(g.tail() for g in self.sentinels)

    def stop(self) -> None:
        for group in self.sentinels:
            group.kill_group()
        for server in self.servers:
            server.stop()


class ClusterSet:
    """A Redis Cluster of ``primaries`` nodes without replicas, slots split evenly
    (``redis-cli --cluster create``)."""

    def __init__(self, workdir: Path, primaries: int = 3) -> None:
        self.servers = [
            RedisServer(_folder(workdir, f"node-{i}"), "--cluster-enabled", "yes",
                        "--cluster-config-file", "nodes.conf", "--cluster-port", str(free_port()),
                        "--cluster-node-timeout", "2000")
            for i in range(primaries)]
        try:
            subprocess.run(["redis-cli", "--cluster", "create",
                            *(f"127.0.0.1:{s.port}" for s in self.servers),
                            "--cluster-replicas", "0", "--cluster-yes"],
                           check=True, capture_output=True, timeout=60)
            wait_for(self._ok, 30, "the cluster to serve every slot", interval=0.2)
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{s.port}" for s in self.servers)

    def _ok(self) -> bool:
        for server in self.servers:
            with redis.Redis(port=server.port, socket_timeout=1) as node:
                info = node.cluster("INFO")
                if info["cluster_state"] != "ok" or int(info["cluster_slots_ok"]) != 16384:
                    return False
        return True

    def port_of_slot(self, slot: int) -> int:
        """The port of the node serving ``slot``, as the cluster says."""
        with redis.Redis(port=self.servers[0].port, socket_timeout=1) as node:
            for start, end, primary, *_ in node.execute_command("CLUSTER SLOTS"):
                if start <= slot <= end:
                    return int(primary[1])
        raise AssertionError(f"no node serves slot {slot}")

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


def _folder(workdir: Path, name: str) -> Path:
    folder = workdir / name
    folder.mkdir(parents=True, exist_ok=True)
    return folder
