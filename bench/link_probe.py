"""Bulk TCP throughput through a link: a sink that counts what arrives, a sender that streams for a while.

The WAN benchmark runs the sink and the sender in the namespaces the training uses (or through the
fallback relay), so the rate it reports is the rate the shaped link actually delivered. Only the
steady part is counted: bytes after the first `warmup_s` at the receiver, so the token bucket's
initial burst does not inflate the figure.

    python -m dilocox.bench.link_probe sink HOST PORT_FILE WARMUP_S   # prints one JSON line when done
    python -m dilocox.bench.link_probe send HOST PORT SECONDS [MAX_BYTES]
"""

from __future__ import annotations

import json
import pathlib
import socket
import sys

from dilocox.common.atomic_file import write_text_atomic
from dilocox.common.deploy.link_probe import receive_counted, stream_zeros


def sink(host: str, port_file: str, warmup_s: float, timeout_s: float = 120.0) -> dict:
    """Listen on a free port (written to `port_file`), take one transfer, return what it measured.
    `<port_file>.flowing` appears with the first byte: the prober's window on the kernel's counters starts there."""
    with socket.create_server((host, 0)) as server:
        write_text_atomic(port_file, str(server.getsockname()[1]))
        server.settimeout(timeout_s)
        conn, _ = server.accept()
        with conn:
            conn.settimeout(timeout_s)
            result = receive_counted(conn, warmup_s, lambda: pathlib.Path(port_file + ".flowing").write_text("1"))
    return result.as_dict()


def send(host: str, port: int, seconds: float, max_bytes: int = 0) -> None:
    """Stream zeros for `seconds`, or until `max_bytes` (0: no cap). The cap, with a small send buffer,
    keeps a slow link's probe short: at 0.5 Mbit/s the socket buffers alone hold minutes of backlog,
    which the sink would wait out."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as conn:
        if max_bytes > 0:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 32 * 1024)
        conn.settimeout(60)
        conn.connect((host, port))
        stream_zeros(conn, seconds, max_bytes)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["sink"] and len(argv) == 4:
        print(json.dumps(sink(argv[1], argv[2], float(argv[3]))), flush=True)
    elif argv[:1] == ["send"] and len(argv) in (4, 5):
        send(argv[1], int(argv[2]), float(argv[3]), int(argv[4]) if len(argv) == 5 else 0)
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
