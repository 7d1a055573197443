"""The topology file: one TOML description of a run that spans clusters, from which
`dilocox deploy topology` renders every cluster's launch files and `dilocox certs --topology` the names
the server certificate must hold.

Why a file and not more flags: a run across organisations has per-site settings (launcher, nodes and
GPUs, data path, image, partition, node selectors) that `--worker-flags`-style options applied to every
site cannot say, and the addresses one cluster dials must match where another cluster exposes the
shards. Parsing is strict — an unknown key is an error naming the closest valid key, a wrong type names
the key and the type wanted — because a typo in a launch description otherwise becomes a silently
ignored setting on a cluster the operator cannot see.

The model is plain frozen dataclasses (topology_model.py), the [shards.policy] table its own module
(topology_policy.py); the renderers (topology_render.py) map the model onto the existing launchers'
options, so this module knows nothing about sbatch or manifests.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import tomllib
import typing

from dilocox.common.config.waits import STOP_TIMEOUT_S
from dilocox.common.deploy.topology import SHARD_PORT
from dilocox.common.deploy.topology_model import (
    SETTINGS,
    BareMetalSettings,
    KubernetesSettings,
    Settings,
    ShardsSpec,
    SiteSpec,
    SlurmSettings,
    TopologyFile,
)
from dilocox.common.deploy.topology_policy import policy_flags
from dilocox.common.deploy.topology_values import (
    ADDRESS,
    TopologyFileError,
    build_from,
    check_host,
    check_name,
    check_port,
    choice,
    parse_flags,
    positive,
    shown,
    take_keys,
    typed_value,
)

LAUNCHERS = ("slurm", "kubernetes", "bare-metal")
SHARD_LAUNCHERS = (*LAUNCHERS, "external")
EXPOSE = ("LoadBalancer", "NodePort")
SITE_KEYS = (
    "launcher",
    "cluster",
    "nodes",
    "gpus_per_node",
    "layout",
    "data",
    "worker_flags",
    "inner_round_time_s",
    "stop_timeout_s",
)
SITE_FLAGS = {
    "inner_round_time_s": "--inner-round-time-s",
    "stop_timeout_s": "--stop-timeout-s",
    "data": "--data",
}  # keys that are worker flags
KUBERNETES_SITE_ONLY = ("data_claim", "data_volume", "data_mount", "checkpoint_claim")
STOP_GRACE_S = 30  # the worker's default --stop-grace-s: a stop timeout must leave the ranks more than it
SHARD_KEYS = ("count", "launcher", "cluster", "port", "addresses", "expose", "policy")


def _site(name: str, table: object) -> SiteSpec:
    where = f"sites.{name}"
    check_name(name, where)
    if not isinstance(table, dict):
        raise TopologyFileError(f"{where}: expected a table ([{where}]), got {table!r}")
    if "launcher" not in table:
        raise TopologyFileError(f"{where}.launcher: missing; one of {', '.join(LAUNCHERS)}")
    launcher = choice(table["launcher"], LAUNCHERS, f"{where}.launcher")
    settings_cls = SETTINGS[launcher]
    own = {k: v for k, v in table.items() if k not in SITE_KEYS}
    take_keys(own, where, [*SITE_KEYS, *(f.name for f in dataclasses.fields(settings_cls))])
    settings = typing.cast(Settings, build_from(settings_cls, own, where))
    if "gpus_per_node" not in table:
        raise TopologyFileError(f"{where}.gpus_per_node: missing (GPUs each node gives the site; 0 for CPU)")
    nodes = positive(typing.cast(int, typed_value(table.get("nodes", 1), int, f"{where}.nodes")), f"{where}.nodes")
    gpus = positive(
        typing.cast(int, typed_value(table["gpus_per_node"], int, f"{where}.gpus_per_node")),
        f"{where}.gpus_per_node",
        0,
    )
    per_node = gpus or 1
    pp, dp = 1, nodes * per_node
    if "layout" in table:
        layout = typing.cast(str, typed_value(table["layout"], str, f"{where}.layout"))
        try:
            pp, dp = (int(x) for x in layout.lower().split("x"))
        except ValueError:
            raise TopologyFileError(f'{where}.layout: {layout!r} is not PPxDP (e.g. "2x4")') from None
        if min(pp, dp) < 1 or (pp * dp) % nodes or (gpus and pp * dp != nodes * gpus):
            raise TopologyFileError(
                f"{where}.layout: {layout} is {pp * dp} ranks, which {nodes} node(s) × {gpus} GPU(s) "
                "cannot hold one rank per GPU"
                if gpus
                else f"{where}.layout: {layout} is {pp * dp} ranks, not a multiple of {nodes} nodes"
            )
    if isinstance(settings, BareMetalSettings) and len(settings.hosts) != nodes:
        raise TopologyFileError(
            f"{where}.hosts: a bare-metal site names one host per node: {nodes} node(s), "
            f"{len(settings.hosts)} host(s) given"
        )
    _check_settings(settings, where)
    data = typing.cast(str, typed_value(table.get("data", ""), str, f"{where}.data"))
    worker_flags = parse_flags(table.get("worker_flags", ""), f"{where}.worker_flags")
    for key, flag in SITE_FLAGS.items():
        if key in table and any(f == flag or f.startswith(flag + "=") for f in worker_flags):
            raise TopologyFileError(f"{where}.worker_flags: {flag} is set by {where}.{key}; give it once")
    box = typing.cast(float, typed_value(table.get("inner_round_time_s", 0.0), float, f"{where}.inner_round_time_s"))
    if box < 0:
        raise TopologyFileError(f"{where}.inner_round_time_s: must be ≥ 0 (0: H inner steps a round), got {box:g}")
    stop = typing.cast(int, typed_value(table.get("stop_timeout_s", STOP_TIMEOUT_S), int, f"{where}.stop_timeout_s"))
    if stop <= STOP_GRACE_S:
        raise TopologyFileError(
            f"{where}.stop_timeout_s: {stop} s would kill the ranks within the worker's {STOP_GRACE_S} s stop grace; "
            "give a step plus the exchange's grace (default 300)"
        )
    if isinstance(settings, KubernetesSettings):
        _check_site_volumes(settings, data, where)
    return SiteSpec(
        name=name,
        launcher=launcher,
        cluster=check_name(table.get("cluster", name), f"{where}.cluster"),
        nodes=nodes,
        gpus_per_node=gpus,
        pp=pp,
        dp=dp,
        data=data,
        worker_flags=worker_flags,
        inner_round_time_s=box,
        stop_timeout_s=stop,
        settings=settings,
    )


def _check_site_volumes(settings: KubernetesSettings, data: str, where: str) -> None:
    """A Kubernetes site's data volume and checkpoint claim: names Kubernetes accepts, a data path inside the mount."""
    for key in ("data_claim", "checkpoint_claim"):
        value = getattr(settings, key)
        if value and not re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", value):
            raise TopologyFileError(
                f"{where}.{key}: {value!r} is not a PersistentVolumeClaim name (lowercase, digits, '-', '.')"
            )
    if settings.data_claim and settings.data_volume:
        raise TopologyFileError(f"{where}.data_volume: give data_claim or data_volume, not both")
    if settings.data_volume and len(settings.data_volume) != 1:
        raise TopologyFileError(
            f'{where}.data_volume: one volume source (e.g. {{nfs = {{server = "…", path = "/…"}}}}), '
            f"got keys {sorted(settings.data_volume)}"
        )
    mount = settings.data_mount
    if not mount.startswith("/") or mount.rstrip("/") in ("", "/etc", "/dev", "/proc", "/sys"):
        raise TopologyFileError(
            f"{where}.data_mount: {mount!r}: an absolute folder of its own in the pod (default /data)"
        )
    if settings.data_claim or settings.data_volume:
        inside = data == mount or data.startswith(mount.rstrip("/") + "/")
        if not inside:
            raise TopologyFileError(
                f"{where}.data: {data!r} is not inside data_mount {mount!r}, where the data volume is mounted "
                "(give the path of the site's token file or manifest there)"
                if data
                else f"{where}.data: missing: the path of the site's data inside data_mount {mount!r}"
            )


