"""`dilocox deploy kubernetes`: every rendered object validates against the official
Kubernetes schemas (strict: no unknown field), and says what the run needs: each shard's index is its
pod ordinal, probes that speak the shard's transport, checkpoint volumes, the sites dialling every shard
by its stable DNS name, torchrun across a site's pods, GPUs, secrets. Also the server's
`--resume-if-present` that the StatefulSet relies on."""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import shlex
import signal
import subprocess
import sys
import time

import kubernetes_validate  # a test dependency: missing, the tests fail rather than skip
import pytest
import yaml

from dilocox.common.cli import build_parser
from dilocox.common.deploy import kubernetes
from dilocox.common.deploy.deploy_cli import add_topology_arguments, topology_from_args
from dilocox.common.deploy.kubernetes_objects import SITE_CHECKPOINT_DIR
from dilocox.server.shard import Shard
from dilocox.server.state import checkpoint
from tests.ports import free_port, listening

VERSIONS = ("1.28", "1.30", kubernetes_validate.latest_version())  # 1.28: the oldest the docs promise
TOPOLOGY = ["--shards", "2", "--sites", "site-a:2x1,site-b:1x2"]
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def _render(tmp_path: pathlib.Path, *flags: str) -> list[dict]:
    parser = argparse.ArgumentParser()
    add_topology_arguments(parser)
    kubernetes.add_arguments(parser)
    args = parser.parse_args(["--out", str(tmp_path), *TOPOLOGY, *flags])
    files = kubernetes.render(topology_from_args(args), args)
    assert list(files) == [kubernetes.MANIFEST]
    return [doc for doc in yaml.safe_load_all(files[kubernetes.MANIFEST]) if doc is not None]


def _one(objects: list[dict], kind: str, name: str | None = None) -> dict:
    found = [o for o in objects if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    assert len(found) == 1, (kind, name, [o["metadata"]["name"] for o in objects])
    return found[0]


def _container(workload: dict) -> dict:
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return container


def _parses(argv: list[str]) -> argparse.Namespace:
    """A container's dilocox argv, through the CLI's own parser (a torchrun prefix dropped, the kubelet's
    `$(SHARD_INDEX)` as shard 0's)."""
    if argv[0] == "torchrun":
        argv = ["dilocox", *argv[argv.index("dilocox.common.cli") + 1 :]]
    argv = [arg.replace("$(SHARD_INDEX)", "0") for arg in argv]
    assert argv[0] == "dilocox", argv
    return build_parser(argv[1:]).parse_args(argv[1:])


def _env(container: dict) -> dict[str, dict]:
    """The variables a container reads from elsewhere (its pod, a Secret), by name."""
    return {e["name"]: e["valueFrom"] for e in container.get("env", []) if "valueFrom" in e}


def _site_jobs(objects: list[dict]) -> dict[str, dict]:
    return {o["metadata"]["labels"]["dilocox/site"]: o for o in objects if o["kind"] == "Job"}


MODES = {
    "tls-gpu": [],
    "plaintext-cpu": ["--insecure", "--gpus-per-rank", "0", "--token-secret", ""],
    "multi-pod": ["--ranks-per-pod", "1", "--storage-class", "fast-ssd", "--namespace", "Training"],
}
EXTERNAL = [
    "--servers",
    "agg0.example.org:443,203.0.113.9:8443",
    "--node-selector",
    "pool=gpu",
    "--toleration",
    "nvidia.com/gpu:NoSchedule",
    "--toleration",
    "dedicated=ml:NoExecute",
]


@pytest.mark.parametrize("mode", MODES)
def test_every_object_validates_strictly_against_the_kubernetes_schemas(tmp_path, mode):
    objects = _render(tmp_path, *MODES[mode])
    assert [o["kind"] for o in objects][:2] == ["Service", "StatefulSet"]
    for obj in objects:
        assert DNS_LABEL.match(obj["metadata"]["name"]) and DNS_LABEL.match(obj["metadata"]["namespace"])
        for version in VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)


