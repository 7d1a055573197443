"""`dilocox deploy slurm`: sbatch scripts for a run, from its topology.

One script for the shards (a job of one task per shard) and one per site (a job of one task per node,
each task a torchrun of that node's ranks, the rendezvous on the allocation's first node). Everything
a restarted job needs is on the shared filesystem under one state folder, so Slurm may requeue any job
(preemption, a node failure, `scontrol requeue`) and the same script picks up where it was:

* shard i writes `<state>/addresses/shard-<i>` (`host:port`) before it serves, and checkpoints under
  `<state>/shards` with `--resume-if-present`;
* a site waits for every shard's address file (unless `--servers` fixed the addresses at render time:
  shards outside this Slurm cluster, the usual case across sites) and checkpoints under `<state>/sites`
  with `--resume-if-present`.

The state folder is `$DILOCOX_STATE_DIR` when set at submission (sbatch exports the environment), else
the one given at render time, else `<submit dir>/dilocox-state/<run id>`. The run token comes from
`--token-file` or from `$DILOCOX_TOKEN` in the submitting environment; TLS from a folder made by
`dilocox certs` on the shared filesystem.
"""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass

from dilocox.common.config.waits import SHUTDOWN_TIMEOUT_ENV, STOP_TIMEOUT_S
from dilocox.common.deploy.topology import (
    METRICS_PORT,
    SHARD_PORT,
    HostPorts,
    Site,
    Topology,
    shard_command,
    site_commands,
    tls_flags,
)

NAME = "slurm"
HELP = "sbatch scripts: one job for the shards, one per site (torchrun across its nodes), requeue-safe"
SERVERS_VAR = "DILOCOX_SERVERS"  # the site script's shell variable holding the shards' addresses


@dataclass(frozen=True)
class SlurmOptions:
    state_dir: str = ""
    servers: str = ""  # fixed shard addresses; empty: read the shards job's address files
    shard_port: int = SHARD_PORT  # shard i listens on shard_port + i (several may share a node)
    gpus_per_node: int = 8  # 0: CPU sites
    ranks_per_node: int = 0  # 0: one per GPU, or every rank of the site on one node without GPUs
    cpus_per_rank: int = 8
    rdzv_port: int = 29500  # site i's torchrun rendezvous listens on rdzv_port + i
    metrics_port: int = METRICS_PORT  # process p (shards first, then sites' rank 0) serves metrics on this + p
    partition: str = ""
    account: str = ""
    time_limit: str = ""
    tls_dir: str = ""  # empty: --insecure
    token_file: str = ""
    setup: tuple[str, ...] = ()  # shell lines run first (e.g. activate a virtual environment)
    stop_timeout_s: int = STOP_TIMEOUT_S  # torchrun's wait for a stopping site's ranks (common/config/waits.py)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SlurmOptions:
        if not args.tls_dir and not args.insecure:
            raise SystemExit(
                "dilocox deploy slurm: pass --tls-dir DIR (certificates from `dilocox certs` on the shared "
                "filesystem) or --insecure (plaintext: a private network only)"
            )
        return cls(
            args.state_dir or "",
            args.servers or "",
            args.shard_port,
            args.gpus_per_node,
            args.ranks_per_node,
            args.cpus_per_rank,
            args.rdzv_port,
            args.metrics_port,
            args.partition or "",
            args.account or "",
            args.time or "",
            args.tls_dir or "",
            args.token_file or "",
            tuple(args.setup or ()),
        )

    def ranks_on_a_node(self, site: Site) -> int:
        per_node = self.ranks_per_node or (self.gpus_per_node if self.gpus_per_node else site.ranks)
        return min(per_node, site.ranks)

    def nodes(self, site: Site) -> int:
        per_node = self.ranks_on_a_node(site)
        if site.ranks % per_node:
            raise SystemExit(
                f"dilocox deploy slurm: site {site.name} has {site.ranks} ranks (pp {site.pp} × dp {site.dp}), "
                f"not a multiple of {per_node} ranks per node: set --ranks-per-node"
            )
        return site.ranks // per_node


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = SlurmOptions()
    add = parser.add_argument
    add(
        "--state-dir",
        help="shared folder for checkpoints and shard addresses (default: $DILOCOX_STATE_DIR at "
        "submission, else <submit dir>/dilocox-state/<run id>)",
    )
    add("--servers", help="the shards' addresses host:port,… when they run elsewhere (no shards job is written)")
    add(
        "--shard-port",
        type=int,
        default=defaults.shard_port,
        help=f"shard i listens on this + i (default {defaults.shard_port})",
    )
    add(
        "--gpus-per-node",
        type=int,
        default=defaults.gpus_per_node,
        help=f"GPUs per site node (default {defaults.gpus_per_node}; 0: CPU)",
    )
    add(
        "--ranks-per-node",
        type=int,
        default=0,
        help="site ranks per node (default: one per GPU; all on one node without GPUs)",
    )
    add(
        "--cpus-per-rank",
        type=int,
        default=defaults.cpus_per_rank,
        help=f"CPU cores per rank or shard (default {defaults.cpus_per_rank})",
    )
    add(
        "--rdzv-port",
        type=int,
        default=defaults.rdzv_port,
        help=f"site i's torchrun rendezvous port is this + i (default {defaults.rdzv_port})",
    )
    add(
        "--metrics-port",
        type=int,
        default=defaults.metrics_port,
        help="shard i serves Prometheus metrics on this + i, site j's rank 0 on this + shards + j (default "
        f"{defaults.metrics_port})",
    )
    add("--partition", help="#SBATCH --partition")
    add("--account", help="#SBATCH --account")
    add("--time", help="#SBATCH --time (e.g. 2-00:00:00)")
    add(
        "--tls-dir",
        help="folder (on the shared filesystem) from `dilocox certs`: server.pem, client.pem, ca.pem and keys",
    )
    add("--insecure", action="store_true", help="plaintext gRPC: only on a private network")
    add(
        "--token-file",
        help="file holding the run token, read at job start (default: $DILOCOX_TOKEN of the submitting shell)",
    )
    add(
        "--setup",
        action="append",
        metavar="LINE",
        help="a shell line each job runs first, e.g. 'source ~/venv/bin/activate' (repeatable)",
    )


