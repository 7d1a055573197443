"""The Kubernetes objects of a run: the shards' StatefulSet and Services, and a site's Job, claim and Service.

Its own module because both renderers build these same objects — the single-cluster manifests
(kubernetes.py) and `dilocox deploy topology` (topology_render.py), one cluster's share at a time — and
because what each object holds, and why, is most of what there is to say about running on Kubernetes:

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
"""

from __future__ import annotations

from dilocox.common.config.waits import SHUTDOWN_TIMEOUT_ENV
from dilocox.common.deploy.kubernetes_names import Names
from dilocox.common.deploy.kubernetes_options import Options, dns_label
from dilocox.common.deploy.kubernetes_placement import exposed_services, scheduling
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

TLS_DIR = "/etc/dilocox/tls"
SITE_CHECKPOINT_DIR = "/var/lib/dilocox/site"
RDZV_PORT = 29500
SERVER_FILES = ("ca.pem", "server.pem", "server-key.pem", "client.pem", "client-key.pem")  # client: the exec probe
CLIENT_FILES = ("ca.pem", "client.pem", "client-key.pem")
SERVER_TLS = tls_flags(TLS_DIR, "server")
CLIENT_TLS = tls_flags(TLS_DIR, "client")
FINAL_EXIT_CODE = 3  # worker/main.py: the run is over, or refuses this site; no rerun changes that


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
