"""`dilocox deploy topology`: one TOML file renders a run across three clusters — a
Slurm site, a Kubernetes site, a bare-metal site, the shards on a second Kubernetes cluster exposed by a
LoadBalancer Service each — and every site dials the shards' external addresses, which the server
certificate names; each site keeps its own data, flags, image and resources; the Kubernetes objects
validate strictly against 1.28, 1.30 and the latest schema; the Slurm script runs under a real
slurm-wlm (tests/local_slurm.py) with the command the file says; bad files are refused by key."""

from __future__ import annotations

import argparse
import pathlib
import shlex
import subprocess
import sys
import time

import kubernetes_validate
import pytest
import yaml

from dilocox.common.cli import build_parser
from dilocox.common.deploy.topology_file import TopologyFileError, parse
from dilocox.common.deploy.topology_render import certificate_hosts, render

VERSIONS = ("1.28", "1.30", kubernetes_validate.latest_version())
ADDRESSES = ["shard-0.dilocox.example.org:443", "203.0.113.7:8443"]
IN_CLUSTER = [f"run-x-shard-{i}.run-x-shards.aggregation.svc.cluster.local" for i in range(2)]


KUBERNETES_SHARDS = """launcher = "kubernetes"
cluster = "cloud"
namespace = "aggregation"
image = "registry.example.org/dilocox:cpu"
cpu = "4"
memory = "16Gi"
"""
RUN_POLICY = """
[shards.policy]
grace_s = 30
expect_clusters = 3
update_check = "clip"
aggregate = "clipped-mean"
keep_rounds_s = 172800
"""


def topology_text(
    state: str = "/shared/state",
    setup: str = "source ~/venv/bin/activate",
    k8s_cluster: str = "gke",
    shards: str = KUBERNETES_SHARDS + RUN_POLICY,
) -> str:
    return f"""
run_id = "run-x"
rounds = 7
inner_steps = 11
worker_flags = "--model llama-350m --block-size 1024"

[shards]
count = 2
addresses = {ADDRESSES!r}
{shards}

[sites.hpc]
launcher = "slurm"
gpus_per_node = 0
layout = "2x1"
data = "/shared/tokens"
worker_flags = "--inner-batch-size 16"
partition = "debug"
time = "00:10:00"
cpus_per_rank = 1
state_dir = "{state}"
tls_dir = "/shared/certs"
setup = [{setup!r}]

[sites.gke]
launcher = "kubernetes"
cluster = "{k8s_cluster}"
nodes = 2
gpus_per_node = 8
data = "/data/tokens"
data_claim = "gke-tokens"
inner_round_time_s = 120
stop_timeout_s = 900
worker_flags = ["--eval-batches", "3"]
namespace = "research"
image = "eu.gcr.io/lab/dilocox:cuda"
cpu = "96"
memory = "900Gi"
node_selector = {{ "cloud.google.com/gke-accelerator" = "nvidia-h100-80gb" }}
tolerations = [{{ key = "nvidia.com/gpu", operator = "Exists", effect = "NoSchedule" }}]

[sites.lab]
launcher = "bare-metal"
nodes = 2
gpus_per_node = 2
hosts = ["gpu1.lab.example.edu", "gpu2.lab.example.edu"]
data = "/scratch/tokens"
tls_dir = "/etc/dilocox/tls"
checkpoint_dir = "/nfs/lab"
"""


def _docs(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d is not None]


def _parses(argv: list[str]) -> argparse.Namespace:
    if argv[0] == "torchrun":
        argv = ["dilocox", *argv[argv.index("dilocox.common.cli") + 1 :]]
    assert argv[0] == "dilocox", argv
    return build_parser(argv[1:]).parse_args(argv[1:])


def _slurm_worker(script: str) -> tuple[list[str], dict[str, str]]:
    """The torchrun argv of a site's sbatch script (shell variables left as written) and its variables."""
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    inner = shlex.split(srun)[-1]
    variables = dict(line.split("=", 1) for line in script.splitlines() if line.startswith("DILOCOX_SERVERS="))
    return shlex.split(inner.removeprefix("exec ")), {k: v.strip('"') for k, v in variables.items()}


def _job(objects: list[dict]) -> dict:
    (job,) = [o for o in objects if o["kind"] == "Job"]
    return job


