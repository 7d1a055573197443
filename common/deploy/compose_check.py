"""`dilocox compose check`: run the project's docker-compose.yml for real and check it from outside.

What it proves, in order: the engine runs (installed and started if needed), the image builds
offline, the image runs what the docs show (a `dilocox worker --model llama-tiny --tokenizer bpe:512`
site trained by `dilocox sim` inside one container: the models extra is there), every health check turns healthy, the
sites' shaped WAN link carries the configured rate
(±15%, measured by a bulk probe from a site container to a shard container), rounds close with both
sites contributing, a site killed mid-run does not stop the other past the round deadline and rejoins
when started again, eval loss falls; then every container, network and volume is removed.

Why from outside: the same observations an operator has (`dilocox status` on the published ports,
container logs, health states), not the processes' internals.
"""

from __future__ import annotations

import functools
import json
import pathlib
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field

import structlog

from dilocox.common.deploy.compose_file import render
from dilocox.common.deploy.topology import Topology

log = structlog.get_logger()

PROBE_PORT = 5201
SMOKE_MODEL, SMOKE_TOKENIZER = "llama-tiny", "bpe:512"
# One shard and one site in one container, 2 rounds of 2 tiny steps: ~30 s on 2 cores, most of it
# imports and training the BPE tokenizer on the bundled text. No network: the sim talks over loopback.
SMOKE_SCRIPT = (
    f"dilocox sim --shards 1 --clusters 1 --model {SMOKE_MODEL} --tokenizer {SMOKE_TOKENIZER} --rounds 2 "
    "--inner-steps 2"
    " --inner-batch-size 2 --block-size 32 --eval-batches 1 --timeout 240 --log-dir /tmp/smoke"
    " --summary-json /tmp/smoke/summary.json >/tmp/smoke.out 2>&1; rc=$?;"
    " grep -h worker_starting /tmp/smoke/cluster-0.log;"
    " python3 -c 'import json; print(json.dumps(json.load(open(\"/tmp/smoke/summary.json\"))))';"
    ' [ "$rc" = 0 ] || tail -n 40 /tmp/smoke.out; exit "$rc"'
)


class CheckFailed(AssertionError):
    """The system misbehaved (not the environment): the check fails loudly."""


def compose_command() -> list[str]:
    """`docker compose` (v2) where the plugin exists, else Debian's `docker-compose` 1.29."""
    if subprocess.run(["docker", "compose", "version"], capture_output=True, check=False).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise FileNotFoundError("neither `docker compose` nor `docker-compose` is installed")


