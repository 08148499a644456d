"""The pod network of the process node: one network namespace per pod, each with its own address.

Layout: a Linux bridge `lpb<pid>` in the host's namespace holds the gateway address (.1) of a /24
of the cluster's pod CIDR (10.244.128.0/24 .. 10.244.254.0/24, one no other interface on this
machine uses, so two test runs side by side do not collide). Every pod gets a namespace
`lopa-<pid>-<n>` with a veth `eth0` on the bridge, an address .2-.127 and a default route via the
gateway; .128-.254 are left for Service virtual IPs (`service_proxy`). So all pods can listen on the
same ports, reach each other by address, and the test process (probes, DNS server, Service proxy)
reaches every pod directly on the bridge.

Where it differs from a cluster's pod network: a single node; no NetworkPolicy; nothing is routed
or NATed out of the pod network (pods reach each other and the bridge's addresses, nothing else).
Needs root (CAP_NET_ADMIN) and the `ip` command. Names carry the owning process id: leftovers of a
run killed with SIGKILL are removed by the next run (`remove_stale`).
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import re
import subprocess
import threading
from pathlib import Path

from .errors import KubeClusterError

NETNS_DIR = Path("/run/netns")
LOCK_FILE = Path("/run/lopa-pod-network.lock")
SUBNETS = [ipaddress.ip_network(f"10.244.{third}.0/24") for third in range(128, 255)]
POD_HOSTS = range(2, 128)  # .1 is the gateway, .128 and up are Service virtual IPs
VIP_HOSTS = range(128, 255)
_OWNED = re.compile(r"^(?:lopa-(\d+)-\d+|lpb(\d+))$")


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
    if check and result.returncode != 0:
        raise KubeClusterError(f"ip {' '.join(args)} failed: {result.stderr.strip()}")
    return result


def available() -> str | None:
    """Why pod networks cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth pairs, mounts)"
    for tool in ("ip", "nsenter", "mount", "sh"):
        if subprocess.run(["which", tool], capture_output=True, check=False).returncode != 0:
            return f"needs the {tool} command"
    if "overlay" not in Path("/proc/filesystems").read_text():
        return "needs overlayfs (mount points of pod volumes)"
    return None


def _dead(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def remove_stale() -> None:
    """Removes namespaces and bridges whose owning test process is gone."""
    names = [line.split()[0] for line in ip("netns", "list").stdout.splitlines() if line.strip()]
    links = re.findall(r"^\d+: ([^:@]+)", ip("-o", "link", "show", "type", "bridge").stdout, re.M)
    for name in names + links:
        match = _OWNED.match(name)
        if match and _dead(match.group(1) or match.group(2)):
            if name.startswith("lpb"):
                ip("link", "del", name, check=False)
            else:
                ip("netns", "del", name, check=False)


class PodNetwork:
    """The bridge and its subnet; `add()` makes a pod's namespace, `remove()` deletes it."""

    def __init__(self) -> None:
        remove_stale()
        self.bridge = f"lpb{os.getpid()}"
        self._lock = threading.Lock()
        self._next = 0
        self._free = list(POD_HOSTS)
        self._vips = list(VIP_HOSTS)
        with _host_lock():  # picking a subnet and taking it must not interleave with another run
            self.subnet = _free_subnet()
            self.gateway = str(self.subnet[1])
            ip("link", "add", self.bridge, "type", "bridge")
            ip("addr", "add", f"{self.gateway}/{self.subnet.prefixlen}", "dev", self.bridge)
            ip("link", "set", self.bridge, "up")

    def add(self) -> tuple[str, str]:
        """A new namespace with its own address: (namespace name, address)."""
        with self._lock:
            if not self._free:
                raise KubeClusterError(f"pod network {self.subnet} has no free address")
            host = self._free.pop(0)
            self._next += 1
            name = f"lopa-{os.getpid()}-{self._next}"
        address = str(self.subnet[host])
        veth = f"lpv{os.getpid()}-{self._next}"[:15]
        ip("netns", "add", name)
        try:
            ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", name)
            ip("link", "set", veth, "master", self.bridge, "up")
            ip("-n", name, "addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", "eth0")
            ip("-n", name, "link", "set", "eth0", "up")
            ip("-n", name, "link", "set", "lo", "up")
            ip("-n", name, "route", "add", "default", "via", self.gateway)
        except BaseException:
            self.remove(name, address)
            raise
        return name, address

    def remove(self, name: str, address: str) -> None:
        """Deletes the namespace (its veth pair goes with it) and frees the address."""
        ip("netns", "del", name, check=False)
        host = int(ipaddress.ip_address(address)) - int(self.subnet.network_address)
        with self._lock:
            if host in POD_HOSTS and host not in self._free:
                self._free.append(host)

    def add_vip(self) -> str:
        """A virtual address on the bridge (for a Service), reachable from every pod and the host."""
        with self._lock:
            if not self._vips:
                raise KubeClusterError(f"pod network {self.subnet} has no free Service address")
            address = str(self.subnet[self._vips.pop(0)])
        ip("addr", "add", f"{address}/32", "dev", self.bridge)
        return address

    def close(self) -> None:
        """Deletes every namespace of this run and the bridge. Idempotent."""
        prefix = f"lopa-{os.getpid()}-"
        for line in ip("netns", "list", check=False).stdout.splitlines():
            if line.startswith(prefix):
                ip("netns", "del", line.split()[0], check=False)
        ip("link", "del", self.bridge, check=False)

    @staticmethod
    def netns_path(name: str) -> Path:
        return NETNS_DIR / name


@contextlib.contextmanager
def _host_lock():  # type: ignore[no-untyped-def]
    with LOCK_FILE.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _free_subnet() -> ipaddress.IPv4Network:
    used = [
        ipaddress.ip_interface(addr).network
        for addr in re.findall(r"inet (\S+)", ip("-4", "-o", "addr").stdout)
    ]
    for subnet in SUBNETS:
        if not any(subnet.overlaps(other) for other in used):
            return subnet
    raise KubeClusterError("no free /24 in 10.244.128.0/17 for a pod network")