@pytest.fixture(scope="module")
def files() -> dict[str, str]:
    return render(parse(topology_text()))


def test_each_cluster_gets_its_own_folder_of_files(files):
    assert sorted(files) == [
        "cloud/shards.yaml",
        "gke/site-gke.yaml",
        "hpc/site-hpc.sbatch",
        "lab/site-lab-gpu1.lab.example.edu.sh",
        "lab/site-lab-gpu2.lab.example.edu.sh",
    ]


def test_every_site_dials_the_shards_external_addresses_with_its_own_settings(files):
    run_flags = ["--model", "llama-350m", "--block-size", "1024"]
    # Slurm: the fixed addresses (no address files from a shards job in another cluster), its data, flags, partition.
    script = files["hpc/site-hpc.sbatch"]
    argv, variables = _slurm_worker(script)
    assert variables["DILOCOX_SERVERS"] == ",".join(ADDRESSES) and "addresses" not in script
    args = _parses(argv)
    assert (
        args.servers == "$DILOCOX_SERVERS"
        and args.cluster == "hpc"
        and args.cluster_index == 0
        and args.num_clusters == 3
    )
    assert (args.parallel__pp, args.parallel__dp) == (2, 1) and str(args.data) == "/shared/tokens"
    assert argv[argv.index("--model") :][:6] == [*run_flags, "--data", "/shared/tokens"]
    assert (
        "--inner-batch-size" in argv and "#SBATCH --partition=debug" in script and "#SBATCH --time=00:10:00" in script
    )
    assert "--gpus-per-node" not in script and "#SBATCH --cpus-per-task=2" in script
    assert str(args.tls_ca) == "/shared/certs/ca.pem" and not args.insecure and "source ~/venv/bin/activate" in script
    # Kubernetes, another cluster: external addresses, its image, GPUs, node selector, tolerations, namespace.
    objects = _docs(files["gke/site-gke.yaml"])
    job = _job(objects)
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = _parses(container["command"])
    assert args.servers.split(",") == ADDRESSES and args.cluster == "gke" and args.cluster_index == 1
    assert str(args.data) == "/data/tokens" and args.eval_batches == 3
    assert (args.parallel__pp, args.parallel__dp) == (1, 16) and job["spec"]["completions"] == 2
    assert container["image"] == "eu.gcr.io/lab/dilocox:cuda" and job["metadata"]["namespace"] == "research"
    assert container["resources"]["requests"] == {"cpu": "96", "memory": "900Gi", "nvidia.com/gpu": 8}
    assert pod["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert not any(
        "cluster.local:" in arg for arg in container["command"]
    )  # no in-cluster shard name from another cluster
    # Bare metal: one script per host, torchrun with the first host as the rendezvous.
    for rank, host in enumerate(("gpu1.lab.example.edu", "gpu2.lab.example.edu")):
        text = files[f"lab/site-lab-{host}.sh"]
        assert text.startswith("#!/bin/bash") and f"on {host}" in text
        argv = shlex.split(text.splitlines()[-1].removeprefix("exec "))
        flag = {argv[i]: argv[i + 1] for i in range(1, argv.index("-m"), 2)}
        assert (
            flag["--node-rank"] == str(rank)
            and flag["--master-addr"] == "gpu1.lab.example.edu"
            and flag["--nnodes"] == "2"
        )
        args = _parses(argv)
        assert args.servers.split(",") == ADDRESSES and args.cluster == "lab" and args.cluster_index == 2
        assert str(args.data) == "/scratch/tokens" and str(args.checkpoint_dir) == "/nfs/lab" and args.resume_if_present
        assert (args.parallel__pp, args.parallel__dp) == (1, 4) and str(args.tls_cert) == "/etc/dilocox/tls/client.pem"


