"""The `dilocox` console script: one entry point, a subcommand per role.

Subcommand modules are imported only when chosen, so `dilocox --help` stays instant and a shard does
not import the model code.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "server": ("dilocox.server.main", "run one aggregation shard"),
    "worker": ("dilocox.worker.main", "run one cluster (trains and syncs with the shards)"),
    "sim": ("dilocox.worker.sim", "local simulation: shards + clusters as processes on localhost"),
    "status": ("dilocox.worker.status", "print what each shard is doing"),
    "health": ("dilocox.server.health", "exit 0 if a shard answers the standard gRPC health check with SERVING"),
    "certs": ("dilocox.common.certs", "make a development CA and server/client certificates for TLS/mTLS"),
    "bench": ("dilocox.bench.main", "benchmarks (bytes on the wire, overlap), written to bench/results/"),
    "compose": ("dilocox.common.compose_cli", "docker-compose multi-site simulation: render, build offline, check"),
    "link": ("dilocox.common.link_cli", "shape this host's WAN egress (tc) and measure a link's bulk rate"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dilocox",
        description="DiLoCoX: pre-train one model across GPU clusters joined by slow links.",
        epilog="Run `dilocox <command> --help` for the flags of a command.",
    )
    sub = parser.add_subparsers(dest="command", metavar="command", required=True)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:  # only the chosen command's module is imported
            importlib.import_module(module).add_arguments(p)
            p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
