"""One description of a multi-site deployment, from which both the compose file and the plain-process
launch are made, so the two cannot drift apart.

A topology is N aggregation shards and some sites; each site is one cluster, a torchrun job of
pp × dp ranks. `commands(topology, placement)` turns it into the exact argv of every process: the
same flags whether the processes run as compose services (addresses are service names, the site's
WAN egress is shaped) or as plain processes on localhost (tests).
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field

SHARD_PORT = 50051
METRICS_PORT = 9100
CHECKPOINT_DIR = "/var/lib/dilocox/checkpoints"
INSECURE = ("--insecure",)  # the simulation's transport; a launcher with certificates passes --tls-* flags instead


def tls_flags(directory: str, role: str) -> tuple[str, ...]:
    """The --tls-* flags of a shard (`role` "server": its certificate, key, and the CA its clients' are
    signed by) or a site ("client") whose files `dilocox certs` wrote into `directory`."""
    d = directory.rstrip("/")
    if role == "server":
        return ("--tls-cert", f"{d}/server.pem", "--tls-key", f"{d}/server-key.pem", "--tls-ca", f"{d}/ca.pem")
    return ("--tls-ca", f"{d}/ca.pem", "--tls-cert", f"{d}/client.pem", "--tls-key", f"{d}/client-key.pem")


@dataclass(frozen=True)
class Site:
    """One cluster: a torchrun job of pp × dp ranks in one container (or on one host)."""

    name: str
    pp: int = 2
    dp: int = 1

    @property
    def ranks(self) -> int:
        return self.pp * self.dp


@dataclass(frozen=True)
class Topology:
    """A run's processes and the knobs the simulation exposes (everything else: CLI defaults)."""

    run_id: str = "compose-sim"
    num_shards: int = 2
    sites: tuple[Site, ...] = (Site("site-a"), Site("site-b"))
    rounds: int = 80
    inner_steps: int = 40
    n_layer: int = 2
    n_embd: int = 64
    block_size: int = 64
    inner_batch_size: int = 8
    min_clusters: int = 1
    round_deadline_s: float = 20.0
    wan_rate_mbit: float = 20.0
    wan_latency_ms: float = 0.0
    # Host port of shard i is host_port_base + i (compose publishes them on 127.0.0.1 for `dilocox status`).
    host_port_base: int = 57051
    host_metrics_base: int = 59100
    extra_worker_flags: tuple[str, ...] = field(default=())
    extra_server_flags: tuple[str, ...] = field(
        default=()
    )  # every shard's, after its own (a topology's [shards.policy])
    # The simulation's worker flags (its small GPT's shape, one thread per rank, --join-late). A real run's
    # launch files (`dilocox deploy`) leave them out: its model and data come from extra_worker_flags.
    simulation: bool = True

    def shard_names(self) -> list[str]:
        return [f"shard-{i}" for i in range(self.num_shards)]


@dataclass(frozen=True)
class Placement:
    """Where processes find each other: compose (service DNS names, fixed container ports, shaped
    WAN egress, checkpoints on volumes) or localhost (distinct ports per process, nothing shaped)."""

    compose: bool

    def shard_address(self, topology: Topology, index: int) -> str:
        if self.compose:
            return f"shard-{index}:{SHARD_PORT}"
        return f"127.0.0.1:{topology.host_port_base + index}"

    def shard_port(self, topology: Topology, index: int) -> int:
        return SHARD_PORT if self.compose else topology.host_port_base + index

    def metrics_port(self, topology: Topology, process: int) -> int:
        return METRICS_PORT if self.compose else topology.host_metrics_base + process

    def listen_host(self) -> str:
        """What a shard binds: every interface in a container, loopback for processes on this host."""
        return "0.0.0.0" if self.compose else "127.0.0.1"


COMPOSE = Placement(compose=True)
LOCALHOST = Placement(compose=False)


@dataclass(frozen=True)
class HostPorts(Placement):
    """Processes on real hosts (a Slurm allocation, bare metal): shards listen on every interface, shard i
    on port `shard_port_base` + i (several may share a host), process p serves metrics on
    `metrics_port_base` + p. Where a site finds a shard is the launcher's (`shard_address`)."""

    compose: bool = False
    shard_port_base: int = SHARD_PORT
    metrics_port_base: int = METRICS_PORT

    def shard_port(self, topology: Topology, index: int) -> int:
        return self.shard_port_base + index

    def metrics_port(self, topology: Topology, process: int) -> int:
        return self.metrics_port_base + process

    def listen_host(self) -> str:
        return "0.0.0.0"


