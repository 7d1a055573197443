"""Shape a host's (or container's) egress towards a peer with Linux `tc`, to emulate a WAN link.

Why tbf on the egress device: it is the one rate limiter this project's kernels have (netem is
missing, so latency is added in user space by the shards' `--added-latency-ms`). Shaping the device
that routes to the shards limits exactly the inter-site traffic of a site container, while its
in-site traffic (loopback between its ranks, its own site network) stays unshaped.

Needs CAP_NET_ADMIN (root, or `cap_add: [NET_ADMIN]` in a container).
"""

from __future__ import annotations

import ipaddress
import socket
import subprocess
from dataclasses import dataclass


class ShapingError(RuntimeError):
    """`tc`/`ip` missing, no permission, or no route to the peer."""


@dataclass(frozen=True)
class TokenBucket:
    """tbf parameters for a rate: a bucket of ~10 ms of traffic but at least 66 KiB, and a queue that
    holds at most `queue_ms` of it before dropping.

    Why 66 KiB: veth and container interfaces hand tbf 64 KiB GSO packets; with a smaller bucket tbf
    splits them, drops parts when its queue is full, and TCP stalls on retransmission timeouts (the
    WAN benchmark measured 72–76% of the configured rate that way)."""

    rate_mbit: float
    queue_ms: int = 100

    def __post_init__(self) -> None:
        if not self.rate_mbit > 0:
            raise ValueError(f"rate must be positive, got {self.rate_mbit} Mbit/s")

    @property
    def burst_bytes(self) -> int:
        return max(66 * 1024, int(self.rate_mbit * 1e6 / 8 * 0.01))

    def qdisc_args(self) -> list[str]:
        """The `tbf …` part of a `tc qdisc add|replace … root` command."""
        rate_kbit = max(1, round(self.rate_mbit * 1000))
        return ["tbf", "rate", f"{rate_kbit}kbit", "burst", str(self.burst_bytes), "latency", f"{self.queue_ms}ms"]

    def tc_args(self, device: str) -> list[str]:
        return ["qdisc", "replace", "dev", device, "root", *self.qdisc_args()]


def run_iproute(
    argv: list[str], error: type[Exception] = ShapingError, timeout: float = 20, check: bool = True
) -> subprocess.CompletedProcess:
    """Run an iproute2 command (`ip`, `tc`); a missing binary, or a failure when `check`, raises
    `error` with the command's own message (the WAN benchmark passes its NamespaceError)."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError:
        raise error(f"{argv[0]} is not installed (iproute2 provides ip and tc)") from None
    if check and done.returncode != 0:
        raise error(f"`{' '.join(argv)}` failed: {done.stderr.strip() or done.stdout.strip()}")
    return done


def _run(argv: list[str]) -> str:
    return run_iproute(argv).stdout


def resolve(host: str) -> str:
    """One IPv4/IPv6 address of `host` (a literal address is returned as is)."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
    except socket.gaierror as error:
        raise ShapingError(f"cannot resolve {host!r}: {error}") from None


def device_towards(host: str) -> str:
    """The network device the kernel uses to reach `host` (`ip route get`)."""
    words = _run(["ip", "-o", "route", "get", resolve(host)]).split()
    if "dev" not in words:
        raise ShapingError(f"no route to {host}")
    return words[words.index("dev") + 1]


def shape_egress(device: str, bucket: TokenBucket) -> None:
    """Replace the root qdisc of `device` with a token bucket (idempotent: `replace`)."""
    _run(["tc", *bucket.tc_args(device)])


def egress_qdisc(device: str) -> str:
    """`tc qdisc show` for the device: what is in force, for logs and checks."""
    return _run(["tc", "qdisc", "show", "dev", device]).strip()