def wait_until(condition, timeout_s: float, what: str, every_s: float = 2.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise CheckFailed(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(every_s)


@dataclass
class ComposeRun:
    """One compose project (`-p name`) over the repository's docker-compose.yml."""

    project_dir: pathlib.Path
    topology: Topology
    name: str = "dilocoxcheck"
    env: dict = field(default_factory=dict)

    @functools.cached_property
    def base_argv(self) -> list[str]:
        """`<compose> --project-name NAME --file docker-compose.yml`; which compose is asked once per run."""
        return [*compose_command(), "--project-name", self.name, "--file", str(self.project_dir / "docker-compose.yml")]

    def compose(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        argv = [*self.base_argv, *args]
        done = subprocess.run(
            argv, cwd=self.project_dir, capture_output=True, text=True, timeout=timeout, check=False, env=self.env
        )
        if check and done.returncode != 0:
            raise CheckFailed(
                f"`{' '.join(argv[-len(args) :])}` exited {done.returncode}: {(done.stdout + done.stderr)[-3000:]}"
            )
        return done

    def container(self, service: str) -> str:
        cid = self.compose("ps", "-q", service).stdout.strip()
        if not cid:
            raise CheckFailed(f"service {service} has no container")
        return cid.splitlines()[0]

    def state(self, service: str) -> dict:
        out = subprocess.run(
            ["docker", "inspect", "--format", "{{json .State}}", self.container(service)],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        )
        return json.loads(out.stdout)

    def events(self, service: str) -> list[dict]:
        """The service's structlog JSON events (other lines, e.g. torchrun's, are skipped)."""
        out = subprocess.run(
            ["docker", "logs", self.container(service)], capture_output=True, text=True, timeout=60, check=False
        )
        events = []
        for line in (out.stdout + out.stderr).splitlines():
            line = line[line.find("{") :] if "{" in line else ""
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return events

    def status(self) -> list[dict]:
        """`dilocox status --json` against the shards' published ports, as an operator would."""
        servers = ",".join(f"127.0.0.1:{self.topology.host_port_base + i}" for i in range(self.topology.num_shards))
        done = subprocess.run(
            [sys.executable, "-m", "dilocox.common.cli", "status", "--servers", servers, "--json", "--insecure"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]

    def version(self) -> int:
        shards = self.status()
        return (
            min((int(s.get("version", 0)) for s in shards), default=0)
            if len(shards) == self.topology.num_shards
            else -1
        )


def measure_link(run: ComposeRun, site: str, seconds: float = 6.0) -> float:
    """Bulk-probe the shaped path site → shard-0 from inside the containers; Mbit/s at the receiver."""
    sink = subprocess.Popen(
        [*run.base_argv, "exec", "-T", "shard-0", "dilocox", "link", "sink", "--port", str(PROBE_PORT)],
        cwd=run.project_dir,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=run.env,
    )
    try:
        for _ in range(20):
            probe = run.compose(
                "exec",
                "-T",
                site,
                "dilocox",
                "link",
                "probe",
                "--to",
                f"shard-0:{PROBE_PORT}",
                "--seconds",
                f"{seconds:g}",
                timeout=seconds + 60,
                check=False,
            )
            if probe.returncode == 0:
                return json.loads(probe.stdout.strip().splitlines()[-1])["mbit_per_s"]
            time.sleep(1)  # the sink may not be listening yet
        raise CheckFailed(f"link probe from {site} failed: {(probe.stdout + probe.stderr)[-2000:]}")
    finally:
        if sink.poll() is None:
            sink.kill()


def worker_smoke(image: str, tracking: bool = True, timeout: float = 300) -> dict:
    """Run a real site of the documented kind in the image: `dilocox sim` starts a shard and a
    `dilocox worker --model llama-tiny --tokenizer bpe:512` process in one throw-away container."""
    started = time.monotonic()
    done = subprocess.run(
        ["docker", "run", "--rm", "--network", "none", image, "sh", "-c", SMOKE_SCRIPT],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    events = []
    for line in done.stdout.splitlines():
        try:
            events.append(json.loads(line[line.find("{") :]))
        except (json.JSONDecodeError, ValueError):
            continue
    worker = next((e for e in events if e.get("event") == "worker_starting"), {})
    summary = next((e for e in events if "ok" in e and "final_eval_loss" in e), {})
    if done.returncode != 0 or not summary.get("ok"):
        raise CheckFailed(
            f"the image's worker smoke run exited {done.returncode}: {(done.stdout + done.stderr)[-3000:]}"
        )
    if (worker.get("model"), worker.get("tokenizer")) != (SMOKE_MODEL, SMOKE_TOKENIZER):
        raise CheckFailed(
            f"the smoke run's worker ran {worker.get('model')} / {worker.get('tokenizer')}, "
            f"not {SMOKE_MODEL} / {SMOKE_TOKENIZER}"
        )
    if tracking and not summary.get("tensorboard_dir"):
        raise CheckFailed("the smoke run wrote no TensorBoard events: the tracking extra is missing from the image")
    report = {
        "worker_smoke_s": round(time.monotonic() - started, 1),
        "worker_smoke_vocab": worker.get("vocab"),
        "worker_smoke_loss": f"{summary['initial_eval_loss']}->{summary['final_eval_loss']}",
    }
    log.info("worker_smoke_passed", image=image, model=SMOKE_MODEL, tokenizer=SMOKE_TOKENIZER, **report)
    return report


def _healthy(run: ComposeRun, service: str) -> bool:
    state = run.state(service)
    if state["Status"] in ("exited", "dead"):
        raise CheckFailed(f"{service} exited with {state['ExitCode']} before turning healthy")
    return state.get("Health", {}).get("Status") == "healthy"


def rounds_closed(run: ComposeRun) -> list[dict]:
    return [e for e in run.events("shard-0") if e.get("event") == "round_closed"]


def check(run: ComposeRun, kill_site: bool = True) -> dict:
    """The acceptance sequence; returns the measured figures. Raises CheckFailed on misbehaviour."""
    topology, report = run.topology, {}
    expected = render(topology)
    actual = (run.project_dir / "docker-compose.yml").read_text()
    if actual != expected:
        raise CheckFailed("docker-compose.yml differs from `dilocox compose render`: re-render it")
    started = time.monotonic()
    run.compose("up", "--detach", "--no-build", timeout=600)
    services = [*topology.shard_names(), *(s.name for s in topology.sites)]
    for service in services:
        wait_until(lambda s=service: _healthy(run, s), 240, f"{service} to turn healthy")
    report["healthy_after_s"] = round(time.monotonic() - started, 1)
    log.info("compose_healthy", services=services, seconds=report["healthy_after_s"])

    first, second = topology.sites[0].name, topology.sites[-1].name
    rate = measure_link(run, first)
    report["link_mbit_measured"], report["link_mbit_configured"] = round(rate, 2), topology.wan_rate_mbit
    log.info("link_measured", site=first, mbit_per_s=rate, configured=topology.wan_rate_mbit)
    if abs(rate - topology.wan_rate_mbit) > 0.15 * topology.wan_rate_mbit:
        raise CheckFailed(f"shaped link carried {rate:.2f} Mbit/s, configured {topology.wan_rate_mbit:g} (±15%)")

    both = {s.name for s in topology.sites}
    wait_until(
        lambda: any(e.get("clusters", 0) == len(both) for e in rounds_closed(run)),
        300,
        "a round closed with every site contributing",
    )
    if kill_site:
        run.compose("kill", second)
        killed_at = wait_until(lambda: max(run.version(), 0) or None, 30, "shard status")
        log.info("site_killed", site=second, version=killed_at)
        wait_until(
            lambda: run.version() >= killed_at + 2,
            topology.round_deadline_s * 2 + 120,
            f"{first} to close rounds without {second}",
        )
        report["rounds_without_killed_site"] = run.version() - killed_at
        run.compose("start", second)
        restarted_at = run.version()
        wait_until(
            lambda: any(
                e.get("event") == "cluster_joined" and e.get("cluster") == second and e.get("rejoin")
                for e in run.events("shard-0")
            ),
            180,
            f"{second} to rejoin",
        )
        wait_until(
            lambda: any(
                e.get("clusters", 0) == len(both) and e.get("round", 0) > restarted_at for e in rounds_closed(run)
            ),
            300,
            f"a round with {second} back in it",
        )
        report["rejoined_at_version"] = restarted_at

    def exited() -> dict | None:
        state = run.state(first)
        return state if state["Status"] == "exited" else None

    ended = wait_until(exited, 900, f"{first} to finish its rounds")
    if ended["ExitCode"] != 0:
        raise CheckFailed(f"{first} exited with {ended['ExitCode']}")
    finished = [e for e in run.events(first) if e.get("event") == "cluster_done"]
    if not finished:
        raise CheckFailed(f"{first} logged no cluster_done event")
    initial, final = finished[-1]["initial_eval_loss"], finished[-1]["final_eval_loss"]
    report.update(
        initial_eval_loss=initial,
        final_eval_loss=final,
        rounds=run.version(),
        rounds_with_every_site=sum(e.get("clusters", 0) == len(both) for e in rounds_closed(run)),
        wall_s=round(time.monotonic() - started, 1),
    )
    if not final < initial:
        raise CheckFailed(f"eval loss did not fall: {initial} → {final}")
    return report
