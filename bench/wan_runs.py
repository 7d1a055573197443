"""Run one mode of the WAN benchmark over the links: start its processes in their namespaces, follow
their events, stop them, and turn what they reported into a `ModeResult`."""

from __future__ import annotations

import json
import pathlib
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from dilocox.bench.allreduce_baseline import ring_bytes_per_rank
from dilocox.bench.wan_links import Links, Relay
from dilocox.bench.wan_modes import CurvePoint, Mode, ModeResult, mean
from dilocox.bench.wan_procs import (
    ChildProcess,
    child_env,
    dilocox_cli,
    python_module,
    stop_all,
    wait_all,
    wait_for_file,
)
from dilocox.common.config.run import RunConfig, as_dict
from dilocox.common.config.run_flags import config_flags

Progress = Callable[[int, dict], None]  # (units done since the last call, fields to show)


@dataclass
class RunOptions:
    work_dir: pathlib.Path
    timeout_s: float = 1800.0
    threads: int = 1  # torch threads per site process
    shards: int = 2
    data: str | None = None


class _Events:
    """Thread-safe record of (process, event, arrival time)."""

    def __init__(self, progress: Progress, key: str, fields: Callable[[dict], dict]) -> None:
        self.lock = threading.Lock()
        self.items: list[tuple[str, dict, float]] = []
        self.progress, self.key, self.fields = progress, key, fields

    def __call__(self, name: str, event: dict, arrived: float) -> None:
        with self.lock:
            self.items.append((name, event, arrived))
        if event.get("event") == self.key:
            self.progress(1, self.fields(event))

    def of(self, kind: str) -> list[tuple[str, dict, float]]:
        with self.lock:
            return [item for item in self.items if item[1].get("event") == kind]


def _counters(links: Links) -> list[dict[str, int] | None]:
    return [links.counters(site) for site in range(links.sites)]


def _link_bytes(links: Links, before: list, after: list) -> tuple[float, float] | None:
    if any(c is None for c in before + after):
        return None
    sent = [a["tx_bytes"] - b["tx_bytes"] for a, b in zip(after, before)]
    received = [a["rx_bytes"] - b["rx_bytes"] for a, b in zip(after, before)]
    return mean(sent), mean(received)


