"""Where a run's pods land and how shards are reached from outside their cluster.

Two things the single-cluster manifests (kubernetes.py) did not say:

* Scheduling: GPU nodes are commonly tainted and labelled (`nvidia.com/gpu:NoSchedule`, a node pool
  label), so a site's pods need tolerations and a node selector to land there at all. Both are plain
  Kubernetes objects, given per site in the topology file or by `--node-selector` / `--toleration`.
* Exposure: sites in other clusters cannot resolve `*.svc.cluster.local`. Each shard gets its own
  Service selecting its one pod (`statefulset.kubernetes.io/pod-name`), because a site dials every
  shard by its own address — a single Service in front of all shards would balance a site's
  connections across shards that hold different slices. The default type is LoadBalancer: it gives
  each shard a stable external address on every managed cloud without opening node ports; NodePort
  (port 30000-32767 on every node) is there for clusters without a load balancer. The TLS connection
  passes straight through to the shard, so the server certificate must name the external address the
  sites dial (topology_render.certificate_hosts does).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from dilocox.common.deploy.topology import SHARD_PORT, Topology

NODE_PORTS = range(30000, 32768)


def node_selector_item(text: str) -> tuple[str, str]:
    """`KEY=VALUE` → (key, value), for `--node-selector`."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected KEY=VALUE, e.g. cloud.google.com/gke-accelerator=nvidia-h100-80gb"
        )
    return key, value


def toleration(text: str) -> dict:
    """`KEY[=VALUE][:EFFECT]` → a Toleration (Exists without a value, Equal with one), for `--toleration`."""
    spec, _, effect = text.partition(":")
    key, sep, value = spec.partition("=")
    if not key or effect not in ("", "NoSchedule", "PreferNoSchedule", "NoExecute"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY[=VALUE][:NoSchedule|PreferNoSchedule|NoExecute]")
    found = {"key": key, "operator": "Equal", "value": value} if sep else {"key": key, "operator": "Exists"}
    return found | ({"effect": effect} if effect else {})


def add_placement_arguments(add: Callable) -> None:
    add(
        "--servers",
        help="the shards' addresses host:port,… when they run outside this cluster: no shard objects are "
        "rendered and the sites dial these (the server certificate must name them)",
    )
    add(
        "--node-selector",
        type=node_selector_item,
        action="append",
        metavar="KEY=VALUE",
        help="a node label every pod requires, e.g. a GPU node pool's (repeatable)",
    )
    add(
        "--toleration",
        type=toleration,
        action="append",
        metavar="KEY[=VALUE][:EFFECT]",
        help="a taint every pod tolerates, e.g. nvidia.com/gpu:NoSchedule (repeatable)",
    )
    add(
        "--expose-shards",
        choices=("LoadBalancer", "NodePort"),
        help="also a Service of this type per shard, for sites in other clusters (name its external address in the "
        "server certificate)",
    )


def scheduling(options) -> dict:  # noqa: ANN001 — kubernetes_options.Options (imported there from here)
    """The pod spec's nodeSelector and tolerations, absent when none are given."""
    spec: dict = {}
    if options.node_selector:
        spec["nodeSelector"] = dict(options.node_selector)
    if options.tolerations:
        spec["tolerations"] = [dict(t) for t in options.tolerations]
    return spec


def exposed_services(topology: Topology, options, names, labels: dict, metadata: Callable) -> list[dict]:  # noqa: ANN001
    """One Service of `options.expose` per shard, selecting that shard's pod; none unless asked."""
    if not options.expose:
        return []
    ports = options.expose_ports or (0,) * topology.num_shards
    services = []
    for index, port in enumerate(ports):
        pod = f"{names.shards}-{index}"
        grpc: dict = {"name": "grpc", "port": SHARD_PORT, "targetPort": SHARD_PORT}
        if options.expose == "NodePort" and port:
            if port not in NODE_PORTS:
                raise SystemExit(
                    f"dilocox deploy: shard {index}'s NodePort {port} is outside "
                    f"{NODE_PORTS.start}-{NODE_PORTS.stop - 1}"
                )
            grpc["nodePort"] = port
        elif port:
            grpc["port"] = port
        spec = {
            "type": options.expose,
            "selector": {"statefulset.kubernetes.io/pod-name": pod},
            "ports": [grpc],
            "externalTrafficPolicy": "Local",
        }  # the client's address in the shard's log, no extra hop
        services.append(
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": metadata(f"{pod}-external", names, labels | {"dilocox/shard": str(index)}),
                "spec": spec,
            }
        )
    return services