def test_shards_on_kubernetes_get_a_load_balancer_per_shard_at_the_addresses_the_sites_dial(files):
    objects = _docs(files["cloud/shards.yaml"])
    statefulset = next(o for o in objects if o["kind"] == "StatefulSet")
    assert statefulset["metadata"]["namespace"] == "aggregation" and statefulset["spec"]["replicas"] == 2
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "registry.example.org/dilocox:cpu"
    assert container["resources"]["requests"] == {"cpu": "4", "memory": "16Gi"}
    # The run's shard policy from the same file (its sites' data volume: the gke site's test above).
    args = _parses(
        [a.replace("$(SHARD_INDEX)", "0") for a in container["command"]]
    )  # the kubelet substitutes the pod's ordinal
    assert (args.grace_s, args.expect_clusters, args.update_check, args.aggregate, args.keep_rounds_s) == (
        30,
        3,
        "clip",
        "clipped-mean",
        172800,
    )
    external = [o for o in objects if o["kind"] == "Service" and o["spec"].get("type") == "LoadBalancer"]
    assert len(external) == 2
    for index, service in enumerate(external):
        (port,) = service["spec"]["ports"]
        assert service["spec"]["selector"] == {"statefulset.kubernetes.io/pod-name": f"run-x-shard-{index}"}
        assert port["port"] == int(ADDRESSES[index].rsplit(":", 1)[1]) and port["targetPort"] == 50051


def test_every_kubernetes_object_validates_strictly_on_1_28_1_30_and_latest(files):
    objects = [o for name, text in files.items() if name.endswith(".yaml") for o in _docs(text)]
    assert {o["kind"] for o in objects} >= {"Service", "StatefulSet", "Job", "PersistentVolumeClaim"}
    for obj in objects:
        for version in VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)


def test_a_sites_data_volume_time_box_and_stop_timeout_reach_its_launcher(files):
    """Nothing hand-edited after rendering — a Kubernetes site's data claim mounted read-only where its
    --data points, its time box on its worker, its stop timeout as torchrun's wait and the pod's grace (30 s more);
    a Slurm site without them keeps the defaults."""
    job = _job(_docs(files["gke/site-gke.yaml"]))
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = _parses(container["command"])
    assert str(args.data) == "/data/tokens" and args.inner__round_time_s == 120 and args.stop_timeout_s == 900
    assert {"name": "data", "persistentVolumeClaim": {"claimName": "gke-tokens", "readOnly": True}} in pod["volumes"]
    assert {"name": "data", "mountPath": "/data", "readOnly": True} in container["volumeMounts"]
    assert {"name": "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "value": "900"} in container["env"]
    assert pod["terminationGracePeriodSeconds"] == 930
    script = files["hpc/site-hpc.sbatch"]
    argv, _ = _slurm_worker(script)
    assert "--inner-round-time-s" not in argv and "--stop-timeout-s" not in argv
    assert "export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-300}" in script
    # Per site: the Slurm and bare-metal sites' own time boxes and stop timeouts reach their scripts too.
    text = topology_text().replace(
        "cpus_per_rank = 1", "cpus_per_rank = 1\ninner_round_time_s = 90.5\nstop_timeout_s = 600", 1
    )
    text = text.replace('checkpoint_dir = "/nfs/lab"', 'checkpoint_dir = "/nfs/lab"\nstop_timeout_s = 450', 1)
    others = render(parse(text))
    script = others["hpc/site-hpc.sbatch"]
    args = _parses(_slurm_worker(script)[0])
    assert args.inner__round_time_s == 90.5 and args.stop_timeout_s == 600
    assert "export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-600}" in script
    lab = others["lab/site-lab-gpu1.lab.example.edu.sh"]
    assert (
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-450}" in lab
        and _parses(shlex.split(lab.splitlines()[-1].removeprefix("exec "))).stop_timeout_s == 450
    )


def test_a_kubernetes_sites_data_on_any_volume_and_checkpoints_on_an_existing_claim_validate():
    text = (
        topology_text()
        .replace(
            'data_claim = "gke-tokens"',
            'data_volume = { nfs = { server = "nfs.example.org", path = "/exports/tokens", readOnly = true } }\n'
            'data_mount = "/mnt/corpus"\ncheckpoint_claim = "gke-site-ckpt"',
            1,
        )
        .replace('data = "/data/tokens"', 'data = "/mnt/corpus/tokens"', 1)
    )
    objects = _docs(render(parse(text))["gke/site-gke.yaml"])
    assert not any(o["kind"] == "PersistentVolumeClaim" for o in objects)  # the operator's own claim, none rendered
    pod = _job(objects)["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert {"name": "data", "nfs": {"server": "nfs.example.org", "path": "/exports/tokens", "readOnly": True}} in pod[
        "volumes"
    ]
    assert {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "gke-site-ckpt"}} in pod["volumes"]
    assert {"name": "data", "mountPath": "/mnt/corpus", "readOnly": True} in container["volumeMounts"]
    args = _parses(container["command"])
    assert (
        str(args.data) == "/mnt/corpus/tokens"
        and args.resume_if_present
        and str(args.checkpoint_dir) == "/var/lib/dilocox/site"
    )
    for obj in objects:
        for version in VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)