# --------------------------------------------------------------------------- AllReduce
def run_allreduce(links: Links, mode: Mode, config: RunConfig, options: RunOptions, progress: Progress) -> ModeResult:
    work = options.work_dir
    settings = links.settings
    events = _Events(progress, "ar_eval", lambda e: {"eval": e["eval_loss"]})
    master = f"{links.site_address(0)}:{links.free_port(0)}"
    before = _counters(links)
    started = time.monotonic()
    procs: list[ChildProcess] = []
    try:
        for rank in range(links.sites):
            argv = python_module(
                "dilocox.bench.allreduce_baseline",
                "--rank",
                str(rank),
                "--world",
                str(links.sites),
                "--master",
                master,
                "--config-json",
                json.dumps(as_dict(config)),
                "--latency-ms",
                str(settings.latency_ms),
                "--jitter-ms",
                str(settings.jitter_ms),
                "--threads",
                str(options.threads),
                "--throttle-mbit",
                str(settings.rate_mbit if links.allreduce_throttles else 0),
                *(["--data", options.data] if options.data else []),
            )
            env = child_env(options.threads, GLOO_SOCKET_IFNAME=links.gloo_ifname(rank))
            procs.append(
                ChildProcess(
                    f"{mode.name}-rank{rank}",
                    links.site_argv(rank, argv),
                    work / f"{mode.name}-rank{rank}.log",
                    events,
                    env,
                )
            )
        wait_all(procs, started + options.timeout_s, mode.name)
    finally:
        stop_all(procs)
    wall = time.monotonic() - started
    after = _counters(links)
    starts = {name: (e, t) for name, e, t in events.of("ar_started")}
    dones = {name: (e, t) for name, e, t in events.of("ar_done")}
    if len(dones) != links.sites:
        raise RuntimeError(f"{mode.name}: {len(dones)} of {links.sites} ranks reported their result")
    t0 = min(t for _, t in starts.values())
    lead = f"{mode.name}-rank0"
    curve = [CurvePoint(0, 0.0, starts[lead][0]["eval_loss"])]
    curve += [
        CurvePoint(e["tokens"], round(t - t0, 3), e["eval_loss"]) for name, e, t in events.of("ar_eval") if name == lead
    ]
    done = [e for e, _ in dones.values()]
    measured = _link_bytes(links, before, after)
    app_sent = mean([e["bytes_sent"] for e in done])
    return ModeResult(
        mode=mode.name,
        label=mode.label,
        tokens=done[0]["tokens"],
        train_s=round(max(t for _, t in dones.values()) - t0, 3),
        initial_eval_loss=starts[lead][0]["eval_loss"],
        final_eval_loss=dones[lead][0]["final_eval_loss"],
        curve=curve,
        idle_fraction=round(mean([e["idle_fraction"] for e in done]), 4),
        compute_s=round(mean([e["compute_s"] for e in done]), 3),
        comm_s=round(mean([e["comm_s"] for e in done]), 3),
        bytes_sent_per_site=measured[0] if measured else app_sent,
        bytes_received_per_site=measured[1] if measured else app_sent,
        bytes_source="interface counters" if measured else "computed (ring all-reduce, fp32 gradients)",
        app_bytes_sent_per_site=app_sent,
        wall_s=round(wall, 1),
        extra={
            "bytes_per_step_per_site": done[0]["bytes_sent"] // max(1, done[0]["steps"]),
            "steps": done[0]["steps"],
            "ring_bytes_formula": ring_bytes_per_rank(starts[lead][0]["params"], links.sites),
        },
    )


