"""The `dilocox` console script: one entry point, a subcommand per role.

Subcommand modules are imported only when chosen, so `dilocox --help` stays instant and a shard does
not import the model code.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Mapping

from dilocox.common.config.sources import SettingsError, add_config_option, apply_sources, subparsers_of

SUBCOMMANDS = {
    "server": ("dilocox.server.main", "run one aggregation shard"),
    "worker": ("dilocox.worker.main", "run one cluster (trains and syncs with the shards)"),
    "sim": ("dilocox.sim.main", "local simulation: shards + clusters as processes on localhost"),
    "data": (
        "dilocox.worker.data.prepare",
        "prepare a corpus: tokenise it into a token file + manifest that workers stream from disk",
    ),
    "export": (
        "dilocox.worker.export.export_cli",
        "write the run's global model (from running shards or their checkpoints) as loadable files",
    ),
    "verify": (
        "dilocox.worker.export.verify",
        "check a signed export: its signature, every file's digest, nothing added or removed",
    ),
    "status": ("dilocox.worker.status", "print what each shard is doing"),
    "readmit": (
        "dilocox.worker.readmit",
        "release a site the shards' update check quarantined (needs the shards' operator token)",
    ),
    "health": (
        "dilocox.server.serving.health",
        "exit 0 if a shard answers the standard gRPC health check with SERVING",
    ),
    "certs": ("dilocox.common.deploy.certs", "make a development CA and server/client certificates for TLS/mTLS"),
    "bench": (
        "dilocox.bench.main",
        "benchmarks: wire, overlap, pipeline, wan (vs AllReduce over shaped links), shard; reports in bench/results/",
    ),
    "compose": (
        "dilocox.common.deploy.compose_cli",
        "docker-compose multi-site simulation: render, build offline, check",
    ),
    "deploy": (
        "dilocox.common.deploy.deploy_cli",
        "render a run's launch files: Slurm (sbatch), Kubernetes (manifests), or a run across clusters (topology file)",
    ),
    "link": ("dilocox.common.deploy.link_cli", "shape this host's WAN egress (tc) and measure a link's bulk rate"),
    "plan": (
        "dilocox.worker.site.plan_cli",
        "what a site's layout needs per GPU and per rank, and which layouts fit, before anything is built",
    ),
    "config": (
        "dilocox.common.config.show",
        "print the effective run configuration (flags > env > --config file) as TOML",
    ),
    "docs": (
        "dilocox.common.config.cli_reference",
        "regenerate (or --check) docs/reference.md, every command's flags, from these parsers",
    ),
}


def build_parser(argv: list[str], environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The parser for `argv`'s command. With `environ` (as `main` passes), values from `--config` /
    $DILOCOX_CONFIG and from DILOCOX_<FLAG> variables become the command's defaults (common/config/sources.py);
    without it the parser depends on `argv` alone."""
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
            chain, path = [p], [name]
            nested = subparsers_of(p)
            after = argv[argv.index(name) + 1 :]
            leaf = next((a for a in after if a in nested), None)
            if leaf is not None:
                chain, path = [p, nested[leaf]], [name, leaf]
            add_config_option(chain[-1])
            if environ is not None:
                try:
                    apply_sources(chain, path, argv, environ, SUBCOMMANDS)
                except SettingsError as error:
                    chain[-1].exit(2, f"{chain[-1].prog}: error: {error}\n")  # the reason, without a screen of usage
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv, os.environ).parse_args(argv)
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