def test_a_kubernetes_site_in_the_shards_cluster_dials_their_in_cluster_names():
    files = render(parse(topology_text(k8s_cluster="cloud")))
    assert "cloud/site-gke.yaml" in files
    (container,) = _job(_docs(files["cloud/site-gke.yaml"]))["spec"]["template"]["spec"]["containers"]
    assert _parses(container["command"]).servers.split(",") == [f"{host}:50051" for host in IN_CLUSTER]


def test_the_certificate_names_every_address_a_site_dials(tmp_path):
    model = parse(topology_text())
    assert certificate_hosts(model) == [
        "localhost",
        "127.0.0.1",
        *IN_CLUSTER,
        "shard-0.dilocox.example.org",
        "203.0.113.7",
    ]
    (tmp_path / "run.toml").write_text(topology_text())
    out = tmp_path / "out"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "dilocox.common.cli",
            "deploy",
            "topology",
            "--file",
            str(tmp_path / "run.toml"),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    printed = next(line for line in done.stdout.splitlines() if "dilocox certs --out certs --hosts" in line)
    assert printed.split("--hosts ")[1].split(",") == certificate_hosts(model)
    assert (out / "lab" / "site-lab-gpu1.lab.example.edu.sh").stat().st_mode & 0o111
    made = subprocess.run(
        [
            sys.executable,
            "-m",
            "dilocox.common.cli",
            "certs",
            "--out",
            str(tmp_path / "certs"),
            "--topology",
            str(tmp_path / "run.toml"),
            "--hosts",
            "extra.example.org",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert made.returncode == 0, made.stderr
    from cryptography import x509

    cert = x509.load_pem_x509_certificate((tmp_path / "certs" / "server.pem").read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    dns = names.get_values_for_type(x509.DNSName)
    ips = [str(ip) for ip in names.get_values_for_type(x509.IPAddress)]
    assert set(dns) == {"localhost", *IN_CLUSTER, "shard-0.dilocox.example.org", "extra.example.org"}
    assert set(ips) == {"127.0.0.1", "203.0.113.7"}


BAD = {
    # A site's volumes, time box and stop timeout, checked by key.
    "data outside the data volume": (
        ('data = "/data/tokens"', 'data = "/scratch/tokens"'),
        r"sites\.gke\.data: '/scratch/tokens' is not inside data_mount '/data'",
    ),
    "no data path with a data volume": (
        ('data = "/data/tokens"\n', ""),
        r"sites\.gke\.data: missing: the path of the site's data inside data_mount",
    ),
    "a claim name Kubernetes refuses": (
        ('data_claim = "gke-tokens"', 'data_claim = "GKE_tokens"'),
        r"sites\.gke\.data_claim: 'GKE_tokens' is not a PersistentVolumeClaim name",
    ),
    "a claim and a volume": (
        (
            'data_claim = "gke-tokens"',
            'data_claim = "gke-tokens"\ndata_volume = { nfs = { server = "nfs", path = "/x" } }',
        ),
        r"sites\.gke\.data_volume: give data_claim or data_volume, not both",
    ),
    "a data volume of two sources": (
        (
            'data_claim = "gke-tokens"',
            'data_volume = { nfs = { server = "nfs", path = "/x" }, hostPath = { path = "/y" } }',
        ),
        r"sites\.gke\.data_volume: one volume source",
    ),
    "a data volume for the shards": (
        ('memory = "16Gi"\n', 'memory = "16Gi"\ndata_claim = "tokens"\n'),
        r"shards\.data_claim: only for a Kubernetes site",
    ),
    "a negative time box": (
        ("inner_round_time_s = 120", "inner_round_time_s = -1"),
        r"sites\.gke\.inner_round_time_s: must be ≥ 0",
    ),
    "a stop timeout within the stop grace": (
        ("stop_timeout_s = 900", "stop_timeout_s = 20"),
        r"sites\.gke\.stop_timeout_s: 20 s would kill the ranks",
    ),
    "a time box given twice": (
        ('worker_flags = ["--eval-batches", "3"]', 'worker_flags = ["--inner-round-time-s", "60"]'),
        r"sites\.gke\.worker_flags: --inner-round-time-s is set by sites\.gke\.inner_round_time_s; give it once",
    ),
    "unknown key, closest named": (
        ('partition = "debug"', 'partiton = "debug"'),
        r"sites\.hpc\.partiton: unknown key; did you mean 'sites\.hpc\.partition'",
    ),
    "a setting of another launcher": (
        ('hosts = ["gpu1', 'partition = "x"\nhosts = ["gpu1'),
        r"sites\.lab\.partition: unknown key",
    ),
    "wrong type": (
        ("nodes = 2\ngpus_per_node = 8", 'nodes = "2"\ngpus_per_node = 8'),
        r"sites\.gke\.nodes: expected int, got str",
    ),
    "unknown launcher": (
        ('launcher = "bare-metal"', 'launcher = "baremetal"'),
        r"sites\.lab\.launcher: 'baremetal' is not one of",
    ),
    "no addresses for sites outside": (
        (f"addresses = {ADDRESSES!r}\n", ""),
        r"shards\.addresses: sites hpc, gke, lab run outside",
    ),
    "hosts per node": (
        ('hosts = ["gpu1.lab.example.edu", "gpu2.lab.example.edu"]', 'hosts = ["gpu1.lab.example.edu"]'),
        r"sites\.lab\.hosts: a bare-metal site names one host per node: 2 node\(s\), 1 host",
    ),
    "layout against GPUs": (
        ('gpus_per_node = 0\nlayout = "2x1"', 'gpus_per_node = 4\nlayout = "2x1"'),
        r"sites\.hpc\.layout: 2x1 is 2 ranks",
    ),
    "no GPU count": (("gpus_per_node = 2\n", ""), r"sites\.lab\.gpus_per_node: missing"),
    "bad address": (("203.0.113.7:8443", "203.0.113.7"), r"shards\.addresses\[1\]: '203\.0\.113\.7' is not host:port"),
    "no TLS folder": (('tls_dir = "/etc/dilocox/tls"\n', ""), r"sites\.lab\.tls_dir: missing"),
    "top-level typo": (("rounds = 7", "round = 7"), r"round: unknown key; did you mean 'rounds'"),
    "not TOML": (("rounds = 7", "rounds = = 7"), r"not valid TOML"),
    "a site name that cannot name files": (("[sites.lab]", '[sites."lab/x"]'), r"sites\.lab/x: 'lab/x': use letters"),
    "a NodePort outside the range": (
        ("count = 2", 'count = 2\nexpose = "NodePort"'),
        r"shards\.addresses\[0\]: .* 30000-32767",
    ),
    "expose for shards not on Kubernetes": (
        (KUBERNETES_SHARDS, 'launcher = "external"\nexpose = "NodePort"\n'),
        r"shards\.expose: only for shards on Kubernetes",
    ),
    # Values that would break, or run something in, what is rendered from them.
    "a newline in a host": (
        ('"gpu2.lab.example.edu"', '"gpu2\\ntouch /tmp/pwned"'),
        r"sites\.lab\.hosts\[1\]: .* control character",
    ),
    "a host that is no host": (
        ('"gpu2.lab.example.edu"', '"gpu2;reboot"'),
        r"sites\.lab\.hosts\[1\]: .* is not a host name or IP",
    ),
    "a newline in the run id": (
        ('run_id = "run-x"', 'run_id = "run-x\\necho hi"'),
        r"run_id: 'run-x\\necho hi': use letters",
    ),
    "a run id that cannot name things": (('run_id = "run-x"', 'run_id = "run x"'), r"run_id: 'run x': use letters"),
    "port 0": (("203.0.113.7:8443", "203.0.113.7:0"), r"shards\.addresses\[1\]: 0 is not a port"),
    "port 99999": (("203.0.113.7:8443", "203.0.113.7:99999"), r"shards\.addresses\[1\]: 99999 is not a port"),
    "a newline in another value": (
        ('partition = "debug"', 'partition = "debug\\n#SBATCH --uid=0"'),
        r"sites\.hpc\.partition: .* control",
    ),
    "a huge worker_flags": (
        ('"--inner-batch-size 16"', '"' + "x" * 10_000_000 + '"'),
        r"sites\.hpc\.worker_flags: 10000000 characters",
    ),
    "a rendezvous port past the last": (
        ('checkpoint_dir = "/nfs/lab"', 'checkpoint_dir = "/nfs/lab"\nrdzv_port = 70000'),
        r"sites\.lab\.rdzv_port: 70000 is not a port",
    ),
}


@pytest.mark.parametrize("case", BAD)
def test_a_bad_topology_file_is_refused_naming_the_key(case):
    (old, new), message = BAD[case]
    text = topology_text()
    assert old in text, old
    with pytest.raises(TopologyFileError, match=message):
        render(parse(text.replace(old, new, 1)))


def test_kubernetes_sites_whose_objects_would_clash_in_a_namespace_are_refused():
    text = (
        topology_text()
        .replace("[sites.gke]", "[sites.Shards]")
        .replace('namespace = "research"', 'namespace = "aggregation"')
    )
    with pytest.raises(
        TopologyFileError,
        match=r"sites\.Shards: its Kubernetes objects would be named 'run-x-shards' in namespace "
        r"'aggregation', as the shards'",
    ):
        render(parse(text))


def test_the_cli_refuses_a_bad_file_with_the_message_and_writes_nothing(tmp_path):
    (tmp_path / "run.toml").write_text(topology_text().replace("cpus_per_rank", "cpu_per_rank"))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "dilocox.common.cli",
            "deploy",
            "topology",
            "--file",
            str(tmp_path / "run.toml"),
            "--out",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        done.returncode == 2
        and "sites.hpc.cpu_per_rank: unknown key; did you mean 'sites.hpc.cpus_per_rank'" in done.stderr
    )
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- the Slurm part, submitted
def test_the_slurm_site_runs_under_slurm_with_the_command_the_file_gives(slurm, tmp_path):
    """A stand-in `torchrun` (first on PATH through the site's `setup`) records the argv Slurm ran and
    exits: the job starting the right command is the point here; test_slurm.py trains through sbatch."""
    bin_dir, seen = tmp_path / "bin", tmp_path / "argv"
    bin_dir.mkdir()
    (bin_dir / "torchrun").write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" > {seen}\n')
    (bin_dir / "torchrun").chmod(0o755)
    setup = f"export PATH={bin_dir}:{pathlib.Path(sys.executable).parent}:$PATH"
    files = render(parse(topology_text(state=str(tmp_path / "state"), setup=setup)))
    script = tmp_path / "site-hpc.sbatch"
    script.write_text(files["hpc/site-hpc.sbatch"])
    job = slurm.sbatch(script)
    deadline = time.monotonic() + 120
    while (
        slurm.state(job) not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "")
        and time.monotonic() < deadline
    ):
        time.sleep(0.3)
    log = next(tmp_path.glob(f"run-x-hpc-{job}.out"), None)
    assert slurm.state(job) == "COMPLETED", (slurm.state(job), log and log.read_text())
    argv = ["torchrun", *seen.read_text().splitlines()]
    args = _parses(argv)
    assert args.servers.split(",") == ADDRESSES and args.cluster == "hpc" and str(args.data) == "/shared/tokens"
    assert str(args.checkpoint_dir) == f"{tmp_path}/state/sites" and args.inner__batch_size == 16
    assert "--nnodes=1" in argv and "--nproc-per-node=2" in argv and argv[-1] == "--resume-if-present"
    assert f"shards {','.join(ADDRESSES)}" in log.read_text()


SHARDS_ELSEWHERE = {
    "slurm": 'launcher = "slurm"\ncluster = "hpc"\nport = 51000\nstate_dir = "/shared/state"\ntls_dir = '
    '"/shared/certs"\npartition = "cpu"',
    "bare-metal": 'launcher = "bare-metal"\ncluster = "lab"\nport = 51000\nhosts = ["agg1.lab.example.edu", '
    '"agg2.lab.example.edu"]\n'
    'tls_dir = "/etc/dilocox/tls"\ncheckpoint_dir = "/nfs/shards"',
    "external": 'launcher = "external"',
}


@pytest.mark.parametrize("where", SHARDS_ELSEWHERE)
def test_shards_on_slurm_bare_metal_or_elsewhere_and_the_site_in_their_cluster(where):
    """The site in the shards' own cluster finds them there (Slurm: the shards job's address files under
    their state folder; bare metal: host:port + i); every other site dials the external addresses."""
    text = topology_text(shards=SHARDS_ELSEWHERE[where])
    model = parse(
        text.replace(
            'state_dir = "/shared/state"\ntls_dir = "/shared/certs"\nsetup', 'tls_dir = "/shared/certs"\nsetup'
        )
    )
    files = render(model)
    gke = _parses(_job(_docs(files["gke/site-gke.yaml"]))["spec"]["template"]["spec"]["containers"][0]["command"])
    assert gke.servers.split(",") == ADDRESSES
    hpc = files["hpc/site-hpc.sbatch"]
    lab = _parses(shlex.split(files["lab/site-lab-gpu1.lab.example.edu.sh"].splitlines()[-1].removeprefix("exec ")))
    if where == "slurm":
        shards = files["hpc/shards.sbatch"]
        assert (
            "#SBATCH --ntasks=2" in shards and "#SBATCH --partition=cpu" in shards and "port=$(( 51000 + i ))" in shards
        )
        assert (
            "DILOCOX_SERVERS=$(for i in" in hpc and 'STATE="${DILOCOX_STATE_DIR:-/shared/state}"' in hpc
        )  # the shards' folder
        assert lab.servers.split(",") == ADDRESSES
    elif where == "bare-metal":
        for index, host in enumerate(("agg1.lab.example.edu", "agg2.lab.example.edu")):
            shard = _parses(shlex.split(files[f"lab/shard-{index}-{host}.sh"].splitlines()[-1].removeprefix("exec ")))
            assert shard.command == "server" and shard.shard_index == index and shard.port == 51000 + index
            assert (
                str(shard.checkpoint_dir) == "/nfs/shards"
                and shard.resume_if_present
                and str(shard.tls_cert) == "/etc/dilocox/tls/server.pem"
            )
        assert lab.servers == "agg1.lab.example.edu:51000,agg2.lab.example.edu:51001"
        assert certificate_hosts(model)[2:4] == ["agg1.lab.example.edu", "agg2.lab.example.edu"]
    else:
        assert not any("shard" in name for name in files) and lab.servers.split(",") == ADDRESSES
    if where != "slurm":
        assert f'DILOCOX_SERVERS="{",".join(ADDRESSES)}"' in hpc


def test_the_docs_example_file_renders_as_described():
    """docs/deploy.md's topology file is complete: it parses, renders into the folders its table lists,
    and the printed certificate command there is what it gives."""
    doc = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "deploy.md").read_text()
    section = doc.split("## One run across clusters: the topology file", 1)[1]
    model = parse(section.split("```toml\n", 1)[1].split("```", 1)[0])
    files = render(model)
    assert sorted({name.split("/")[0] for name in files}) == ["cloud", "hpc", "lab", "partner"]
    assert "cloud/shards.yaml" in files and "lab/site-lab-gpu1.lab.example.edu.sh" in files
    assert f"dilocox certs --out certs --hosts {','.join(certificate_hosts(model))}\n" in section
    for name, text in files.items():
        for obj in _docs(text) if name.endswith(".yaml") else ():
            kubernetes_validate.validate(obj, "1.28", strict=True)