@dataclass(frozen=True)
class SlurmPlacement(HostPorts):
    """Shards on the allocation's nodes, found by the sites through the shards' address files."""

    def shard_address(self, topology: Topology, index: int) -> str:
        return f"shard-{index}"  # not used: the site script passes --servers "$DILOCOX_SERVERS"


def transport_flags(options: SlurmOptions, role: str) -> list[str]:
    return list(tls_flags(options.tls_dir, role)) if options.tls_dir else ["--insecure"]


def shell(argv: list[str], raw: dict[str, str]) -> str:
    """`argv` quoted for bash, except the words in `raw`, which become the given shell text (variables)."""
    return " ".join(raw.get(word, shlex.quote(word)) for word in argv)


def _header(job_name: str, options: SlurmOptions, lines: list[str]) -> list[str]:
    head = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --output={job_name}-%j.out",
        "#SBATCH --open-mode=append",
        "#SBATCH --requeue",
        *lines,
    ]
    head += [
        f"#SBATCH --{flag}={value}"
        for flag, value in (
            ("partition", options.partition),
            ("account", options.account),
            ("time", options.time_limit),
        )
        if value
    ]
    return head


def _prologue(topology: Topology, options: SlurmOptions) -> list[str]:
    default_state = options.state_dir or f"$SLURM_SUBMIT_DIR/dilocox-state/{topology.run_id}"
    lines = [
        "set -euo pipefail",
        *options.setup,
        f'STATE="${{DILOCOX_STATE_DIR:-{default_state}}}"',
        "export STATE",
        # torchrun's wait for stopping ranks before it kills them (common/config/waits.py); Slurm's own
        # SIGKILL comes KillWait after its SIGTERM: ask for as long where a site stops by scancel
        f"export {SHUTDOWN_TIMEOUT_ENV}=${{{SHUTDOWN_TIMEOUT_ENV}:-{options.stop_timeout_s}}}",
    ]
    if options.token_file:
        lines.append(f'export DILOCOX_TOKEN="$(cat {shlex.quote(options.token_file)})"')
    return lines


def shards_script(topology: Topology, options: SlurmOptions) -> str:
    placement = SlurmPlacement(shard_port_base=options.shard_port, metrics_port_base=options.metrics_port)
    argv = shard_command(
        topology,
        0,
        placement,
        "$STATE/shards",
        keep_serving=False,
        security=transport_flags(options, "server"),
        extra=["--resume-if-present"],
    )
    index = argv.index("--shard-index") + 1
    argv[index] = "$i"
    argv[argv.index("--port") + 1] = "$port"
    argv[argv.index("--metrics-port") + 1] = "$metrics"
    raw = {"$i": '"$i"', "$port": '"$port"', "$metrics": '"$metrics"', "$STATE/shards": '"$STATE/shards"'}
    task = "\n".join(
        [
            "i=$SLURM_PROCID",
            f"port=$(( {options.shard_port} + i )); metrics=$(( {options.metrics_port} + i ))",
            'echo "$(hostname):$port" > "$STATE/addresses/shard-$i.tmp" && mv "$STATE/addresses/shard-$i.tmp" '
            '"$STATE/addresses/shard-$i"',
            "exec " + shell(argv, raw),
        ]
    )
    lines = _header(
        f"{topology.run_id}-shards",
        options,
        [f"#SBATCH --ntasks={topology.num_shards}", f"#SBATCH --cpus-per-task={options.cpus_per_rank}"],
    )
    lines += _prologue(topology, options)
    lines += [
        'mkdir -p "$STATE/addresses" "$STATE/shards"',
        'rm -f "$STATE/addresses/shard-"*  # a requeued job may land on other nodes: no stale address is read',
        'echo "dilocox: shards job $SLURM_JOB_ID start $(( ${SLURM_RESTART_COUNT:-0} + 1 )) on $SLURM_JOB_NODELIST"',
        "# One task per shard; a shard that stops does not take the others down (they checkpoint and resume).",
        f"srun --kill-on-bad-exit=0 bash -c {shlex.quote(task)}",
    ]
    return "\n".join(lines) + "\n"