def test_external_shards_are_dialled_by_their_addresses_and_pods_land_on_the_selected_tolerated_nodes(tmp_path):
    objects = _render(tmp_path, *EXTERNAL)
    assert "StatefulSet" not in [o["kind"] for o in objects]  # the shards run elsewhere
    for job in _site_jobs(objects).values():
        pod = job["spec"]["template"]["spec"]
        assert _parses(_container(job)["command"]).servers == "agg0.example.org:443,203.0.113.9:8443"
        assert pod["nodeSelector"] == {"pool": "gpu"}
        assert pod["tolerations"] == [
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
            {"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoExecute"},
        ]
        for version in VERSIONS:
            kubernetes_validate.validate(job, version, strict=True)
    with pytest.raises(SystemExit, match="--servers names 1 shard"):
        _render(tmp_path, "--servers", "agg0.example.org:443")
    exposed = [
        o for o in _render(tmp_path, "--expose-shards", "NodePort") if o["kind"] == "Service" and "type" in o["spec"]
    ]
    assert [s["spec"]["selector"] for s in exposed] == [
        {"statefulset.kubernetes.io/pod-name": f"dilocox-run-shard-{i}"} for i in (0, 1)
    ]
    for service in exposed:
        assert service["spec"]["type"] == "NodePort" and service["spec"]["ports"][0]["targetPort"] == 50051
        for version in VERSIONS:
            kubernetes_validate.validate(service, version, strict=True)


