"""`dilocox deploy topology --file run.toml --out DIR`: every cluster's launch files for a run across clusters.

The file (parsed by topology_file.py into topology_model.py's dataclasses) is mapped onto the launchers' own
options and rendered by their own functions — slurm.shards_script/site_script,
kubernetes_objects.shard_objects/site_objects, bare_metal — so a site gets the same argv whether it was
rendered alone or as part of a topology. What this module adds is the part no single-cluster renderer
can know:

* which address each site dials: the shards' in-cluster names for a site in the shards' own cluster
  (Kubernetes DNS, or the Slurm shards job's address files), `shards.addresses` for every other site;
* the Services exposing Kubernetes shards at those addresses (kubernetes_placement.py);
* every name the server certificate must hold (`certificate_hosts`), printed as the `dilocox certs`
  command and taken by `dilocox certs --topology`;
* per-site worker flags: the run's `worker_flags`, then `--data`, then the site's own flags.

Files land in DIR/<cluster>/ (a site's cluster defaults to its name, the shards' to "shards"); file
names never clash within a folder, so sites sharing a cluster share its folder.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys

import structlog

from dilocox.common.config.waits import STOP_TIMEOUT_S
from dilocox.common.deploy import bare_metal, kubernetes, slurm
from dilocox.common.deploy.kubernetes_names import ClusterPlacement, Names
from dilocox.common.deploy.kubernetes_objects import shard_objects, site_objects
from dilocox.common.deploy.kubernetes_options import Options, dns_label
from dilocox.common.deploy.topology import SHARD_PORT, Site, Topology
from dilocox.common.deploy.topology_file import TopologyFileError, load
from dilocox.common.deploy.topology_model import (
    BareMetalSettings,
    KubernetesSettings,
    SiteSpec,
    SlurmSettings,
    TopologyFile,
)

log = structlog.get_logger()
HELP = "every cluster's files for a run across clusters, from one topology file (TOML; docs/deploy.md)"


def topology_of(model: TopologyFile) -> Topology:
    """The run's Topology: every site of every cluster, so cluster indices and counts are global."""
    return Topology(
        run_id=model.run_id,
        num_shards=model.shards.count,
        sites=tuple(Site(s.name, s.pp, s.dp) for s in model.sites),
        rounds=model.rounds,
        inner_steps=model.inner_steps,
        min_clusters=model.min_clusters or len(model.sites),
        round_deadline_s=model.round_deadline_s,
        extra_worker_flags=model.worker_flags,
        simulation=False,
        extra_server_flags=model.shards.policy,
    )


def for_site(topology: Topology, site: SiteSpec) -> Topology:
    """The topology as `site` sees it: the run's worker flags, its data, time box and stop timeout, then its own
    flags (last wins)."""
    own = [
        *(("--data", site.data) if site.data else ()),
        *(("--inner-round-time-s", f"{site.inner_round_time_s:g}") if site.inner_round_time_s else ()),
        *(("--stop-timeout-s", str(site.stop_timeout_s)) if site.stop_timeout_s != STOP_TIMEOUT_S else ()),
    ]
    flags = (*topology.extra_worker_flags, *own, *site.worker_flags)
    return dataclasses.replace(topology, extra_worker_flags=flags)


def kubernetes_names(model: TopologyFile, settings: KubernetesSettings) -> Names:
    return Names(dns_label(model.run_id, 30), dns_label(settings.namespace))


def in_cluster_addresses(model: TopologyFile) -> tuple[str, ...]:
    """What a site in the shards' own cluster dials; () for Slurm (the shards job's address files)."""
    shards = model.shards
    if isinstance(shards.settings, KubernetesSettings):
        names = kubernetes_names(model, shards.settings)
        return tuple(f"{names.shard_host(i)}:{SHARD_PORT}" for i in range(shards.count))
    if isinstance(shards.settings, BareMetalSettings):
        return tuple(f"{host}:{shards.port + i}" for i, host in enumerate(shards.settings.hosts))
    return ()


def addresses_for(model: TopologyFile, site: SiteSpec) -> tuple[str, ...]:
    return in_cluster_addresses(model) if model.in_shards_cluster(site) else model.shards.addresses


def certificate_hosts(model: TopologyFile) -> list[str]:
    """Every name a site dials a shard by (and localhost, for probes and port-forwards): the server
    certificate's names. A Slurm shards job's node names are not known before it runs: see next_steps."""
    hosts = ["localhost", "127.0.0.1", *(a.rsplit(":", 1)[0].strip("[]") for a in in_cluster_addresses(model))]
    hosts += [a.rsplit(":", 1)[0].strip("[]") for a in model.shards.addresses]
    return list(dict.fromkeys(hosts))


