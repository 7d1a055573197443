"""`dilocox deploy kubernetes`: a run's manifests for one Kubernetes cluster (≥ 1.28), made from its Topology.

One multi-document file, `dilocox.yaml`. The choices, and why:

* Shards: a StatefulSet of `num_shards` pods behind a headless Service. It gives each shard a stable
  name, hence index and DNS name (`<run>-shard-<i>.<run>-shards.<ns>.svc.cluster.local`: what the sites
  dial and the server certificate names), and a checkpoint volume that outlives the pod. All pods run
  one command; `--shard-index` is the pod's ordinal (the `apps.kubernetes.io/pod-index` label, through the
  downward API, substituted by the kubelet as `$(SHARD_INDEX)`: no shell). A pod restarts over its
  volume, which the first start finds empty, so shards run `--resume-if-present` (`--resume` refuses an
  empty folder, no flag a full one). `--keep-serving`: a StatefulSet restarts a pod that exits, and live
  shards let `dilocox status` and `dilocox export` read the model. Delete the StatefulSet once exported.
  With `--servers` the shards run elsewhere (another cluster: `dilocox deploy topology`) and none of
  this is rendered; `--expose-shards` adds a Service per shard for such sites (kubernetes_placement.py).
* Probes: shards serve grpc.health.v1 (server/serving/health.py). In plaintext the kubelet's native gRPC probe
  asks; it cannot speak TLS, so with TLS an exec probe runs `dilocox health` on localhost with the client
  certificate (mTLS: the shard requires one). A startup probe leaves time for a long `--resume`.
* Sites: an Indexed Job per site, one pod per node of `--ranks-per-pod` ranks (default: a whole site in
  one pod). One pod runs `dilocox worker`, which starts its own torchrun job (worker/site/launch.py).
  Several run torchrun with a static rendezvous on pod 0, `<job>-0.<job>` (a headless Service the pods
  join by `subdomain`): the node rank is the pod's completion index, pod 0 hosts the store without
  resolving its own name, and nothing else (etcd) is needed. `restartPolicy: Never` with a `backoffLimit`
  reruns a failed site, which rejoins at the shards' version; exit code 3 (the run is over or refuses the
  site: worker/main.py) fails the Job at once, and evictions do not count.
* Site checkpoints: a PersistentVolumeClaim per site (`--site-checkpoint-storage`, '' for none) at
  SITE_CHECKPOINT_DIR, and the worker's `--resume-if-present`, so a rerun pod (a node lost, a preemption)
  resumes its AdamW state and data position instead of starting them over; the global model is on the
  shards either way. A site across pods needs a volume every pod mounts: ReadWriteMany there (give a
  storage class that offers it, `--site-storage-class`), ReadWriteOnce for a one-pod site.
* Secrets are made by the operator (`next_steps`) and referenced by name: no secret is in the file. The
  namespace is assumed to exist, so applying needs namespace-scoped rights only.
* Objects are written as JSON, which is YAML: neither the image nor this tool needs a YAML library.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from dataclasses import dataclass

import structlog

from dilocox.common.config.waits import SHUTDOWN_TIMEOUT_ENV, STOP_TIMEOUT_S
from dilocox.common.deploy.kubernetes_placement import add_placement_arguments, exposed_services, scheduling
from dilocox.common.deploy.topology import (
    CHECKPOINT_DIR,
    INSECURE,
    METRICS_PORT,
    SHARD_PORT,
    Placement,
    Site,
    Topology,
    shard_command,
    site_commands,
    tls_flags,
)

log = structlog.get_logger()

NAME = "kubernetes"
HELP = "Kubernetes manifests: a StatefulSet + headless Service for the shards, an Indexed Job per site"
MANIFEST = "dilocox.yaml"
TLS_DIR = "/etc/dilocox/tls"
SITE_CHECKPOINT_DIR = "/var/lib/dilocox/site"
RDZV_PORT = 29500
SERVER_FILES = ("ca.pem", "server.pem", "server-key.pem", "client.pem", "client-key.pem")  # client: the exec probe
CLIENT_FILES = ("ca.pem", "client.pem", "client-key.pem")
SERVER_TLS = tls_flags(TLS_DIR, "server")
CLIENT_TLS = tls_flags(TLS_DIR, "client")
FINAL_EXIT_CODE = 3  # worker/main.py: the run is over, or refuses this site; no rerun changes that


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


def dns_label(text: str, limit: int = 63) -> str:
    """`text` as an RFC 1123 label: lowercase alphanumerics and '-', starting and ending alphanumeric."""
    return re.sub(r"[^a-z0-9-]+", "-", text.lower())[:limit].strip("-") or "x"


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


def pods_of(site: Site, options: Options) -> tuple[int, int]:
    """(pods, ranks per pod) of a site."""
    per_pod = options.ranks_per_pod or site.ranks
    if per_pod >= site.ranks:
        return 1, site.ranks
    if site.ranks % per_pod:
        raise SystemExit(
            f"dilocox deploy kubernetes: --ranks-per-pod {per_pod} does not divide site {site.name}'s "
            f"{site.ranks} ranks"
        )
    return site.ranks // per_pod, per_pod


def _labels(names: Names, component: str, **more: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "dilocox",
        "app.kubernetes.io/instance": names.run,
        "app.kubernetes.io/component": component,
        **more,
    }


def _metadata(name: str, names: Names, labels: dict[str, str]) -> dict:
    return {"name": name, "namespace": names.namespace, "labels": labels}


def _scraped(labels: dict[str, str]) -> dict:
    """A pod template's metadata, with the annotations a Prometheus `kubernetes_sd` job commonly keys on."""
    return {"labels": labels, "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": str(METRICS_PORT)}}