def _wait_for_shards(topology: Topology) -> list[str]:
    """Bash that fills $DILOCOX_SERVERS from the shards job's address files (bounded wait)."""
    return [
        f"# The shards job writes one address file per shard; wait for all {topology.num_shards} (at most 30 min).",
        "for _ in $(seq 1800); do",
        f'  [ "$(ls "$STATE/addresses" 2>/dev/null | grep -c "^shard-[0-9]*$")" -ge {topology.num_shards} ] && break',
        "  sleep 1",
        "done",
        f'{SERVERS_VAR}=$(for i in $(seq 0 {topology.num_shards - 1}); do cat "$STATE/addresses/shard-$i"; done | '
        "paste -sd, -)",
        f'[ -n "${SERVERS_VAR}" ] || {{ echo "dilocox: no shard addresses under $STATE/addresses" >&2; exit 1; }}',
    ]


def site_script(topology: Topology, index: int, options: SlurmOptions) -> str:
    site = topology.sites[index]
    nodes, per_node = options.nodes(site), options.ranks_on_a_node(site)
    worker = site_commands(
        topology,
        index,
        SlurmPlacement(shard_port_base=options.shard_port, metrics_port_base=options.metrics_port),
        security=transport_flags(options, "client"),
    )[-1]
    worker = worker[1:] + ["--checkpoint-dir", "$STATE/sites", "--resume-if-present"]  # "dilocox" → python -m …
    worker[worker.index("--servers") + 1] = f"${SERVERS_VAR}"  # every shard's address, known when the job runs
    rdzv = options.rdzv_port + index
    torchrun = [
        "torchrun",
        f"--nnodes={nodes}",
        "--node-rank=$SLURM_NODEID",
        f"--nproc-per-node={per_node}",
        "--master-addr=$HEAD",
        f"--master-port={rdzv}",
        "-m",
        "dilocox.common.cli",
        *worker,
    ]
    raw = {
        f"${SERVERS_VAR}": f'"${SERVERS_VAR}"',
        "$STATE/sites": '"$STATE/sites"',
        "--node-rank=$SLURM_NODEID": '--node-rank="$SLURM_NODEID"',
        "--master-addr=$HEAD": '--master-addr="$HEAD"',
    }
    extra = [
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --cpus-per-task={options.cpus_per_rank * per_node}",
    ]
    if options.gpus_per_node:
        extra.append(f"#SBATCH --gpus-per-node={per_node}")
    lines = _header(f"{topology.run_id}-{site.name}", options, extra)
    lines += _prologue(topology, options)
    lines += [f'{SERVERS_VAR}="{options.servers}"'] if options.servers else _wait_for_shards(topology)
    lines += [
        'mkdir -p "$STATE/sites"',
        'HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)',
        f"export {SERVERS_VAR} HEAD",
        f'echo "dilocox: site {site.name} job $SLURM_JOB_ID start $(( ${{SLURM_RESTART_COUNT:-0}} + 1 )) on '
        "$SLURM_JOB_NODELIST, "
        f'shards ${SERVERS_VAR}"',
        f"# One task per node, each a torchrun of its {per_node} rank(s); the rendezvous is on the first node.",
        f"srun --kill-on-bad-exit=1 bash -c {shlex.quote('exec ' + shell(torchrun, raw))}",
    ]
    return "\n".join(lines) + "\n"


def render(topology: Topology, args: argparse.Namespace) -> dict[str, str]:
    options = SlurmOptions.from_args(args)
    files = {} if options.servers else {"shards.sbatch": shards_script(topology, options)}
    for index, site in enumerate(topology.sites):
        files[f"site-{site.name}.sbatch"] = site_script(topology, index, options)
    return files


def next_steps(topology: Topology, args: argparse.Namespace) -> str:
    out = args.out
    lines = [f"Wrote the sbatch scripts to {out}. From a folder on the shared filesystem:"]
    if not args.servers:
        lines.append(f"  shards=$(sbatch --parsable {out}/shards.sbatch)")
    for site in topology.sites:
        after = "" if args.servers else " --dependency=after:$shards"
        lines.append(f"  sbatch{after} {out}/site-{site.name}.sbatch")
    lines.append("Watch: squeue --me; tail -f <job>-<id>.out; dilocox status --servers <the shards' addresses>")
    lines.append("A requeued or resubmitted job resumes from its checkpoints under the state folder.")
    return "\n".join(lines)
