"""`dilocox deploy kubernetes`: a run's manifests for one Kubernetes cluster (≥ 1.28), made from its Topology.

One multi-document file, `dilocox.yaml`. Its pieces, each in its own module: the options the flags here
fill (kubernetes_options.py), the objects' names and the shards' addresses (kubernetes_names.py), the objects
themselves and why each is made so (kubernetes_objects.py), where pods land and how other clusters reach
the shards (kubernetes_placement.py). Here they are put into one file, and the operator is told what to
do next:

* Secrets are made by the operator (`next_steps`) and referenced by name: no secret is in the file. The
  namespace is assumed to exist, so applying needs namespace-scoped rights only.
* Objects are written as JSON, which is YAML: neither the image nor this tool needs a YAML library.
"""

from __future__ import annotations

import argparse
import json

import structlog

from dilocox.common.deploy.kubernetes_names import ClusterPlacement, Names
from dilocox.common.deploy.kubernetes_objects import CLIENT_FILES, SERVER_FILES, shard_objects, site_objects
from dilocox.common.deploy.kubernetes_options import Options
from dilocox.common.deploy.kubernetes_placement import add_placement_arguments
from dilocox.common.deploy.topology import SHARD_PORT, Topology

log = structlog.get_logger()

NAME = "kubernetes"
HELP = "Kubernetes manifests: a StatefulSet + headless Service for the shards, an Indexed Job per site"
MANIFEST = "dilocox.yaml"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = Options()
    add = parser.add_argument_group("kubernetes").add_argument
    add(
        "--image",
        default=defaults.image,
        help=f"the Dockerfile's image, where the cluster pulls it (default {defaults.image})",
    )
    add("--namespace", default=defaults.namespace, help=f"an existing namespace (default {defaults.namespace})")
    add("--gpus-per-rank", type=int, default=defaults.gpus_per_rank, help="nvidia.com/gpu per rank (default 1; 0: CPU)")
    add(
        "--ranks-per-pod",
        type=int,
        default=0,
        help="ranks per site pod, i.e. per node; must divide every site's PP×DP (default: a whole site in one pod)",
    )
    add(
        "--checkpoint-storage",
        default=defaults.checkpoint_storage,
        help="each shard's checkpoint volume (default 10Gi)",
    )
    add("--storage-class", help="storage class of the shards' volumes (default: the cluster's default)")
    add(
        "--site-checkpoint-storage",
        default=defaults.site_checkpoint_storage,
        help="each site's checkpoint volume, resumed by a rerun pod (default 20Gi; '' for none). A site across pods "
        "needs ReadWriteMany storage: see --site-storage-class",
    )
    add("--site-storage-class", help="storage class of the sites' volumes (default: the cluster's default)")
    add("--shard-cpu", default=defaults.shard_cpu, help=f"CPU request of a shard (default {defaults.shard_cpu})")
    add("--shard-memory", default=defaults.shard_memory, help=f"memory of a shard (default {defaults.shard_memory})")
    add("--site-cpu", default=defaults.site_cpu, help=f"CPU request of a site pod (default {defaults.site_cpu})")
    add("--site-memory", default=defaults.site_memory, help=f"memory of a site pod (default {defaults.site_memory})")
    add(
        "--tls-secret",
        default=defaults.tls_secret,
        help="Secret with ca.pem, server.pem, server-key.pem, client.pem, client-key.pem (`dilocox certs`)",
    )
    add("--insecure", action="store_true", help="plaintext gRPC inside the cluster, no TLS Secret")
    add(
        "--token-secret",
        default=defaults.token_secret,
        help="Secret whose key `token` is the run's token ('' for none)",
    )
    add("--backoff-limit", type=int, default=defaults.backoff_limit, help="failed pods a site's Job reruns (default 4)")
    add_placement_arguments(add)


