"""Every Kubernetes object's name, and the shards' addresses the sites dial, from the run id and the site names.

Its own module because both renderers name objects the same way — the single-cluster manifests
(kubernetes.py) and `dilocox deploy topology` (topology_render.py), whose clusters must agree on the
shards' in-cluster DNS names — and the objects (kubernetes_objects.py) refer to one another by these names.
"""

from __future__ import annotations

from dataclasses import dataclass

from dilocox.common.deploy.kubernetes_options import Options, dns_label
from dilocox.common.deploy.topology import SHARD_PORT, Placement, Site, Topology


@dataclass(frozen=True)
class Names:
    """Every object's name, from the run id and the site names (short enough for pod host names)."""

    run: str
    namespace: str

    @classmethod
    def of(cls, topology: Topology, options: Options) -> Names:
        return cls(dns_label(topology.run_id, 30), options.namespace)

    @property
    def shards(self) -> str:  # the StatefulSet; its pods are <shards>-<i>
        return f"{self.run}-shard"

    @property
    def shard_service(self) -> str:
        return f"{self.run}-shards"

    def shard_host(self, index: int) -> str:
        return f"{self.shards}-{index}.{self.shard_service}.{self.namespace}.svc.cluster.local"

    def site(self, site: Site) -> str:  # the Job and its headless Service; its pods are <site>-<index>
        return f"{self.run}-{dns_label(site.name, 24)}"

    def site_host(self, site: Site, index: int) -> str:
        return f"{self.site(site)}-{index}.{self.site(site)}.{self.namespace}.svc.cluster.local"


@dataclass(frozen=True)
class ClusterPlacement(Placement):
    """Pods are placed like compose containers (own network, fixed ports, checkpoints on a volume at
    CHECKPOINT_DIR); only the shards' addresses differ: their StatefulSet DNS names, or the given
    `servers` where the shards run outside this cluster."""

    names: Names = Names("dilocox", "dilocox")
    servers: tuple[str, ...] = ()

    def shard_address(self, topology: Topology, index: int) -> str:
        if self.servers:
            return self.servers[index]
        return f"{self.names.shard_host(index)}:{SHARD_PORT}"
