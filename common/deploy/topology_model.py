"""A topology file's model: the run, its shards and its sites, each with its launcher's settings, as frozen dataclasses.

Its own module because the model is what the rest of deploy reads — the renderers (topology_render.py,
bare_metal.py) map it onto the launchers' options — while how a TOML file becomes it, with every check
that names a bad key, is the parser's business (topology_file.py). Field defaults here are the file's
defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dilocox.common.config.waits import STOP_TIMEOUT_S
from dilocox.common.deploy.topology import SHARD_PORT


@dataclass(frozen=True)
class SlurmSettings:
    """A Slurm site's or shards job's settings (the `dilocox deploy slurm` options of the same names)."""

    partition: str = ""
    account: str = ""
    time: str = ""
    state_dir: str = ""  # shared folder for checkpoints (and, for shards, address files)
    setup: tuple[str, ...] = ()  # shell lines run first, e.g. activating a virtual environment
    tls_dir: str = ""  # on the shared filesystem; required unless tls = false
    token_file: str = ""
    cpus_per_rank: int = 8
    rdzv_port: int = 29500
    metrics_port: int = 9100


@dataclass(frozen=True)
class KubernetesSettings:
    """A Kubernetes site's or shards' settings; '' sizes mean the `dilocox deploy kubernetes` default."""

    namespace: str = "dilocox"
    image: str = "dilocox:latest"
    cpu: str = ""
    memory: str = ""
    checkpoint_storage: str = ""
    storage_class: str = ""
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: tuple[dict, ...] = ()  # Kubernetes Toleration objects (key, operator, value, effect, …)
    tls_secret: str = "dilocox-tls"
    token_secret: str = "dilocox-token"
    backoff_limit: int = 4
    # Sites only: the data (an existing claim, or any volume source as a table, e.g. {nfs = {...}}), mounted
    # read-only at data_mount, and an existing claim for the checkpoints instead of a rendered one.
    data_claim: str = ""
    data_volume: dict = field(default_factory=dict)
    data_mount: str = "/data"
    checkpoint_claim: str = ""


@dataclass(frozen=True)
class BareMetalSettings:
    """Hosts started by hand (or by the operator's own tooling): one script per host."""

    hosts: tuple[str, ...] = ()  # a site: one per node (the first hosts the rendezvous); shards: one per shard
    setup: tuple[str, ...] = ()
    tls_dir: str = ""
    token_file: str = ""
    checkpoint_dir: str = ""  # '' : no checkpoints
    rdzv_port: int = 29500
    metrics_port: int = 9100


Settings = SlurmSettings | KubernetesSettings | BareMetalSettings
SETTINGS = {"slurm": SlurmSettings, "kubernetes": KubernetesSettings, "bare-metal": BareMetalSettings}


@dataclass(frozen=True)
class SiteSpec:
    name: str
    launcher: str
    cluster: str  # output folder; a site in the shards' cluster (same launcher) dials their in-cluster names
    nodes: int
    gpus_per_node: int
    pp: int
    dp: int
    data: str = ""  # the worker's --data at this site
    worker_flags: tuple[str, ...] = ()
    inner_round_time_s: float = 0.0  # the site's time box (--inner-round-time-s); 0: H steps a round
    stop_timeout_s: int = STOP_TIMEOUT_S  # torchrun's wait for stopping ranks; a Kubernetes pod's grace is 30 s more
    settings: Settings = field(default_factory=SlurmSettings)

    @property
    def ranks(self) -> int:
        return self.pp * self.dp

    @property
    def ranks_per_node(self) -> int:
        return self.ranks // self.nodes


@dataclass(frozen=True)
class ShardsSpec:
    count: int
    launcher: str
    cluster: str
    port: int = SHARD_PORT  # Slurm and bare metal: shard i listens on port + i; Kubernetes pods: always 50051
    addresses: tuple[str, ...] = ()  # host:port per shard, dialled from outside the shards' cluster
    expose: str = "LoadBalancer"  # Kubernetes: the Service type per shard that `addresses` reach
    settings: Settings | None = None  # None: external
    policy: tuple[str, ...] = ()  # `dilocox server` flags from [shards.policy], in the order given


@dataclass(frozen=True)
class TopologyFile:
    run_id: str
    shards: ShardsSpec
    sites: tuple[SiteSpec, ...]
    rounds: int = 80
    inner_steps: int = 40
    min_clusters: int = 0  # 0: every site
    round_deadline_s: float = 300.0
    worker_flags: tuple[str, ...] = ()  # every site, before its own
    tls: bool = True

    def site(self, name: str) -> SiteSpec:
        return next(s for s in self.sites if s.name == name)

    def in_shards_cluster(self, site: SiteSpec) -> bool:
        """Whether `site` reaches the shards by their names inside one cluster (no external address)."""
        return site.cluster == self.shards.cluster and site.launcher == self.shards.launcher