# --------------------------------------------------------------------------- DiLoCo family
def run_diloco(links: Links, mode: Mode, config: RunConfig, options: RunOptions, progress: Progress) -> ModeResult:
    work = options.work_dir
    sites, shards = links.sites, options.shards
    events = _Events(progress, "round_done", lambda e: {"eval": e["eval_loss"]})
    before = _counters(links)
    started = time.monotonic()
    shard_procs: list[ChildProcess] = []
    workers: list[ChildProcess] = []
    relay: Relay | None = None
    relay_stats: dict = {}
    try:
        ports = []
        for i in range(shards):
            port_file = work / f"{mode.name}-shard{i}.port"
            port_file.unlink(missing_ok=True)
            argv = dilocox_cli(
                "server",
                "--num-shards",
                str(shards),
                "--shard-index",
                str(i),
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--port-file",
                str(port_file),
                "--run-id",
                config.run_id,
                "--outer-lr",
                str(config.outer.lr),
                "--outer-momentum",
                str(config.outer.momentum),
                "--min-clusters",
                str(sites),
                "--round-deadline-s",
                "0",
                "--keep-serving",
                "--log-format",
                "json",
                "--insecure",
            )
            shard_procs.append(
                ChildProcess(
                    f"{mode.name}-shard{i}", links.hub_argv(argv), work / f"{mode.name}-shard{i}.log", env=child_env(1)
                )
            )
            ports.append((i, port_file))
        shard_ports = [int(wait_for_file(pf, shard_procs[i])) for i, pf in ports]
        routes = [(site, ("127.0.0.1", port)) for site in range(sites) for port in shard_ports]
        relay = Relay(links, routes, work, name=f"{mode.name}-relay")
        for site in range(sites):
            servers = ",".join(f"{links.hub_address(site)}:{relay.ports[site * shards + i]}" for i in range(shards))
            argv = dilocox_cli(
                "worker",
                "--servers",
                servers,
                "--cluster",
                f"cluster-{site}",
                "--cluster-index",
                str(site),
                "--num-clusters",
                str(sites),
                "--threads",
                str(options.threads),
                "--log-format",
                "json",
                "--insecure",
                *(["--data", options.data] if options.data else []),
                *config_flags(config),
            )
            workers.append(
                ChildProcess(
                    f"cluster-{site}",
                    links.site_argv(site, argv),
                    work / f"{mode.name}-cluster{site}.log",
                    events,
                    child_env(options.threads),
                )
            )
        wait_all(workers, started + options.timeout_s, mode.name)
    finally:
        stop_all(workers)
        if relay is not None:
            relay_stats = relay.stop()
        stop_all(shard_procs)
    wall = time.monotonic() - started
    after = _counters(links)

    starts = {name: (e, t) for name, e, t in events.of("cluster_started")}
    dones = {name: (e, t) for name, e, t in events.of("cluster_done")}
    if len(dones) != sites or len(starts) != sites:
        raise RuntimeError(f"{mode.name}: {len(dones)} of {sites} clusters reported their result")
    t0 = min(t for _, t in starts.values())
    by_round: dict[int, list[tuple[dict, float]]] = defaultdict(list)
    for _, e, t in events.of("round_done"):
        by_round[e["round"]].append((e, t))
    curve = [CurvePoint(0, 0.0, round(mean([e["eval_loss"] for e, _ in starts.values()]), 4))]
    tokens = 0
    for r in sorted(by_round):
        items = by_round[r]
        tokens += sum(e["tokens"] for e, _ in items)
        curve.append(
            CurvePoint(
                tokens, round(max(t for _, t in items) - t0, 3), round(mean([e["eval_loss"] for e, _ in items]), 4)
            )
        )
    done = [e for e, _ in dones.values()]
    final = round(mean([e["final_eval_loss"] for e in done]), 4)
    t_end = max(t for _, t in dones.values())
    curve.append(CurvePoint(tokens, round(t_end - t0, 3), final))
    rounds = [e for _, e, _ in events.of("round_done")]
    site_rounds = [[e for e in rounds if e["cluster"] == f"cluster-{s}"] for s in range(sites)]
    per_site_seconds = [sum(e["seconds"] for e in rs) for rs in site_rounds]
    per_site_idle = [sum(e["idle_s"] for e in rs) for rs in site_rounds]
    measured = _link_bytes(links, before, after)
    if measured is None and relay_stats:
        measured = (
            mean([relay_stats[f"s{s}"]["bytes"]["up"] for s in range(sites)]),
            mean([relay_stats[f"s{s}"]["bytes"]["down"] for s in range(sites)]),
        )
        source = "relay (bytes forwarded)"
    else:
        source = "interface counters"
    return ModeResult(
        mode=mode.name,
        label=mode.label,
        tokens=tokens,
        train_s=round(t_end - t0, 3),
        initial_eval_loss=curve[0].eval_loss,
        final_eval_loss=final,
        curve=curve,
        idle_fraction=round(mean([i / s for i, s in zip(per_site_idle, per_site_seconds) if s > 0]), 4),
        compute_s=round(mean([e["compute_s"] for e in done]), 3),
        comm_s=round(mean([sum(e["comm_s"] for e in rs) for rs in site_rounds]), 3),
        bytes_sent_per_site=measured[0] if measured else float("nan"),
        bytes_received_per_site=measured[1] if measured else float("nan"),
        bytes_source=source if measured else "unavailable",
        app_bytes_sent_per_site=mean([e["bytes_up"] for e in done]),
        wall_s=round(wall, 1),
        extra={
            "rounds": len(by_round),
            "delay": config.delay,
            "codec": config.compress.codec,
            "app_bytes_received_per_site": mean([e["bytes_down"] for e in done]),
        },
    )


RUNNERS = {"allreduce": run_allreduce, "diloco": run_diloco}