def test_two_sites_whose_launch_scripts_would_share_a_name_are_refused_not_dropped():
    """Site `a` on host `b-c` and site `a-b` on host `c` in one cluster both rendered
    `site-a-b-c.sh`; one silently replaced the other (exit 0, a site without a script)."""
    text = (
        topology_text()
        + """
[sites.a]
launcher = "bare-metal"
cluster = "lab"
gpus_per_node = 1
hosts = ["b-c"]
tls_dir = "/etc/dilocox/tls"

[sites.a-b]
launcher = "bare-metal"
cluster = "lab"
gpus_per_node = 1
hosts = ["c"]
tls_dir = "/etc/dilocox/tls"
"""
    )
    with pytest.raises(TopologyFileError, match=r"site a-b and site a would both be rendered as lab/site-a-b-c\.sh"):
        render(parse(text))
    files = render(parse(text.replace('hosts = ["c"]', 'hosts = ["d"]')))  # distinct names: every site has its script
    assert {"lab/site-a-b-c.sh", "lab/site-a-b-d.sh"} <= set(files)


POLICY = """
[shards.policy]
grace_s = 30
grace_min_s = 2.5
expect_clusters = 3
update_check = "exclude"
keep_rounds = 8
keep_serving = true
"""
POLICY_FLAGS = [
    "--grace-s",
    "30",
    "--grace-min-s",
    "2.5",
    "--expect-clusters",
    "3",
    "--update-check",
    "exclude",
    "--keep-rounds",
    "8",
    "--keep-serving",
]