def shard_command(
    topology: Topology,
    index: int,
    placement: Placement,
    checkpoint_dir: str | None = None,
    *,
    keep_serving: bool = True,
    security: Sequence[str] = INSECURE,
    extra: Sequence[str] = (),
) -> list[str]:
    """One shard's argv. The keywords are for launchers of real runs (deploy/kubernetes_objects.py,
    deploy/slurm.py): a shard that exits at the run's end, TLS flags in place of --insecure, more flags (e.g.
    --resume-if-present)."""
    command = [
        "dilocox",
        "server",
        "--num-shards",
        str(topology.num_shards),
        "--shard-index",
        str(index),
        "--host",
        placement.listen_host(),
        "--port",
        str(placement.shard_port(topology, index)),
        "--run-id",
        topology.run_id,
        "--min-clusters",
        str(topology.min_clusters),
        "--round-deadline-s",
        f"{topology.round_deadline_s:g}",
        "--added-latency-ms",
        f"{topology.wan_latency_ms:g}",
        "--metrics-port",
        str(placement.metrics_port(topology, index)),
        # the compose check and the plain-process run read the shards after the sites end
        *(["--keep-serving"] if keep_serving else []),
        "--log-format",
        "json",
        *security,
    ]
    directory = CHECKPOINT_DIR if placement.compose else checkpoint_dir
    if directory:
        command += ["--checkpoint-dir", directory]
    return command + list(topology.extra_server_flags) + list(extra)


def site_commands(
    topology: Topology, index: int, placement: Placement, *, security: Sequence[str] = INSECURE
) -> list[list[str]]:
    """The steps a site runs, in order: in compose, first shape its WAN egress, then the worker. `security`:
    the worker's transport flags (--tls-* for a real run)."""
    site = topology.sites[index]
    servers = ",".join(placement.shard_address(topology, i) for i in range(topology.num_shards))
    worker = [
        "dilocox",
        "worker",
        "--servers",
        servers,
        "--run-id",
        topology.run_id,
        "--cluster",
        site.name,
        "--cluster-index",
        str(index),
        "--num-clusters",
        str(len(topology.sites)),
        "--pp",
        str(site.pp),
        "--dp",
        str(site.dp),
        "--rounds",
        str(topology.rounds),
        "--inner-steps",
        str(topology.inner_steps),
        *(_simulation_flags(topology) if topology.simulation else []),
        "--metrics-port",
        str(placement.metrics_port(topology, topology.num_shards + index)),
        "--metrics-host",
        "0.0.0.0",  # scraped from another host or pod (a worker alone listens on 127.0.0.1)
        "--log-format",
        "json",
        *security,
        # with --min-clusters 1 the first site up may close rounds before the other joins
        *(["--join-late"] if topology.simulation else []),
        *topology.extra_worker_flags,
    ]
    if not placement.compose:
        return [worker]
    shape = ["dilocox", "link", "shape", "--towards", "shard-0", "--rate-mbit", f"{topology.wan_rate_mbit:g}"]
    return [shape, worker]


def _simulation_flags(topology: Topology) -> list[str]:
    return [
        "--n-layer",
        str(topology.n_layer),
        "--n-embd",
        str(topology.n_embd),
        "--block-size",
        str(topology.block_size),
        "--inner-batch-size",
        str(topology.inner_batch_size),
        "--threads",
        "1",
    ]


def as_shell(steps: list[list[str]]) -> str:
    """Steps joined with &&; the last one `exec`s so it gets the container's signals as PID 1's child."""
    quoted = [shlex.join(step) for step in steps]
    quoted[-1] = "exec " + quoted[-1]
    return " && ".join(quoted)


def all_commands(topology: Topology, placement: Placement) -> dict[str, list[list[str]]]:
    """Every service/process name → its steps (each step an argv starting with `dilocox`)."""
    commands: dict[str, list[list[str]]] = {
        name: [shard_command(topology, i, placement)] for i, name in enumerate(topology.shard_names())
    }
    for index, site in enumerate(topology.sites):
        commands[site.name] = site_commands(topology, index, placement)
    return commands