def test_an_unknown_field_is_refused_by_the_validation_used_here(tmp_path):
    statefulset = _one(_render(tmp_path), "StatefulSet")
    _container(statefulset)["restartPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(statefulset, "1.30", strict=True)


@pytest.mark.parametrize("mode", MODES)
def test_shards_are_a_statefulset_whose_ordinal_is_the_shard_index(tmp_path, mode):
    objects = _render(tmp_path, *MODES[mode])
    statefulset, service = _one(objects, "StatefulSet"), _one(objects, "Service", "dilocox-run-shards")
    spec = statefulset["spec"]
    assert spec["replicas"] == 2 and spec["serviceName"] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None"
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {"grpc": 50051, "metrics": 9100}
    assert service["spec"]["selector"].items() <= spec["template"]["metadata"]["labels"].items()
    container = _container(statefulset)
    command = container["command"]
    assert command[command.index("--shard-index") + 1] == "$(SHARD_INDEX)"
    assert _env(container)["SHARD_INDEX"] == {
        "fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}
    }
    args = _parses([arg.replace("$(SHARD_INDEX)", "1") for arg in command])
    assert args.command == "server" and args.shard_index == 1 and args.num_shards == 2
    assert args.resume_if_present and not args.resume and args.port == 50051 and args.host == "0.0.0.0"
    (claim,) = spec["volumeClaimTemplates"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert str(args.checkpoint_dir) == mounts[claim["metadata"]["name"]]
    assert claim["spec"]["resources"]["requests"]["storage"] == "10Gi"
    assert claim["spec"].get("storageClassName") == ("fast-ssd" if mode == "multi-pod" else None)
    assert spec["persistentVolumeClaimRetentionPolicy"]["whenDeleted"] == "Retain"
    assert statefulset["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == "9100"


def test_probes_ask_the_grpc_health_service_natively_in_plaintext_and_by_dilocox_health_with_tls(tmp_path):
    plain = _container(_one(_render(tmp_path, "--insecure"), "StatefulSet"))
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert plain[probe]["grpc"] == {"port": 50051}
    assert "--insecure" in plain["command"] and "volumes" not in plain
    statefulset = _one(_render(tmp_path), "StatefulSet")
    tls = _container(statefulset)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        health = _parses(tls[probe]["exec"]["command"])
        assert health.command == "health" and health.server == "localhost:50051"
    (volume,) = statefulset["spec"]["template"]["spec"]["volumes"]
    held = {item["path"] for item in volume["secret"]["items"]}
    mount = {m["name"]: m["mountPath"] for m in tls["volumeMounts"]}[volume["name"]]
    for path in (health.tls_ca, health.tls_cert, health.tls_key):  # the probe's client certificate is mounted (mTLS)
        assert path.parent == pathlib.Path(mount) and path.name in held
    server = _parses(tls["command"])
    assert not server.insecure and {server.tls_cert.name, server.tls_key.name, server.tls_ca.name} <= held
    assert volume["secret"]["secretName"] == "dilocox-tls" and "ca-key.pem" not in held


@pytest.mark.parametrize("mode", MODES)
def test_every_site_dials_every_shard_by_its_statefulset_dns_name(tmp_path, mode):
    objects = _render(tmp_path, *MODES[mode])
    statefulset = _one(objects, "StatefulSet")
    namespace, name = statefulset["metadata"]["namespace"], statefulset["metadata"]["name"]
    service = statefulset["spec"]["serviceName"]
    shards = [
        f"{name}-{i}.{service}.{namespace}.svc.cluster.local:50051" for i in range(statefulset["spec"]["replicas"])
    ]
    jobs = _site_jobs(objects)
    assert sorted(jobs) == ["site-a", "site-b"]
    for index, site in enumerate(("site-a", "site-b")):
        args = _parses(_container(jobs[site])["command"])
        assert args.command == "worker" and args.servers.split(",") == shards
        assert args.cluster == site and args.cluster_index == index and args.num_clusters == 2
        assert args.insecure == (mode == "plaintext-cpu")


def test_one_pod_per_site_runs_the_worker_which_starts_its_own_torchrun(tmp_path):
    objects = _render(tmp_path)
    assert [o["kind"] for o in objects].count("Service") == 1  # no rendezvous service needed
    for site, ranks in (("site-a", 2), ("site-b", 2)):
        job = _site_jobs(objects)[site]
        spec, container = job["spec"], _container(job)
        assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == 1
        assert container["command"][:2] == ["dilocox", "worker"]
        args = _parses(container["command"])
        assert args.parallel__pp * args.parallel__dp == ranks
        resources = container["resources"]
        assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] == ranks
        assert spec["template"]["spec"]["restartPolicy"] == "Never" and spec["backoffLimit"] == 4
        rules = spec["podFailurePolicy"]["rules"]
        assert rules[0]["action"] == "FailJob" and rules[0]["onExitCodes"]["values"] == [3]
        assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
        # A rerun pod resumes the site's local state from its own volume.
        assert args.resume_if_present and str(args.checkpoint_dir) == SITE_CHECKPOINT_DIR
        assert {"name": "checkpoints", "mountPath": SITE_CHECKPOINT_DIR} in container["volumeMounts"]
        (volume,) = [v for v in spec["template"]["spec"]["volumes"] if v["name"] == "checkpoints"]
        claim = _one(objects, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
        assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]


def test_a_site_across_pods_is_torchrun_with_the_completion_index_as_node_rank(tmp_path):
    objects = _render(tmp_path, "--ranks-per-pod", "1", "--namespace", "Training")
    for site, layout in (("site-a", (2, 1)), ("site-b", (1, 2))):
        job = _site_jobs(objects)[site]
        spec, container = job["spec"], _container(job)
        command = container["command"]
        flag = {command[i]: command[i + 1] for i in range(1, command.index("-m"), 2)}
        assert command[0] == "torchrun" and flag["--nnodes"] == "2" and flag["--nproc-per-node"] == "1"
        assert spec["completions"] == spec["parallelism"] == 2
        assert flag["--node-rank"] == "$(NODE_RANK)"
        index = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
        assert _env(container)["NODE_RANK"] == {"fieldRef": {"fieldPath": index}}
        job_name, subdomain = job["metadata"]["name"], spec["template"]["spec"]["subdomain"]
        assert flag["--master-addr"] == f"{job_name}-0.{subdomain}.training.svc.cluster.local"
        rendezvous = _one(objects, "Service", subdomain)
        assert rendezvous["spec"]["clusterIP"] == "None" and rendezvous["spec"]["publishNotReadyAddresses"] is True
        assert rendezvous["spec"]["selector"].items() <= spec["template"]["metadata"]["labels"].items()
        other = _site_jobs(objects)["site-b" if site == "site-a" else "site-a"]["spec"]["template"]["metadata"][
            "labels"
        ]
        assert not rendezvous["spec"]["selector"].items() <= other.items()
        args = _parses(command)
        assert (args.parallel__pp, args.parallel__dp) == layout
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        (volume,) = [v for v in spec["template"]["spec"]["volumes"] if v["name"] == "checkpoints"]
        claim = _one(objects, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
        assert claim["spec"]["accessModes"] == ["ReadWriteMany"]  # every pod of the site writes its share there


def test_secrets_are_referenced_and_cpu_sites_request_no_gpu(tmp_path):
    objects = _render(tmp_path, "--token-secret", "run-token", "--tls-secret", "run-certs")
    for workload in (o for o in objects if o["kind"] in ("StatefulSet", "Job")):
        container = _container(workload)
        assert _env(container)["DILOCOX_TOKEN"] == {"secretKeyRef": {"name": "run-token", "key": "token"}}
        secrets = [v["secret"]["secretName"] for v in workload["spec"]["template"]["spec"]["volumes"] if "secret" in v]
        assert secrets == ["run-certs"]
        assert not any(arg.startswith("--token") for arg in container["command"])  # never on a command line
    plain = _render(tmp_path, "--insecure", "--gpus-per-rank", "0", "--token-secret", "")
    for workload in (o for o in plain if o["kind"] in ("StatefulSet", "Job")):
        container = _container(workload)
        assert "DILOCOX_TOKEN" not in _env(container) and "nvidia.com/gpu" not in container["resources"]["requests"]
        assert not any("secret" in v for v in workload["spec"]["template"]["spec"].get("volumes", []))


def test_names_are_sanitised_and_an_uneven_split_is_refused(tmp_path):
    objects = _render(tmp_path, "--run-id", "LLM_Pretrain.1", "--sites", "Site_A:1x1,b:1x1")
    assert {o["metadata"]["name"] for o in objects} >= {
        "llm-pretrain-1-shard",
        "llm-pretrain-1-site-a",
        "llm-pretrain-1-b",
    }
    for obj in objects:
        kubernetes_validate.validate(obj, "1.30", strict=True)
    assert (
        _parses(_container(_site_jobs(objects)["site-a"])["command"]).run_id == "LLM_Pretrain.1"
    )  # the run id itself is kept
    with pytest.raises(SystemExit, match="does not divide"):
        _render(tmp_path, "--sites", "a:3x1", "--ranks-per-pod", "2")
    with pytest.raises(SystemExit, match="clashing"):
        _render(tmp_path, "--sites", "Site-A:1x1,site_a:1x1")


def test_the_cli_writes_the_manifest_and_says_what_to_run_next(tmp_path):
    pytest.importorskip("dilocox.common.deploy.slurm")  # deploy_cli registers both launchers
    out = tmp_path / "k8s"
    command = [
        sys.executable,
        "-m",
        "dilocox.common.cli",
        "deploy",
        "kubernetes",
        "--out",
        str(out),
        *TOPOLOGY,
        "--image",
        "registry.example.org/dilocox:cuda",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    objects = [d for d in yaml.safe_load_all((out / kubernetes.MANIFEST).read_text()) if d is not None]
    kinds = ["Service", "StatefulSet", "PersistentVolumeClaim", "Job", "PersistentVolumeClaim", "Job"]
    assert [o["kind"] for o in objects] == kinds
    workloads = [o for o in objects if o["kind"] in ("StatefulSet", "Job")]
    assert {_container(o)["image"] for o in workloads} == {"registry.example.org/dilocox:cuda"}
    assert f"kubectl apply -f {out / kubernetes.MANIFEST}" in done.stdout
    assert "create secret generic dilocox-tls" in done.stdout and "create secret generic dilocox-token" in done.stdout
    certs = next(line for line in done.stdout.splitlines() if "dilocox certs" in line)
    assert "dilocox-run-shard-1.dilocox-run-shards.dilocox.svc.cluster.local" in certs
    status = next(line for line in done.stdout.splitlines() if "dilocox status --servers" in line)
    assert "--servers 127.0.0.1:57051,127.0.0.1:57052" in status
    json.loads(json.dumps(objects))  # plain data, no YAML tags


# --------------------------------------------------------------------------- dilocox server --resume-if-present
RUN = "k8s-resume"


def _serve_once(ckpt_dir: pathlib.Path, *extra: str) -> str:
    """Start a shard, wait until it listens, stop it with SIGTERM; its stderr (the JSON log)."""
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "dilocox.common.cli",
        "server",
        "--port",
        str(port),
        "--run-id",
        RUN,
        "--insecure",
        "--log-format",
        "json",
        "--checkpoint-dir",
        str(ckpt_dir),
        *extra,
    ]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not listening(port):
            assert proc.poll() is None, f"{shlex.join(command)}: {proc.stderr.read()}"
            assert time.monotonic() < deadline, "the shard did not listen"
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr
    return stderr


def test_server_resume_if_present_starts_on_an_empty_volume_and_resumes_a_full_one(tmp_path):
    log = _serve_once(tmp_path / "empty", "--resume-if-present")
    assert "checkpoint_loaded" not in log
    shard = Shard(0, 1, RUN)
    checkpoint.save(shard, tmp_path / "full")
    log = _serve_once(tmp_path / "full", "--resume-if-present")
    assert "checkpoint_loaded" in log
    command = [
        sys.executable,
        "-m",
        "dilocox.common.cli",
        "server",
        "--run-id",
        RUN,
        "--insecure",
        "--resume-if-present",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "--resume-if-present needs --checkpoint-dir" in done.stderr


def test_a_stopping_site_is_given_what_it_needs_before_it_is_killed(tmp_path):
    """A stopped 2-rank site was SIGKILLed by torchrun at its 30 s, and the site Job set no
    termination grace: now torchrun waits STOP_TIMEOUT_S for its ranks (TORCH_ELASTIC_SHUTDOWN_TIMEOUT, in the
    site's container, its Slurm script and its bare-metal script) and the pod is given 30 s more."""
    from dilocox.common.config.waits import SHUTDOWN_TIMEOUT_ENV, STOP_TIMEOUT_S

    for job in _site_jobs(_render(tmp_path)).values():
        pod = job["spec"]["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] == STOP_TIMEOUT_S + 30
        (container,) = pod["containers"]
        assert {"name": SHUTDOWN_TIMEOUT_ENV, "value": str(STOP_TIMEOUT_S)} in container["env"]
