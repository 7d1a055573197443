"""Shaped WAN links for real: one Linux network namespace per site plus a hub, joined by veth pairs.

    site ns "<prefix>s0" ── veth (tbf both ways) ──┐
    site ns "<prefix>s1" ── veth (tbf both ways) ──┤ hub ns "<prefix>hub": shards, relays; forwards site↔site
    …                                               ┘

Every site reaches the hub over its own veth pair; a `tc tbf` token bucket on *both* ends limits each
direction to the configured rate, so a site has a symmetric link of that rate to the rest of the world.
Site-to-site traffic (the AllReduce baseline's gloo ring) is routed through the hub and crosses two
shaped links, each direction limited once per veth, so it also runs at the configured rate. Traffic
inside a site (loopback of its namespace: the ranks of a pipeline-parallel cluster) is not shaped.

Latency and jitter are *not* set here: this kernel has no `netem`, so they are added in user space
(bench/relay.py for gRPC streams, a per-collective wait for gloo). Needs root (CAP_NET_ADMIN + CAP_SYS_ADMIN).

Every name starts with a per-process prefix (`dlx-<pid>-`), and `close()` removes what was created even
after a partial set-up; `sweep()` removes leftovers of a prefix.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field

from dilocox.common.deploy.link_shaping import TokenBucket, run_iproute


class NamespaceError(RuntimeError):
    """Namespaces, veth or tc are unavailable here (not root, no iproute2, a restricted sandbox)."""


def _run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
    return run_iproute(argv, NamespaceError, timeout=30, check=check)


def tbf_args(rate_mbit: float, queue_ms: int = 100) -> list[str]:
    """tbf parameters for both ends of a site's veth: common/deploy/link_shaping.py's token bucket (at least
    66 KiB, so the veth's 64 KiB GSO packets pass whole: with a 4 ms bucket bulk transfers measured
    72–76% of the rate, 96–97% with this one)."""
    return TokenBucket(rate_mbit, queue_ms).qdisc_args()


@dataclass
class SiteLink:
    """One site's namespace and its veth pair to the hub."""

    index: int
    namespace: str
    device: str  # in the site namespace
    hub_device: str  # in the hub namespace
    address: str  # the site's address
    hub_address: str  # the hub's address on this link (what the site dials)


@dataclass
class Topology:
    """`sites` site namespaces around one hub, each link shaped to `rate_mbit` in both directions."""

    sites: int
    rate_mbit: float
    prefix: str = field(default_factory=lambda: f"dlx-{os.getpid()}-")
    subnet: int = field(default_factory=lambda: 16 + os.getpid() % 200)  # 10.<subnet>.<site+1>.0/24
    links: list[SiteLink] = field(default_factory=list)
    _namespaces: list[str] = field(default_factory=list)

    @property
    def hub(self) -> str:
        return self.prefix + "hub"

    def __enter__(self) -> Topology:
        try:
            self.create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ set-up and teardown
    def create(self) -> None:
        if len(self.prefix) + 4 > 15:
            raise NamespaceError(f"prefix {self.prefix!r} too long for interface names (15 characters)")
        self._add_namespace(self.hub)
        _run(["ip", "netns", "exec", self.hub, "sysctl", "-qw", "net.ipv4.ip_forward=1"])
        for i in range(self.sites):
            ns = f"{self.prefix}s{i}"
            self._add_namespace(ns)
            link = SiteLink(
                i,
                ns,
                f"{self.prefix}{i}a",
                f"{self.prefix}{i}b",
                f"10.{self.subnet}.{i + 1}.2",
                f"10.{self.subnet}.{i + 1}.1",
            )
            _run(["ip", "link", "add", link.device, "type", "veth", "peer", "name", link.hub_device])
            try:
                _run(["ip", "link", "set", link.device, "netns", ns])
                _run(["ip", "link", "set", link.hub_device, "netns", self.hub])
            except NamespaceError:
                _run(["ip", "link", "del", link.device], check=False)
                raise
            self.links.append(link)
            _run(["ip", "-n", ns, "addr", "add", f"{link.address}/24", "dev", link.device])
            _run(["ip", "-n", self.hub, "addr", "add", f"{link.hub_address}/24", "dev", link.hub_device])
            _run(["ip", "-n", ns, "link", "set", link.device, "up"])
            _run(["ip", "-n", self.hub, "link", "set", link.hub_device, "up"])
            _run(["ip", "-n", ns, "route", "add", "default", "via", link.hub_address])
            _run(["tc", "-n", ns, "qdisc", "replace", "dev", link.device, "root", *tbf_args(self.rate_mbit)])
            _run(["tc", "-n", self.hub, "qdisc", "replace", "dev", link.hub_device, "root", *tbf_args(self.rate_mbit)])

    def _add_namespace(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._namespaces.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])

    def close(self) -> None:
        """Delete every namespace made here (their veth ends go with them); never raises."""
        for name in reversed(self._namespaces):
            _run(["ip", "netns", "del", name], check=False)
        self._namespaces.clear()
        for link in self.links:  # a veth left in the root namespace by a half-done set-up
            if _run(["ip", "link", "show", link.device], check=False).returncode == 0:
                _run(["ip", "link", "del", link.device], check=False)

    # ------------------------------------------------------------------ use
    def exec_argv(self, namespace: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", namespace, *argv]

    def counters(self, site: int) -> dict[str, int]:
        """Bytes and packets through the site's veth so far (frames as sent: Ethernet/IP/TCP headers included)."""
        link = self.links[site]
        out = _run(["ip", "-n", link.namespace, "-s", "-j", "link", "show", "dev", link.device]).stdout
        stats = json.loads(out)[0]["stats64"]
        return {
            "tx_bytes": stats["tx"]["bytes"],
            "rx_bytes": stats["rx"]["bytes"],
            "tx_packets": stats["tx"]["packets"],
            "rx_packets": stats["rx"]["packets"],
        }

    def qdiscs(self) -> list[str]:
        """What `tc` has in force on every shaped device, for the report."""
        lines = []
        for link in self.links:
            for ns, dev in ((link.namespace, link.device), (self.hub, link.hub_device)):
                lines.append(f"{ns}/{dev}: " + _run(["tc", "-n", ns, "qdisc", "show", "dev", dev]).stdout.strip())
        return lines


def available() -> tuple[bool, str]:
    """Whether namespaces + veth + tbf can be made here; (False, why) otherwise. Makes and removes a probe."""
    if os.geteuid() != 0:
        return False, "not running as root (network namespaces and tc need CAP_NET_ADMIN/CAP_SYS_ADMIN)"
    probe = Topology(sites=1, rate_mbit=100.0, prefix=f"dlx-{os.getpid() % 100000}p-")
    try:
        with probe:
            pass
    except NamespaceError as error:
        return False, str(error)
    return True, "network namespaces, veth pairs and tc tbf are available"


def sweep(prefix: str) -> list[str]:
    """Delete every namespace whose name starts with `prefix` (leftovers of a killed run); returns them."""
    if not prefix.startswith("dlx-"):
        raise ValueError("sweep only removes dlx-… namespaces")
    names = [line.split()[0] for line in _run(["ip", "netns", "list"], check=False).stdout.splitlines() if line.strip()]
    gone = [n for n in names if n.startswith(prefix)]
    for name in gone:
        _run(["ip", "netns", "del", name], check=False)
    return gone