def _slurm_options(model: TopologyFile, settings: SlurmSettings, **more: object) -> slurm.SlurmOptions:
    return slurm.SlurmOptions(
        state_dir=settings.state_dir,
        cpus_per_rank=settings.cpus_per_rank,
        rdzv_port=settings.rdzv_port,
        metrics_port=settings.metrics_port,
        partition=settings.partition,
        account=settings.account,
        time_limit=settings.time,
        tls_dir=settings.tls_dir if model.tls else "",
        token_file=settings.token_file,
        setup=settings.setup,
        **more,
    )


def _kubernetes_options(model: TopologyFile, settings: KubernetesSettings, **more: object) -> Options:
    return Options(
        image=settings.image,
        namespace=dns_label(settings.namespace),
        backoff_limit=settings.backoff_limit,
        tls_secret=settings.tls_secret if model.tls else None,
        token_secret=settings.token_secret or None,
        node_selector=settings.node_selector,
        tolerations=settings.tolerations,
        **more,
    )


def _yaml(objects: list[dict], what: str) -> str:
    return kubernetes.to_yaml(objects, f"# Rendered by `dilocox deploy topology`: {what}. kubectl apply -f this file\n")


def _shard_files(model: TopologyFile, topology: Topology) -> dict[str, str]:
    shards, settings = model.shards, model.shards.settings
    if isinstance(settings, SlurmSettings):
        return {"shards.sbatch": slurm.shards_script(topology, _slurm_options(model, settings, shard_port=shards.port))}
    if isinstance(settings, BareMetalSettings):
        return bare_metal.shard_scripts(topology, settings, shards.port, model.tls)
    if isinstance(settings, KubernetesSettings):
        defaults = Options()
        expose_ports = tuple(int(a.rsplit(":", 1)[1]) for a in shards.addresses)
        options = _kubernetes_options(
            model,
            settings,
            shard_cpu=settings.cpu or defaults.shard_cpu,
            shard_memory=settings.memory or defaults.shard_memory,
            checkpoint_storage=settings.checkpoint_storage or defaults.checkpoint_storage,
            storage_class=settings.storage_class or None,
            expose=shards.expose if shards.addresses else "",
            expose_ports=expose_ports,
        )
        names = kubernetes_names(model, settings)
        placement = ClusterPlacement(compose=True, names=names)
        return {
            "shards.yaml": _yaml(
                shard_objects(topology, options, names, placement), f"the shards of run {model.run_id!r}"
            )
        }
    return {}  # external: nothing to render


def _site_files(model: TopologyFile, topology: Topology, index: int) -> dict[str, str]:
    spec = model.sites[index]
    topology, servers, settings = for_site(topology, spec), addresses_for(model, spec), spec.settings
    if isinstance(settings, SlurmSettings):
        more: dict = {
            "servers": ",".join(servers),
            "gpus_per_node": spec.gpus_per_node,
            "ranks_per_node": spec.ranks_per_node,
            "stop_timeout_s": spec.stop_timeout_s,
        }
        if not servers:  # the shards' own Slurm cluster: their address files, under their state folder
            shared = model.shards.settings
            assert isinstance(shared, SlurmSettings)  # in_shards_cluster: the same launcher
            if settings.state_dir and settings.state_dir != shared.state_dir:
                raise TopologyFileError(
                    f"sites.{spec.name}.state_dir: a Slurm site in the shards' cluster reads their address files "
                    f"under the shards' state_dir {shared.state_dir!r}: leave it unset or the same"
                )
            settings = dataclasses.replace(settings, state_dir=shared.state_dir)
        return {f"site-{spec.name}.sbatch": slurm.site_script(topology, index, _slurm_options(model, settings, **more))}
    if isinstance(settings, BareMetalSettings):
        return bare_metal.site_scripts(topology, index, settings, servers, model.tls, spec.stop_timeout_s)
    assert isinstance(settings, KubernetesSettings)
    defaults = Options()
    options = _kubernetes_options(
        model,
        settings,
        servers=",".join(servers),
        gpus_per_rank=1 if spec.gpus_per_node else 0,
        ranks_per_pod=spec.ranks_per_node,
        site_cpu=settings.cpu or defaults.site_cpu,
        site_memory=settings.memory or defaults.site_memory,
        site_checkpoint_storage=settings.checkpoint_storage or defaults.site_checkpoint_storage,
        site_storage_class=settings.storage_class or None,
        site_checkpoint_claim=settings.checkpoint_claim,
        data_claim=settings.data_claim,
        data_volume=settings.data_volume,
        data_mount=settings.data_mount,
        site_stop_timeout_s=spec.stop_timeout_s,
    )
    names = Names(dns_label(model.run_id, 30), options.namespace)
    placement = ClusterPlacement(compose=True, names=names, servers=servers)
    objects = site_objects(topology, index, options, names, placement)
    return {f"site-{spec.name}.yaml": _yaml(objects, f"site {spec.name} of run {model.run_id!r}")}


