"""The sites' links for the WAN benchmark, real or emulated, behind one interface.

* `NamespaceLinks`: each site in its own network namespace, the hub (shards) in another, veth pairs
  shaped by `tc tbf` in both directions (bench/netns.py). Latency/jitter come from the relay (gRPC) and
  from a per-collective wait (gloo), since this kernel has no netem.
* `LoopbackLinks`: the fallback where namespaces cannot be made. Everything runs on 127.0.0.1; the relay
  meters each site's gRPC byte streams through a token bucket at the same rate (and adds the same
  latency); the AllReduce baseline sleeps bytes/rate after each collective. Labelled as such.
"""

from __future__ import annotations

import json
import pathlib
import time
from collections.abc import Callable
from dataclasses import dataclass

from dilocox.bench.netns import Topology
from dilocox.bench.wan_procs import ChildProcess, child_env, python_module, stop_all, wait_for_file
from dilocox.common.subprocesses import free_local_port


@dataclass(frozen=True)
class LinkSettings:
    rate_mbit: float
    latency_ms: float  # one way, user space
    jitter_ms: float

    def relay_spec(self, throttle: bool) -> dict:
        return {
            "rate_mbit": self.rate_mbit if throttle else None,
            "latency_ms": self.latency_ms,
            "jitter_ms": self.jitter_ms,
        }


class NamespaceLinks:
    kind = "netns"
    label = "Linux network namespaces + veth + tc tbf (kernel shaping); latency/jitter in user space"
    hub_listen_host = "0.0.0.0"
    relay_throttles = False  # tc does the shaping
    allreduce_throttles = False

    def __init__(self, sites: int, settings: LinkSettings) -> None:
        self.sites = sites
        self.settings = settings
        self.topology = Topology(sites, settings.rate_mbit)

    def __enter__(self) -> NamespaceLinks:
        self.topology.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.topology.close()

    def site_argv(self, site: int, argv: list[str]) -> list[str]:
        return self.topology.exec_argv(self.topology.links[site].namespace, argv)

    def hub_argv(self, argv: list[str]) -> list[str]:
        return self.topology.exec_argv(self.topology.hub, argv)

    def hub_address(self, site: int) -> str:
        return self.topology.links[site].hub_address

    def site_address(self, site: int) -> str:
        return self.topology.links[site].address

    def gloo_ifname(self, site: int) -> str:
        return self.topology.links[site].device

    def free_port(self, site: int) -> int:
        return 29500  # a fresh namespace: nothing else listens there

    def counters(self, site: int) -> dict[str, int] | None:
        return self.topology.counters(site)

    def describe(self) -> dict:
        return {
            "kind": self.kind,
            "label": self.label,
            "namespaces": [self.topology.hub, *(link.namespace for link in self.topology.links)],
            "qdiscs": self.topology.qdiscs(),
        }


class LoopbackLinks:
    kind = "fallback"
    label = (
        "IN-PROCESS FALLBACK (no network namespaces): token-bucket throttle on the gRPC byte streams in a "
        "user-space relay; AllReduce throttled by sleeping bytes/rate after each collective"
    )
    hub_listen_host = "127.0.0.1"
    relay_throttles = True
    allreduce_throttles = True

    def __init__(self, sites: int, settings: LinkSettings, reason: str = "") -> None:
        self.sites = sites
        self.settings = settings
        self.reason = reason

    def __enter__(self) -> LoopbackLinks:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def site_argv(self, site: int, argv: list[str]) -> list[str]:
        return argv

    def hub_argv(self, argv: list[str]) -> list[str]:
        return argv

    def hub_address(self, site: int) -> str:
        return "127.0.0.1"

    def site_address(self, site: int) -> str:
        return "127.0.0.1"

    def gloo_ifname(self, site: int) -> str:
        return "lo"

    def free_port(self, site: int) -> int:
        return free_local_port()

    def counters(self, site: int) -> dict[str, int] | None:
        return None

    def describe(self) -> dict:
        return {"kind": self.kind, "label": self.label, "why_no_namespaces": self.reason}


Links = NamespaceLinks | LoopbackLinks


class Relay:
    """The user-space WAN relay (bench/relay.py) in the hub: one listening port per route."""

    def __init__(
        self, links: Links, routes: list[tuple[int, tuple[str, int]]], work_dir: pathlib.Path, name: str = "relay"
    ) -> None:
        """`routes`: (site, upstream address) pairs; `ports[i]` is where site `routes[i][0]` dials."""
        spec = {
            "links": {f"s{site}": links.settings.relay_spec(links.relay_throttles) for site in range(links.sites)},
            "routes": [
                {"listen": [links.hub_listen_host, 0], "upstream": list(up), "link": f"s{site}"} for site, up in routes
            ],
            "ports_file": str(work_dir / f"{name}.ports"),
            "stats_file": str(work_dir / f"{name}.stats"),
        }
        for stale in ("ports_file", "stats_file"):
            pathlib.Path(spec[stale]).unlink(missing_ok=True)
        spec_path = work_dir / f"{name}.json"
        spec_path.write_text(json.dumps(spec, indent=1))
        self.stats_path = pathlib.Path(spec["stats_file"])
        self.proc = ChildProcess(
            name, links.hub_argv(python_module("dilocox.bench.relay", str(spec_path))), work_dir / f"{name}.log"
        )
        self.ports = json.loads(wait_for_file(pathlib.Path(spec["ports_file"]), self.proc))

    def stop(self) -> dict:
        """Stop it; returns its final byte counts per link ({"s0": {"bytes": {"up": …, "down": …}}, …})."""
        self.proc.stop()
        try:
            return json.loads(self.stats_path.read_text())
        except (OSError, json.JSONDecodeError):
            return {}