def _shards(table: object) -> ShardsSpec:
    if not isinstance(table, dict):
        raise TopologyFileError("shards: missing ([shards] with count and launcher)")
    if "launcher" not in table:
        raise TopologyFileError(f"shards.launcher: missing; one of {', '.join(SHARD_LAUNCHERS)}")
    launcher = choice(table["launcher"], SHARD_LAUNCHERS, "shards.launcher")
    settings_cls = SETTINGS.get(launcher)
    fields = [] if settings_cls is None else [f.name for f in dataclasses.fields(settings_cls)]
    own = {k: v for k, v in table.items() if k not in SHARD_KEYS}
    take_keys(own, "shards", [*SHARD_KEYS, *fields])
    count = positive(typing.cast(int, typed_value(table.get("count", 2), int, "shards.count")), "shards.count")
    addresses = typing.cast(tuple, typed_value(table.get("addresses", []), tuple[str, ...], "shards.addresses"))
    for i, address in enumerate(addresses):
        if not ADDRESS.match(address):
            raise TopologyFileError(f"shards.addresses[{i}]: {shown(address)} is not host:port")
        check_port(int(address.rsplit(":", 1)[1]), f"shards.addresses[{i}]")
    if addresses and len(addresses) != count:
        raise TopologyFileError(f"shards.addresses: one per shard: {count} shard(s), {len(addresses)} address(es)")
    settings = None if settings_cls is None else typing.cast(Settings, build_from(settings_cls, own, "shards"))
    if launcher == "external" and not addresses:
        raise TopologyFileError("shards.addresses: external shards need their addresses (host:port, one per shard)")
    if isinstance(settings, BareMetalSettings) and len(settings.hosts) != count:
        raise TopologyFileError(
            f"shards.hosts: bare-metal shards name one host per shard: {count} shard(s), "
            f"{len(settings.hosts)} host(s) given"
        )
    expose = choice(table.get("expose", "LoadBalancer"), EXPOSE, "shards.expose")
    if "expose" in table and launcher != "kubernetes":
        raise TopologyFileError(f"shards.expose: only for shards on Kubernetes (these run on {launcher})")
    port = check_port(
        typing.cast(int, typed_value(table.get("port", SHARD_PORT), int, "shards.port")), "shards.port", count
    )
    if settings is not None:
        _check_settings(settings, "shards", count)
    if isinstance(settings, KubernetesSettings):
        for key in KUBERNETES_SITE_ONLY:
            if key in table:
                raise TopologyFileError(
                    f"shards.{key}: only for a Kubernetes site (a shard's checkpoints are a volume of its own "
                    "per pod: checkpoint_storage, storage_class)"
                )
    if "port" in table and launcher in ("kubernetes", "external"):
        raise TopologyFileError(
            f"shards.port: only for shards on Slurm or bare metal ({launcher} shards: the port is in addresses)"
        )
    if launcher == "kubernetes" and expose == "NodePort":
        for i, address in enumerate(addresses):
            if not 30000 <= int(address.rsplit(":", 1)[1]) <= 32767:
                raise TopologyFileError(
                    f'shards.addresses[{i}]: {address!r}: with expose = "NodePort" the port is the '
                    "shard's nodePort, 30000-32767"
                )
    cluster = check_name(table.get("cluster", "shards"), "shards.cluster")
    policy = policy_flags(table["policy"]) if "policy" in table else ()
    return ShardsSpec(count, launcher, cluster, port, addresses, expose, settings, policy)


