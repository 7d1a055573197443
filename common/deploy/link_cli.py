"""`dilocox link`: shape this host's egress towards a peer, and measure a link's bulk rate.

dilocox link shape --towards shard-0 --rate-mbit 20   # tc tbf on the device that routes there
dilocox link sink --port 5201                         # count what arrives, answer with the rate
dilocox link probe --to shard-0:5201 --seconds 5      # stream for 5 s, print the rate as JSON
"""

from __future__ import annotations

import argparse
import socket

import structlog

from dilocox.common.deploy.link_probe import send_probe, serve_sink
from dilocox.common.deploy.link_shaping import ShapingError, TokenBucket, device_towards, egress_qdisc, shape_egress
from dilocox.common.logs import add_log_format_argument, configure_logging

log = structlog.get_logger()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_log_format_argument(parser)
    actions = parser.add_subparsers(dest="action", metavar="action", required=True)
    shape = actions.add_parser("shape", help="rate-limit egress towards a host with tc tbf (needs NET_ADMIN)")
    shape.add_argument("--towards", required=True, help="host (name or address) whose route's device is shaped")
    shape.add_argument("--rate-mbit", type=float, required=True, help="rate limit in Mbit/s")
    shape.add_argument(
        "--queue-ms", type=int, default=100, help="queue the bucket may hold before dropping (default 100)"
    )
    sink = actions.add_parser("sink", help="receive probes and answer each with the measured rate")
    sink.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    sink.add_argument("--port", type=int, default=5201, help="port to listen on (default 5201)")
    sink.add_argument("--connections", type=int, default=1, help="probes to serve before exiting (default 1)")
    sink.add_argument("--warmup-s", type=float, default=1.0, help="ignore the first seconds of each probe (default 1)")
    probe = actions.add_parser("probe", help="stream to a sink and print the rate it measured, as JSON")
    probe.add_argument("--to", required=True, help="host:port of a `dilocox link sink`")
    probe.add_argument("--seconds", type=float, default=5.0, help="how long to stream (default 5)")


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_format)
    if args.action == "shape":
        try:
            bucket = TokenBucket(args.rate_mbit, args.queue_ms)
            device = device_towards(args.towards)
            shape_egress(device, bucket)
            log.info(
                "egress_shaped",
                towards=args.towards,
                device=device,
                rate_mbit=args.rate_mbit,
                qdisc=egress_qdisc(device),
            )
        except (ShapingError, ValueError) as error:
            raise SystemExit(f"dilocox link shape: {error}") from None
        return 0
    if args.action == "sink":
        server = socket.create_server((args.host, args.port))
        for result in serve_sink(server, args.connections, args.warmup_s):
            print(result.as_json(), flush=True)
        return 0
    host, _, port = args.to.rpartition(":")
    if not host or not port.isdigit():
        raise SystemExit(f"dilocox link probe: --to must be host:port, got {args.to!r}")
    try:
        print(send_probe(host, int(port), args.seconds).as_json(), flush=True)
    except OSError as error:
        raise SystemExit(f"dilocox link probe: {args.to}: {error}") from None
    return 0
