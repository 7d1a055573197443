"""Bare-metal hosts in a topology file: one bash script per host, the same argv the other launchers use.

A lab's GPU boxes or a cloud VM have no scheduler to render for, yet their processes must get exactly
the flags a Slurm or Kubernetes site gets, so the scripts come from the same `shard_command` /
`site_commands` (topology.py). A site of one host runs `dilocox worker`, which starts its own torchrun
job; a site of several hosts runs torchrun on each with a static rendezvous on the first host (the
node rank is fixed per script, so each host gets its own). Restarting a script resumes: shards and
sites run `--resume-if-present` over their checkpoint folder when one is set (a site's folder must be
shared by its hosts, as on Slurm). The run token is `$DILOCOX_TOKEN` of the starting shell unless a
token file is named.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from dilocox.common.config.waits import SHUTDOWN_TIMEOUT_ENV, STOP_TIMEOUT_S
from dilocox.common.deploy.topology import HostPorts, Topology, shard_command, site_commands, tls_flags
from dilocox.common.deploy.topology_model import BareMetalSettings


@dataclass(frozen=True)
class FixedPlacement(HostPorts):
    """Processes on named hosts: sites dial `servers`."""

    servers: tuple[str, ...] = ()

    def shard_address(self, topology: Topology, index: int) -> str:
        return self.servers[index]


def transport(settings: BareMetalSettings, tls: bool, role: str) -> list[str]:
    return list(tls_flags(settings.tls_dir, role)) if tls else ["--insecure"]


def script(what: str, settings: BareMetalSettings, argv: list[str], stop_timeout_s: int = STOP_TIMEOUT_S) -> str:
    lines = [
        "#!/bin/bash",
        f"# {what}",
        "# Rendered by `dilocox deploy topology`; rerunning it resumes from the checkpoint folder.",
        "set -euo pipefail",
        *settings.setup,
        f"export {SHUTDOWN_TIMEOUT_ENV}=${{{SHUTDOWN_TIMEOUT_ENV}:-{stop_timeout_s}}}",
    ]  # a stopping site's ranks: not torchrun's 30 s
    if settings.token_file:
        lines.append(f'export DILOCOX_TOKEN="$(cat {shlex.quote(settings.token_file)})"')
    return "\n".join([*lines, "exec " + shlex.join(argv)]) + "\n"


def file_name(host: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", host)


def shard_scripts(topology: Topology, settings: BareMetalSettings, port: int, tls: bool) -> dict[str, str]:
    """`shard-<i>-<host>.sh` → its script; shard i listens on `port` + i on its host."""
    placement = FixedPlacement(shard_port_base=port, metrics_port_base=settings.metrics_port)
    extra = ["--resume-if-present"] if settings.checkpoint_dir else []
    files = {}
    for index, host in enumerate(settings.hosts):
        argv = shard_command(
            topology,
            index,
            placement,
            settings.checkpoint_dir or None,
            keep_serving=False,
            security=transport(settings, tls, "server"),
            extra=extra,
        )
        files[f"shard-{index}-{file_name(host)}.sh"] = script(
            f"shard {index} of run {topology.run_id!r}, on {host}", settings, argv
        )
    return files


def site_scripts(
    topology: Topology,
    index: int,
    settings: BareMetalSettings,
    servers: tuple[str, ...],
    tls: bool,
    stop_timeout_s: int = STOP_TIMEOUT_S,
) -> dict[str, str]:
    """`site-<name>-<host>.sh` → its script, one per host of site `index`."""
    site = topology.sites[index]
    placement = FixedPlacement(servers=servers, metrics_port_base=settings.metrics_port)
    worker = site_commands(topology, index, placement, security=transport(settings, tls, "client"))[-1]
    if settings.checkpoint_dir:
        worker += ["--checkpoint-dir", settings.checkpoint_dir, "--resume-if-present"]
    hosts, files = settings.hosts, {}
    for rank, host in enumerate(hosts):
        argv = worker
        if len(hosts) > 1:
            argv = [
                "torchrun",
                "--nnodes",
                str(len(hosts)),
                "--node-rank",
                str(rank),
                "--nproc-per-node",
                str(site.ranks // len(hosts)),
                "--master-addr",
                hosts[0],
                "--master-port",
                str(settings.rdzv_port + index),
                "-m",
                "dilocox.common.cli",
                *worker[1:],
            ]
        what = f"site {site.name} of run {topology.run_id!r}, node {rank} of {len(hosts)}, on {host}"
        files[f"site-{site.name}-{file_name(host)}.sh"] = script(what, settings, argv, stop_timeout_s)
    return files