def _env(options: Options, **fields: str) -> list[dict]:
    """Downward-API variables (name → fieldPath), then the run token from its Secret."""
    env = [{"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}} for name, path in fields.items()]
    if options.token_secret:
        env.append(
            {"name": "DILOCOX_TOKEN", "valueFrom": {"secretKeyRef": {"name": options.token_secret, "key": "token"}}}
        )
    return env


def _resources(cpu: str, memory: str, gpus: int = 0) -> dict:
    requests, limits = {"cpu": cpu, "memory": memory}, {"memory": memory}
    if gpus:
        requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = gpus
    return {"requests": requests, "limits": limits}


def _tls(options: Options, files: tuple[str, ...]) -> tuple[list[dict], list[dict]]:
    """(volumes, mounts) of the TLS Secret with only the files this pod needs; none in plaintext."""
    if not options.tls_secret:
        return [], []
    items = [{"key": name, "path": name} for name in files]
    volume = {"name": "tls", "secret": {"secretName": options.tls_secret, "items": items, "defaultMode": 0o400}}
    return [volume], [{"name": "tls", "mountPath": TLS_DIR, "readOnly": True}]


def _probes(options: Options) -> dict:
    if options.tls_secret:  # the kubelet's gRPC probe speaks plaintext only
        check = {
            "exec": {
                "command": ["dilocox", "health", "--server", f"localhost:{SHARD_PORT}", "--timeout", "5", *CLIENT_TLS]
            }
        }
    else:
        check = {"grpc": {"port": SHARD_PORT}}
    check["timeoutSeconds"] = 10
    return {
        "startupProbe": {**check, "periodSeconds": 10, "failureThreshold": 90},  # up to 15 min for a --resume
        "readinessProbe": {**check, "periodSeconds": 10, "failureThreshold": 3},
        "livenessProbe": {**check, "periodSeconds": 20, "failureThreshold": 6},
    }


def _headless_service(name: str, names: Names, labels: dict, selector: dict, ports: list[tuple[str, int]]) -> dict:
    """DNS names for the selected pods, ready or not (a site's pod 0 is dialled before anything is ready)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(name, names, labels),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector,
            "ports": [{"name": port_name, "port": port, "targetPort": port} for port_name, port in ports],
        },
    }


def shard_objects(topology: Topology, options: Options, names: Names, placement: Placement) -> list[dict]:
    labels = _labels(names, "shard")
    selector = {k: labels[k] for k in ("app.kubernetes.io/instance", "app.kubernetes.io/component")}
    security = SERVER_TLS if options.tls_secret else INSECURE
    command = shard_command(topology, 0, placement, security=security, extra=["--resume-if-present"])
    command[command.index("--shard-index") + 1] = "$(SHARD_INDEX)"  # one template for every pod: its ordinal
    volumes, mounts = _tls(options, SERVER_FILES)
    container = {
        "name": "shard",
        "image": options.image,
        "imagePullPolicy": "IfNotPresent",
        "command": command,
        "env": _env(options, SHARD_INDEX="metadata.labels['apps.kubernetes.io/pod-index']"),
        "ports": [{"name": "grpc", "containerPort": SHARD_PORT}, {"name": "metrics", "containerPort": METRICS_PORT}],
        "resources": _resources(options.shard_cpu, options.shard_memory),
        **_probes(options),
        "volumeMounts": [{"name": "checkpoints", "mountPath": CHECKPOINT_DIR}, *mounts],
    }
    claim = {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": options.checkpoint_storage}}}
    if options.storage_class:
        claim["storageClassName"] = options.storage_class
    statefulset = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _metadata(names.shards, names, labels),
        "spec": {
            "serviceName": names.shard_service,
            "replicas": topology.num_shards,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": selector},
            "persistentVolumeClaimRetentionPolicy": {
                "whenDeleted": "Retain",
                "whenScaled": "Retain",
            },  # the model lives there
            "template": {
                "metadata": _scraped(labels),  # SIGTERM: the shard saves a last checkpoint before it exits
                "spec": {
                    "terminationGracePeriodSeconds": 120,
                    "containers": [container],
                    "volumes": volumes,
                    **scheduling(options),
                },
            },
            "volumeClaimTemplates": [{"metadata": {"name": "checkpoints", "labels": labels}, "spec": claim}],
        },
    }
    service = _headless_service(
        names.shard_service, names, labels, selector, [("grpc", SHARD_PORT), ("metrics", METRICS_PORT)]
    )
    return [service, statefulset, *exposed_services(topology, options, names, labels, _metadata)]


def site_command(topology: Topology, index: int, options: Options, names: Names, placement: Placement) -> list[str]:
    """The worker's argv from the topology; across pods, under a torchrun whose node rank is the pod's index."""
    site = topology.sites[index]
    worker = site_commands(topology, index, placement, security=CLIENT_TLS if options.tls_secret else INSECURE)[-1]
    if options.site_checkpoint_storage or options.site_checkpoint_claim:
        worker += ["--checkpoint-dir", SITE_CHECKPOINT_DIR, "--resume-if-present"]
    pods, per_pod = pods_of(site, options)
    if pods == 1:
        return worker  # it starts its own standalone torchrun job of pp × dp ranks
    return [
        "torchrun",
        "--nnodes",
        str(pods),
        "--node-rank",
        "$(NODE_RANK)",
        "--nproc-per-node",
        str(per_pod),
        "--master-addr",
        names.site_host(site, 0),
        "--master-port",
        str(RDZV_PORT),
        "-m",
        "dilocox.common.cli",
        *worker[1:],
    ]


def site_objects(topology: Topology, index: int, options: Options, names: Names, placement: Placement) -> list[dict]:
    site = topology.sites[index]
    pods, per_pod = pods_of(site, options)
    name = names.site(site)
    labels = _labels(names, "site", **{"dilocox/site": dns_label(site.name)})
    tls_volumes, tls_mounts = _tls(options, CLIENT_FILES)
    rank = {"NODE_RANK": "metadata.annotations['batch.kubernetes.io/job-completion-index']"} if pods > 1 else {}
    container = {
        "name": "worker",
        "image": options.image,
        "imagePullPolicy": "IfNotPresent",
        "env": [*_env(options, **rank), {"name": SHUTDOWN_TIMEOUT_ENV, "value": str(options.site_stop_timeout_s)}],
        "command": site_command(topology, index, options, names, placement),
        "ports": [{"name": "metrics", "containerPort": METRICS_PORT}, {"name": "rdzv", "containerPort": RDZV_PORT}],
        "resources": _resources(options.site_cpu, options.site_memory, options.gpus_per_rank * per_pod),
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}, *tls_mounts],  # the ranks' shared memory
    }
    volumes = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}, *tls_volumes]
    claim = _site_claim(name, names, labels, options, pods)
    checkpoint_claim = options.site_checkpoint_claim or (claim["metadata"]["name"] if claim is not None else "")
    if checkpoint_claim:
        volumes.append({"name": "checkpoints", "persistentVolumeClaim": {"claimName": checkpoint_claim}})
        container["volumeMounts"].append({"name": "checkpoints", "mountPath": SITE_CHECKPOINT_DIR})
    if options.data_claim or options.data_volume:  # the site's data, read-only: every rank reads, none writes
        source = (
            {"persistentVolumeClaim": {"claimName": options.data_claim, "readOnly": True}}
            if options.data_claim
            else options.data_volume
        )
        volumes.append({"name": "data", **source})
        container["volumeMounts"].append({"name": "data", "mountPath": options.data_mount, "readOnly": True})
    # A stopping site is given what it needs (common/config/waits.py): torchrun's wait, and 30 s more to exit.
    pod = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": options.site_stop_timeout_s + 30,
        "containers": [container],
        "volumes": volumes,
        **scheduling(options),
    }
    pod |= {"subdomain": name} if pods > 1 else {}
    final = {"containerName": "worker", "operator": "In", "values": [FINAL_EXIT_CODE]}
    evicted = [{"type": "DisruptionTarget", "status": "True"}]  # preempted, drained: not the site's fault
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _metadata(name, names, labels),
        "spec": {
            "completionMode": "Indexed",
            "completions": pods,
            "parallelism": pods,
            "backoffLimit": options.backoff_limit,
            # onPodConditions [] on the exit-code rule: Kubernetes 1.28's schema requires the field in every rule
            "podFailurePolicy": {
                "rules": [
                    {"action": "FailJob", "onExitCodes": final, "onPodConditions": []},
                    {"action": "Ignore", "onPodConditions": evicted},
                ]
            },
            "template": {"metadata": _scraped(labels), "spec": pod},
        },
    }
    objects = [] if claim is None else [claim]
    if pods == 1:
        return [*objects, job]
    selector = {"app.kubernetes.io/instance": names.run, "dilocox/site": labels["dilocox/site"]}
    return [*objects, _headless_service(name, names, labels, selector, [("rdzv", RDZV_PORT)]), job]


def _site_claim(name: str, names: Names, labels: dict, options: Options, pods: int) -> dict | None:
    """The site's checkpoint volume: every rank writes its share of a round into one folder, so the pods
    of a site across nodes share it (ReadWriteMany)."""
    if not options.site_checkpoint_storage or options.site_checkpoint_claim:
        return None
    spec = {
        "accessModes": ["ReadWriteOnce" if pods == 1 else "ReadWriteMany"],
        "resources": {"requests": {"storage": options.site_checkpoint_storage}},
    }
    if options.site_storage_class:
        spec["storageClassName"] = options.site_storage_class
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": _metadata(f"{name}-checkpoints", names, labels),
        "spec": spec,
    }


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