def _check_object_names(model: TopologyFile) -> None:
    """Kubernetes sites sharing a namespace (with each other or the shards) need distinct object names."""
    taken: dict[tuple[str, str], str] = {}
    if isinstance(model.shards.settings, KubernetesSettings):
        names = kubernetes_names(model, model.shards.settings)
        taken |= {(names.namespace, names.shards): "the shards", (names.namespace, names.shard_service): "the shards"}
    for spec in model.sites:
        if isinstance(spec.settings, KubernetesSettings):
            names = kubernetes_names(model, spec.settings)
            key = (names.namespace, names.site(Site(spec.name)))
            if key in taken:
                raise TopologyFileError(
                    f"sites.{spec.name}: its Kubernetes objects would be named {key[1]!r} in namespace "
                    f"{key[0]!r}, as {taken[key]}'s are: rename the site or use another namespace"
                )
            taken[key] = f"site {spec.name}"


def render(model: TopologyFile) -> dict[str, str]:
    """DIR-relative path → text, for every cluster of the run."""
    _check_object_names(model)
    topology = topology_of(model)
    files, made_by = {}, {}
    parts = [("the shards", model.shards.cluster, _shard_files(model, topology))]
    parts += [
        (f"site {spec.name}", spec.cluster, _site_files(model, topology, index))
        for index, spec in enumerate(model.sites)
    ]
    for who, cluster, rendered in parts:
        for name, text in rendered.items():
            path = f"{cluster}/{name}"
            if path in files:  # two renderings of one name: one would silently replace the other
                raise TopologyFileError(
                    f"{who} and {made_by[path]} would both be rendered as {path}: rename a site, a cluster "
                    "or a host so that their launch files differ"
                )
            files[path], made_by[path] = text, who
    return files


def next_steps(model: TopologyFile, out: pathlib.Path, files: dict[str, str], source: str = "run.toml") -> str:
    lines = [f"Rendered run {model.run_id!r} into {out}/<cluster>/ — copy each folder to its cluster:"]
    lines += [f"  {out / name}" for name in sorted(files)]
    if model.tls:
        lines += [
            "Certificates (once, anywhere; keep certs/ca-key.pem off every cluster), naming every address a site "
            "dials:",
            f"  dilocox certs --out certs --hosts {','.join(certificate_hosts(model))}",
            f"  (or: dilocox certs --out certs --topology {source})",
        ]
        if model.shards.launcher == "slurm" and any(model.in_shards_cluster(s) for s in model.sites):
            lines.append(
                "  + the Slurm shard nodes' host names: sites in that cluster dial them by their address files"
            )
        lines.append(
            "  Slurm / bare metal: certs/ into each tls_dir; Kubernetes: a Secret of ca.pem, client.pem, "
            "client-key.pem "
            "(+ server.pem, server-key.pem where the shards run) named by tls_secret"
        )
    if model.shards.launcher == "kubernetes" and model.shards.addresses:
        lines.append(
            f"The shards' {model.shards.expose} Services get external IPs: point {', '.join(model.shards.addresses)} "
            "at them "
            "(kubectl get svc -l app.kubernetes.io/component=shard)"
        )
    lines.append("The run token: the same $DILOCOX_TOKEN (or token file / token Secret) at every cluster.")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--file", type=pathlib.Path, required=True, help="the run's topology file (TOML: docs/deploy.md)"
    )
    parser.add_argument(
        "--out", type=pathlib.Path, required=True, help="folder to write DIR/<cluster>/… into (made if absent)"
    )


def run(args: argparse.Namespace) -> int:
    try:
        model = load(args.file)
        files = render(model)
    except TopologyFileError as error:
        print(f"dilocox deploy topology: {error}", file=sys.stderr)
        return 2
    for name, text in files.items():
        path = args.out / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        if text.startswith("#!"):
            path.chmod(0o755)
    log.info("deploy_rendered", launcher="topology", out=str(args.out), files=sorted(files))
    print(next_steps(model, args.out, files, str(args.file)))
    return 0