def manifests(topology: Topology, options: Options) -> list[dict]:
    """Every object of the run, shards first (the sites wait for them, not the other way round)."""
    names = Names.of(topology, options)
    jobs = [names.site(site) for site in topology.sites]
    if len(set(jobs)) != len(jobs) or names.shard_service in jobs or names.shards in jobs:
        raise SystemExit(
            f"dilocox deploy kubernetes: site names {[s.name for s in topology.sites]} give clashing object names"
        )
    servers = tuple(filter(None, options.servers.split(",")))
    if servers and len(servers) != topology.num_shards:
        raise SystemExit(
            f"dilocox deploy kubernetes: --servers names {len(servers)} shard(s), --shards is {topology.num_shards}"
        )
    placement = ClusterPlacement(compose=True, names=names, servers=servers)
    objects = [] if servers else shard_objects(topology, options, names, placement)
    for index in range(len(topology.sites)):
        objects += site_objects(topology, index, options, names, placement)
    return objects


def to_yaml(objects: list[dict], header: str) -> str:
    """A multi-document YAML stream whose documents are JSON (a subset of YAML)."""
    return header + "".join(f"---\n{json.dumps(obj, indent=2)}\n" for obj in objects)


def render(topology: Topology, args: argparse.Namespace) -> dict[str, str]:
    objects = manifests(topology, Options.from_args(args))
    header = f"# Rendered by `dilocox deploy kubernetes` for run {topology.run_id!r}: kubectl apply -f {MANIFEST}\n"
    log.info("kubernetes_rendered", objects=[f"{o['kind']}/{o['metadata']['name']}" for o in objects])
    return {MANIFEST: to_yaml(objects, header)}


def next_steps(topology: Topology, args: argparse.Namespace) -> str:
    options = Options.from_args(args)
    names, kubectl = Names.of(topology, options), f"kubectl -n {options.namespace}"
    ports = [
        topology.host_port_base + i for i in range(topology.num_shards)
    ]  # port-forwards, as compose publishes them
    servers = options.servers or ",".join(f"127.0.0.1:{p}" for p in ports)
    lines = [
        f"Next, for run {topology.run_id!r}:",
        f"  kubectl create namespace {options.namespace}   # unless it exists",
    ]
    client = " --insecure"
    if options.tls_secret:
        hosts = ",".join(["localhost", "127.0.0.1", *(names.shard_host(i) for i in range(topology.num_shards))])
        files = " ".join(f"--from-file=certs/{f}" for f in (CLIENT_FILES if options.servers else SERVER_FILES))
        expose = "   # + the shard Services' external names/IPs" if options.expose else ""
        lines += [
            "  # certs/: from the run's CA, where the shards' certificates were made"
            if options.servers
            else f"  dilocox certs --out certs --hosts {hosts}{expose}",
            f"  {kubectl} create secret generic {options.tls_secret} {files}   # never ca-key.pem",
        ]
        client = " --tls-ca certs/ca.pem --tls-cert certs/client.pem --tls-key certs/client-key.pem"
    token = ""
    if options.token_secret:
        lines.append(
            f'  {kubectl} create secret generic {options.token_secret} --from-literal=token="$(openssl rand -hex 16)"'
        )
        token = (
            f"DILOCOX_TOKEN=$({kubectl} get secret {options.token_secret} -o jsonpath='{{.data.token}}' | base64 -d) "
        )
    lines += [
        f"  kubectl apply -f {args.out / MANIFEST}",
        f"  {kubectl} get pods -l app.kubernetes.io/instance={names.run} -w   # the shards Ready, then the sites' pods",
        f"  {kubectl} logs -f job/{names.site(topology.sites[0])}   # a site's worker",
        *(
            []
            if options.servers
            else [
                "  # dilocox status, through one port-forward per shard:",
                *(
                    f"  {kubectl} port-forward pod/{names.shards}-{i} {port}:{SHARD_PORT} &"
                    for i, port in enumerate(ports)
                ),
            ]
        ),
        f"  {token}dilocox status --servers {servers}{client}",
    ]
    return "\n".join(lines)