def _probe(
    links: Links,
    work_dir: pathlib.Path,
    name: str,
    sink_argv_of,
    sink_host: str,
    sender_argv_of,
    dial,
    seconds: float,
    warmup_s: float,
    relay_site: int | None = None,
    wire_bytes: Callable[[], int] | None = None,
) -> dict:
    """One bulk transfer. The rate that counts is `wire_mbit_per_s` where the kernel's counters can be read
    (`wire_bytes`: bytes through the shaped device, sampled over the steady middle of the transfer, frames
    as tbf meters them); `goodput_mbit_per_s` is the payload the sink received after its warm-up."""
    port_file = work_dir / f"{name}.port"
    flowing = pathlib.Path(str(port_file) + ".flowing")
    port_file.unlink(missing_ok=True)
    flowing.unlink(missing_ok=True)
    sink = ChildProcess(
        f"{name}-sink",
        sink_argv_of(python_module("dilocox.bench.link_probe", "sink", sink_host, str(port_file), str(warmup_s))),
        work_dir / f"{name}-sink.log",
        env=child_env(),
        capture_stdout=True,
    )
    procs, relay, wire = [sink], None, None
    try:
        port = int(wait_for_file(port_file, sink, 30))
        host = dial
        if relay_site is not None:
            relay = Relay(links, [(relay_site, ("127.0.0.1", port))], work_dir, name=f"{name}-relay")
            port = relay.ports[0]
        budget = int(
            links.settings.rate_mbit * 1e6 / 8 * seconds * 1.25
        )  # a little over what the link takes in `seconds`
        sender = ChildProcess(
            f"{name}-send",
            sender_argv_of(
                python_module("dilocox.bench.link_probe", "send", host, str(port), str(seconds), str(budget))
            ),
            work_dir / f"{name}-send.log",
        )
        procs.append(sender)
        if wire_bytes is not None:
            wait_for_file(flowing, sender, 30)
            time.sleep(warmup_s)
            b0, t0 = wire_bytes(), time.monotonic()
            time.sleep(max(0.5, seconds - warmup_s - 0.3))
            b1, t1 = wire_bytes(), time.monotonic()
            wire = round((b1 - b0) * 8 / (t1 - t0) / 1e6, 3)
        if sender.wait(timeout=seconds + 60) != 0:
            raise RuntimeError(f"link probe {name}: the sender failed:\n{sender.tail()}")
        sink.wait(timeout=60)
        result = json.loads(sink.stdout_text.strip().splitlines()[-1])
    finally:
        if relay is not None:
            relay.stop()
        stop_all(procs)
    configured = links.settings.rate_mbit
    measured = wire if wire is not None else result["mbit_per_s"]
    return {
        "configured_mbit_per_s": configured,
        "mbit_per_s": measured,
        "ratio": round(measured / configured, 3),
        "measured_by": "interface counters (frames through the shaped veth)"
        if wire is not None
        else "sink (payload bytes)",
        "goodput_mbit_per_s": result["mbit_per_s"],
        "goodput_ratio": round(result["mbit_per_s"] / configured, 3),
        "sink": result,
    }


def measure_links(links: Links, work_dir: pathlib.Path, seconds: float = 3.0, warmup_s: float = 1.0) -> dict[str, dict]:
    """Bulk TCP transfers through the shaped link(s): site 0 → hub (uplink), hub → site 0 (downlink), and
    (namespaces, ≥ 2 sites) site 0 → site 1, the AllReduce path."""
    work_dir.mkdir(parents=True, exist_ok=True)
    hub, site0 = links.hub_argv, (lambda argv: links.site_argv(0, argv))
    results = {}
    if isinstance(links, NamespaceLinks):
        tx0 = lambda: links.counters(0)["tx_bytes"]  # noqa: E731
        rx0 = lambda: links.counters(0)["rx_bytes"]  # noqa: E731
        results["uplink site0→hub"] = _probe(
            links, work_dir, "probe-up", hub, "0.0.0.0", site0, links.hub_address(0), seconds, warmup_s, wire_bytes=tx0
        )
        results["downlink hub→site0"] = _probe(
            links,
            work_dir,
            "probe-down",
            site0,
            "0.0.0.0",
            hub,
            links.site_address(0),
            seconds,
            warmup_s,
            wire_bytes=rx0,
        )
        if links.sites >= 2:
            site1 = lambda argv: links.site_argv(1, argv)  # noqa: E731
            rx1 = lambda: links.counters(1)["rx_bytes"]  # noqa: E731
            results["site0→site1 (AllReduce path)"] = _probe(
                links,
                work_dir,
                "probe-s2s",
                site1,
                "0.0.0.0",
                site0,
                links.site_address(1),
                seconds,
                warmup_s,
                wire_bytes=rx1,
            )
    else:  # through the relay's token bucket; the sender plays the site, the sink the hub
        results["uplink site0→hub (relay throttle)"] = _probe(
            links, work_dir, "probe-up", hub, "127.0.0.1", site0, "127.0.0.1", seconds, warmup_s, relay_site=0
        )
    return results