@pytest.mark.parametrize("where", ["kubernetes", "slurm", "bare-metal"])
def test_the_shards_policy_reaches_every_shard_by_its_flag_names(where):
    """Grace, expected sites, the update check and the rest of a shard's settings were
    `unknown key`s, set by hand on the rendered files. Now [shards.policy] takes them by their `dilocox
    server` flag names and every rendered shard runs with them."""
    shards = KUBERNETES_SHARDS if where == "kubernetes" else SHARDS_ELSEWHERE[where]
    text = topology_text(shards=shards.rstrip() + "\n" + POLICY)
    if where == "slurm":
        text = text.replace(
            'state_dir = "/shared/state"\ntls_dir = "/shared/certs"\nsetup', 'tls_dir = "/shared/certs"\nsetup'
        )
    files = render(parse(text))
    if where == "kubernetes":
        (shard,) = [o for o in _docs(files["cloud/shards.yaml"]) if o["kind"] == "StatefulSet"]
        argv = shard["spec"]["template"]["spec"]["containers"][0]["command"]
    elif where == "slurm":  # the line of the task script srun runs (inside its bash -c '…')
        argv = next(line for line in files["hpc/shards.sbatch"].splitlines() if "dilocox server" in line).split()
    else:
        argv = shlex.split(files["lab/shard-0-agg1.lab.example.edu.sh"].splitlines()[-1].removeprefix("exec "))
    text_argv = " ".join(argv)
    assert " ".join(POLICY_FLAGS) in text_argv, text_argv


