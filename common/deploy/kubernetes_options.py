"""What a Kubernetes cluster needs beyond the topology: the Options every Kubernetes object is rendered with.

Its own module because the options are shared: `dilocox deploy kubernetes` (kubernetes.py) fills them from
its flags, and `dilocox deploy topology` (topology_render.py) from a topology file's per-cluster tables,
so both render the same objects from the same settings. `dns_label` is here because an option (the
namespace) is the first name made into an RFC 1123 label; every object name is made the same way
(kubernetes_names.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass

from dilocox.common.config.waits import STOP_TIMEOUT_S


@dataclass(frozen=True)
class Options:
    """What the cluster needs beyond the topology. `tls_secret`/`token_secret` None: plaintext / no token."""

    image: str = "dilocox:latest"
    namespace: str = "dilocox"
    gpus_per_rank: int = 1
    ranks_per_pod: int = 0  # 0: a whole site in one pod
    checkpoint_storage: str = "10Gi"
    storage_class: str | None = None
    site_checkpoint_storage: str = "20Gi"  # '': no site checkpoints (a rerun site starts its local state over)
    site_storage_class: str | None = None
    site_checkpoint_claim: str = ""  # an existing claim for the site's checkpoints: none is rendered
    data_claim: str = ""  # an existing claim holding the site's data, mounted read-only at data_mount
    data_volume: dict = dataclasses.field(default_factory=dict)  # or any volume source ({"nfs": {...}}), the same way
    data_mount: str = "/data"
    site_stop_timeout_s: int = STOP_TIMEOUT_S  # torchrun's wait for stopping ranks; the pod's grace is 30 s more
    shard_cpu: str = "2"
    shard_memory: str = "8Gi"
    site_cpu: str = "8"
    site_memory: str = "32Gi"
    tls_secret: str | None = "dilocox-tls"
    token_secret: str | None = "dilocox-token"
    backoff_limit: int = 4
    servers: str = ""  # the shards' addresses when they run outside this cluster: no shard objects are rendered
    node_selector: dict[str, str] = dataclasses.field(default_factory=dict)  # every pod's (kubernetes_placement.py)
    tolerations: tuple[dict, ...] = ()
    expose: str = ""  # '', LoadBalancer or NodePort: a Service per shard reachable from outside the cluster
    expose_ports: tuple[int, ...] = ()  # per shard: the LoadBalancer's port / the nodePort (empty: 50051 / assigned)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Options:
        if min(args.gpus_per_rank, args.ranks_per_pod, args.backoff_limit) < 0:
            raise SystemExit("dilocox deploy kubernetes: --gpus-per-rank, --ranks-per-pod and --backoff-limit are ≥ 0")
        given = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
        return cls(
            **given
            | {
                "namespace": dns_label(args.namespace),
                "token_secret": args.token_secret or None,
                "tls_secret": None if args.insecure else args.tls_secret,
                "servers": args.servers or "",
                "node_selector": dict(args.node_selector or ()),
                "tolerations": tuple(args.toleration or ()),
                "expose": args.expose_shards or "",
            }
        )


def dns_label(text: str, limit: int = 63) -> str:
    """`text` as an RFC 1123 label: lowercase alphanumerics and '-', starting and ending alphanumeric."""
    return re.sub(r"[^a-z0-9-]+", "-", text.lower())[:limit].strip("-") or "x"
