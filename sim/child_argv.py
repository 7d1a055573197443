"""The argv of each process `dilocox sim` starts: a shard, a cluster, and the export at the end.

Its own module because these command lines are what makes the sim a deployment in miniature — the same
`dilocox server` / `dilocox worker` / `dilocox export` flags a real run gives, only on localhost — and
they read nothing of the running simulation: each is a pure function of the sim's flags, the run's
configuration and what the caller passes in (addresses, security flags, ports), testable without a process.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from dilocox.common.config.run import RunConfig
from dilocox.common.config.run_flags import config_flags


def dilocox_argv(*args: str) -> list[str]:
    """`dilocox ARGS` run by this interpreter, so a child imports the same installation as the sim."""
    return [sys.executable, "-m", "dilocox.common.cli", *args]


def metrics_flags(args: argparse.Namespace, process: int) -> list[str]:
    """Process `process` (shards first, then clusters) serves metrics on --metrics-port + process."""
    if not args.metrics_port:
        return []
    return ["--metrics-port", str(args.metrics_port + process), "--metrics-host", "127.0.0.1"]


def shard_argv(
    args: argparse.Namespace,
    config: RunConfig,
    index: int,
    port_file: pathlib.Path,
    min_clusters: int,
    security: list[str],
) -> list[str]:
    """Shard `index`, on a port of its choosing that it writes to `port_file`."""
    return dilocox_argv(
        "server",
        "--num-shards",
        str(args.shards),
        "--shard-index",
        str(index),
        "--port",
        "0",
        "--port-file",
        str(port_file),
        "--run-id",
        config.run_id,
        "--outer-lr",
        str(config.outer.lr),
        "--outer-momentum",
        str(config.outer.momentum),
        "--min-clusters",
        str(min_clusters),
        "--expect-clusters",
        str(args.clusters),
        "--round-deadline-s",
        str(args.round_deadline_s),
        *(["--grace-s", f"{args.grace_s:g}"] if args.grace_s > 0 else []),
        "--keep-serving",
        "--log-format",
        "json",
        *security,  # the sim exports, then stops them
        *metrics_flags(args, index),
    )


def cluster_argv(
    args: argparse.Namespace,
    config: RunConfig,
    index: int,
    name: str,
    addresses: list[str],
    security: list[str],
    tensorboard_dir: pathlib.Path | None,
) -> list[str]:
    """Cluster `index`, named `name`, dialling the shards at `addresses`; the last one slowed by --slow-cluster."""
    return dilocox_argv(
        "worker",
        "--servers",
        ",".join(addresses),
        "--cluster",
        name,
        "--cluster-index",
        str(index),
        "--num-clusters",
        str(args.clusters),
        "--threads",
        str(args.threads),
        "--log-format",
        "json",
        *(["--data", args.data] if args.data else []),
        "--text-field",
        args.text_field,
        *config_flags(config),
        *security,
        *(["--tensorboard-dir", str(tensorboard_dir)] if tensorboard_dir else []),
        *metrics_flags(args, args.shards + index),
        *(
            ["--simulate-slowdown", f"{args.slow_cluster:g}"]
            if index == args.clusters - 1 and args.slow_cluster != 1
            else []
        ),
    )


def export_argv(
    args: argparse.Namespace, config: RunConfig, addresses: list[str], out: pathlib.Path, security: list[str]
) -> list[str]:
    """`dilocox export` of the run's global model from the still-running shards into `out`."""
    return dilocox_argv(
        "export",
        "--servers",
        ",".join(addresses),
        "--run-id",
        config.run_id,
        "--out",
        str(out),
        "--text-field",
        args.text_field,
        *(["--data", args.data] if args.data else []),
        *security,
    )