def test_every_policy_key_is_a_dilocox_server_flag_of_its_type():
    import argparse

    from dilocox.common.deploy.topology_policy import CHOICES, SHARD_POLICY, UPDATE_CHECKS
    from dilocox.server.flags import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    actions = {a.dest: a for a in parser._actions}
    for key, kind in SHARD_POLICY.items():
        action = actions[key]
        if kind is bool:
            assert isinstance(action, argparse._StoreTrueAction), key
        else:
            assert (
                (action.type or str) is kind
                or (kind is str and action.type is None)
                or (action.type and kind.__name__ in str(action.type))
            ), (key, action.type)
    assert tuple(actions["update_check"].choices) == UPDATE_CHECKS
    assert all(tuple(actions[key].choices) == choices for key, choices in CHOICES.items())


@pytest.mark.parametrize(
    "bad, message",
    [
        ("grace = 30", r"shards\.policy\.grace: not a shard setting; did you mean 'shards\.policy\.grace_s'"),
        (
            'operator_token = "hunter2"',
            r"shards\.policy\.operator_token: set by the shards' environment, DILOCOX_OPERATOR_TOKEN",
        ),
        ("min_clusters = 2", r"shards\.policy\.min_clusters: set by min_clusters \(top level\)"),
        ('update_check = "strict"', r"shards\.policy\.update_check: 'strict' is not one of off, warn, clip, exclude"),
        ("keep_rounds = -1", r"shards\.policy\.keep_rounds: must be ≥ 0"),
        ('grace_s = "30"', r"shards\.policy\.grace_s: expected float, got str"),
    ],
)
def test_a_bad_shard_policy_is_refused_by_key(bad, message):
    with pytest.raises(TopologyFileError, match=message):
        parse(topology_text(shards=KUBERNETES_SHARDS + f"\n[shards.policy]\n{bad}\n"))
