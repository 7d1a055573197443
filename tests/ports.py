"""Free TCP ports for tests that start real servers on this machine."""

from __future__ import annotations

import random
import socket


def free_port() -> int:
    """A port free on 127.0.0.1 now (the OS's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_range(count: int, host: str = "0.0.0.0") -> int:
    """A port p with p … p + count − 1 all free now, for processes that take consecutive ports (shard i on
    base + i); they bind them moments later, so a collision is unlikely, not impossible."""
    for _ in range(50):
        base = random.randrange(20000, 60000)
        try:
            for port in range(base, base + count):
                with socket.socket() as s:
                    s.bind((host, port))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no {count} consecutive free ports found")
