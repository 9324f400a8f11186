"""Hosts for the multi-host test: network namespaces joined by veth links to a bridge that
lives in a namespace of its own (the switch), all made and removed by the test.

Every name carries this process's pid (namespaces ``cvmh<pid>-<host>``, links
``cv<pid>h<n>`` and ``cv<pid>s<n>``, at most 15 characters), so two runs never meet. The
addresses (``SUBNET``.0/24) exist only inside these namespaces: the machine's own interfaces
and routes never see them, so concurrent runs on one machine may use the same subnet. A run
that died without cleaning up (SIGKILL) leaves namespaces whose pid is gone:
``sweep_leftovers`` ends their processes and deletes them.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass, field

PREFIX = "cvmh"
SUBNET = "10.231.47"
"""The switch's /24; the test sends traffic only to these addresses and to loopback."""
SHM_SIZE = "256m"
"""The ``/dev/shm`` of a host that has its own (an API process's tensor arena: 64 MiB)."""
LEFTOVER = re.compile(rf"^{PREFIX}(?P<pid>\d+)-\S+")


def ip(*args: str) -> str:
    """Run ``ip args...``; its output, or an AssertionError naming the command and its error."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise AssertionError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def unavailable() -> str | None:
    """Why this machine cannot run the test (not root, no ``ip netns``), or None."""
    if os.geteuid() != 0:
        return "needs root to make network namespaces (ip netns add)"
    if shutil.which("ip") is None:
        return "needs the ip command (iproute2)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        ip("netns", "add", probe)
    except AssertionError as exc:
        return f"ip netns is unavailable here: {exc}"
    ip("netns", "del", probe)
    return None


def namespaces() -> list[str]:
    return [line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()]


def _end(netns: str) -> None:
    """SIGKILL whatever still runs in ``netns``, then delete it (its links go with it)."""
    pids = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True,
                          timeout=30).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    with contextlib.suppress(AssertionError):
        ip("netns", "del", netns)


def sweep_leftovers() -> None:
    """Remove the namespaces of earlier runs of this test whose process is gone."""
    for netns in namespaces():
        found = LEFTOVER.match(netns)
        if found and not os.path.exists(f"/proc/{found['pid']}"):
            _end(netns)


@dataclass(frozen=True)
class Host:
    """One namespace on the switch: its name in the test, namespace, address and link."""

    name: str
    netns: str
    address: str
    link: str

    def argv(self, argv: list[str], *, own_shm: bool = False) -> list[str]:
        """``argv`` run inside this host's namespace. ``ip netns exec`` execs it in place,
        so the process keeps the pid (and process group) it was started with. With
        ``own_shm``, on a ``/dev/shm`` of its own (a tmpfs in the mount namespace ``ip netns
        exec`` makes), as on a host of its own: its shared-memory token is not the others'
        (batching/tensor_arena.py), so large inputs take the path between hosts."""
        if not own_shm:
            return ["ip", "netns", "exec", self.netns, *argv]
        return ["ip", "netns", "exec", self.netns, "sh", "-c",
                f'mount -t tmpfs -o size={SHM_SIZE} tmpfs /dev/shm && exec "$@"', "sh", *argv]


@dataclass
class Network:
    """A switch (``open``) and the hosts plugged into it; ``remove`` undoes everything,
    also after a failure halfway through."""

    tag: str = field(default_factory=lambda: str(os.getpid()))
    hosts: dict[str, Host] = field(default_factory=dict)
    made: list[str] = field(default_factory=list)
    switch: str = ""
    bridge: str = ""

    def open(self) -> None:
        """The switch: a bridge in a namespace of its own."""
        self.switch = self._namespace("switch")
        self.bridge = f"cv{self.tag}br"
        ip("-n", self.switch, "link", "add", self.bridge, "type", "bridge")
        ip("-n", self.switch, "link", "set", self.bridge, "up")

    def _namespace(self, name: str) -> str:
        netns = f"{PREFIX}{self.tag}-{name}"
        ip("netns", "add", netns)
        self.made.append(netns)
        ip("-n", netns, "link", "set", "lo", "up")
        return netns

    def add(self, name: str) -> Host:
        """A new host on the switch, with the next address; its loopback is up too."""
        n = len(self.hosts) + 1
        netns = self._namespace(name)
        link, port = f"cv{self.tag}h{n}", f"cv{self.tag}s{n}"
        ip("link", "add", "name", link, "netns", netns, "type", "veth",
           "peer", "name", port, "netns", self.switch)
        ip("-n", self.switch, "link", "set", port, "master", self.bridge, "up")
        address = f"{SUBNET}.{n}"
        ip("-n", netns, "addr", "add", f"{address}/24", "dev", link)
        ip("-n", netns, "link", "set", link, "up")
        host = Host(name, netns, address, link)
        self.hosts[name] = host
        return host

    def cut(self, host: Host) -> None:
        """Take ``host``'s link down: from now on nothing it sends leaves, nothing reaches it."""
        ip("-n", host.netns, "link", "set", host.link, "down")

    def restore(self, host: Host) -> None:
        """Take ``host``'s link up again: what its processes send gets through once more."""
        ip("-n", host.netns, "link", "set", host.link, "up")

    def remove(self) -> None:
        """End every process left in the namespaces and delete them, the switch last."""
        for netns in reversed(self.made):
            _end(netns)
        self.made.clear()