def _check_settings(settings: Settings, where: str, processes: int = 1) -> None:
    """What the renderers put on a command line or a host's network: host names, ports."""
    for i, host in enumerate(getattr(settings, "hosts", ())):
        check_host(host, f"{where}.hosts[{i}]")
    for name in ("rdzv_port", "metrics_port"):
        if hasattr(settings, name):
            check_port(getattr(settings, name), f"{where}.{name}", processes)


TOP_KEYS = (
    "run_id",
    "rounds",
    "inner_steps",
    "min_clusters",
    "round_deadline_s",
    "worker_flags",
    "tls",
    "shards",
    "sites",
)


def parse(text: str, source: str = "topology") -> TopologyFile:
    """A topology file's text → its model; TopologyFileError names the bad key."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise TopologyFileError(f"{source}: not valid TOML: {error}") from None
    take_keys(raw, "", TOP_KEYS)
    sites_table = raw.get("sites")
    if not isinstance(sites_table, dict) or not sites_table:
        raise TopologyFileError("sites: missing; add a [sites.<name>] table per site")
    sites = tuple(_site(name, table) for name, table in sites_table.items())
    shards = _shards(raw.get("shards"))
    top = {k: v for k, v in raw.items() if k not in ("shards", "sites", "worker_flags")}
    if "run_id" not in top:
        raise TopologyFileError("run_id: missing (the run's id, the same at every site)")
    check_name(top["run_id"], "run_id")
    model = typing.cast(
        TopologyFile,
        build_from(
            TopologyFile,
            top,
            "",
            shards=shards,
            sites=sites,
            worker_flags=parse_flags(raw.get("worker_flags", ""), "worker_flags"),
        ),
    )
    _check_reach(model)
    return model


def _check_reach(model: TopologyFile) -> None:
    """Every site can dial the shards: in their cluster by name, from outside by `shards.addresses`."""
    outside = [s.name for s in model.sites if not model.in_shards_cluster(s)]
    if outside and not model.shards.addresses:
        raise TopologyFileError(
            f"shards.addresses: sites {', '.join(outside)} run outside the shards' cluster {model.shards.cluster!r} "
            f"({model.shards.launcher}) and dial the shards there: give one host:port per shard (the Kubernetes "
            "shards' Services' external names or IPs, the Slurm shard nodes' public names)"
        )
    if model.min_clusters > len(model.sites):
        raise TopologyFileError(f"min_clusters: {model.min_clusters} is more than the {len(model.sites)} site(s)")
    for site in model.sites:
        if isinstance(site.settings, (SlurmSettings, BareMetalSettings)) and model.tls and not site.settings.tls_dir:
            raise TopologyFileError(
                f"sites.{site.name}.tls_dir: missing (a folder from `dilocox certs` on that cluster), "
                "or set tls = false for plaintext"
            )
    if (
        model.shards.launcher in ("slurm", "bare-metal")
        and model.tls
        and not getattr(model.shards.settings, "tls_dir", "")
    ):
        raise TopologyFileError(
            "shards.tls_dir: missing (a folder from `dilocox certs`), or set tls = false for plaintext"
        )


def load(path: str | pathlib.Path) -> TopologyFile:
    path = pathlib.Path(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise TopologyFileError(f"{path}: {error.strerror}") from None
    return parse(text, str(path))
