"""Free TCP ports for tests that start real servers on this machine."""

from __future__ import annotations

import random
import socket


def free_port() -> int:
    """A port free on 127.0.0.1 now, below the kernel's ephemeral ports (`free_port_range`). The OS's own pick
    lies among them, where gloo's pairs and gRPC clients elsewhere in the run take ports at any moment: a
    pipeline test's MASTER_PORT was taken so between this check and torch's bind (EADDRINUSE)."""
    return free_port_range(1, "127.0.0.1")


def _ephemeral_start() -> int:
    """The first port the kernel hands out for outgoing connections (gloo's pairs, gRPC clients)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port_range(count: int, host: str = "0.0.0.0") -> int:
    """A port p with p … p + count − 1 all free now, for processes that take consecutive ports (shard i on
    base + i); they bind them moments later. The range lies below the kernel's ephemeral ports: a
    process group's connections elsewhere in the test run (gloo opens many) take those at any moment,
    and did take a metrics port of the Slurm test between this check and its bind."""
    top = max(10000 + count, _ephemeral_start() - count)
    for _ in range(50):
        base = random.randrange(10000, top)
        try:
            for port in range(base, base + count):
                with socket.socket() as s:
                    s.bind((host, port))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no {count} consecutive free ports found")


def listening(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server accepts on `port`. A connect to a free port in the kernel's ephemeral range can
    succeed by connecting the socket to itself (source port = destination port): that is no listener."""
    with socket.socket() as s:
        return s.connect_ex((host, port)) == 0 and s.getsockname()[1] != port
