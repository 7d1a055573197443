"""Serving a process's Prometheus registry over HTTP (`--metrics-port`), shared by shards and workers.

Each process builds its own `CollectorRegistry` rather than using prometheus_client's global one, so
several shards (or a shard and a client) in one test process never collide on metric names, and a
scrape shows only what this role defines.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import structlog
from prometheus_client import CollectorRegistry, start_http_server

log = structlog.get_logger()


@dataclass
class MetricsServer:
    """The running `/metrics` endpoint; `close()` stops it and frees the port."""

    port: int
    _httpd: Any

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def serve_metrics(registry: CollectorRegistry, port: int, host: str, role: str, command: str) -> MetricsServer:
    """Serve `registry` at http://host:port/metrics in a daemon thread for the CLI `command` (e.g.
    "dilocox server"), which exits with the reason if the port cannot be bound.

    (The CLI flags treat port 0 as "off" and never call this with it.)
    """
    try:
        httpd, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as error:
        raise SystemExit(f"{command}: cannot serve metrics on port {port}: {error}") from None
    bound = httpd.server_port
    log.info("metrics_serving", role=role, address=f"{host}:{bound}", path="/metrics")
    return MetricsServer(bound, httpd)


def add_metrics_arguments(parser, default_host: str | None) -> None:  # noqa: ANN001
    """--metrics-port / --metrics-host, the same on every role that serves metrics."""
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="serve Prometheus metrics at http://<metrics-host>:PORT/metrics (default 0 = off)",
    )
    parser.add_argument(
        "--metrics-host",
        default=default_host,
        help="address the metrics endpoint listens on (default " + (default_host or "the same as --host") + ")",
    )
