"""Render a `Topology` as a Compose-spec file (works with `docker-compose` 1.29 and `docker compose` v2).

Why generated: the compose services must run exactly the commands the plain-process test runs, so
both come from `common/deploy/topology.py`; a test checks the committed `docker-compose.yml` equals this
rendering. The YAML is written by a tiny emitter (strings JSON-quoted, which YAML reads verbatim)
rather than a new dependency.
"""

from __future__ import annotations

import json
from typing import Any

from dilocox.common.deploy.topology import (
    CHECKPOINT_DIR,
    COMPOSE,
    METRICS_PORT,
    SHARD_PORT,
    Topology,
    all_commands,
    as_shell,
)

HEADER = """\
# Multi-site simulation: {shards} aggregation shards and {sites} sites, each site a torchrun job whose
# WAN egress is shaped by tc inside its container (rate {rate:g} Mbit/s; latency, if any, is added in
# user space by the shards: this kernel has no netem).
#
# GENERATED from common/deploy/topology.py by `dilocox compose render` -- edit the topology, not this file.
# Offline machines: `dilocox compose build` makes the image without a registry; `dilocox compose check`
# runs this file end to end and checks it (docs/deploy.md).
"""

IMAGE = "${DILOCOX_IMAGE:-dilocox:cpu}"
BUILD = {
    "context": ".",
    "args": {"BASE_IMAGE": "${DILOCOX_BASE_IMAGE:-python:3.11-slim}", "WHEELHOUSE": "${DILOCOX_WHEELHOUSE:-}"},
}
METRICS_PROBE = f"import urllib.request; urllib.request.urlopen('http://127.0.0.1:{METRICS_PORT}/metrics', timeout=3)"


def _healthcheck(test: list[str], start_period: str) -> dict[str, Any]:
    return {"test": ["CMD", *test], "interval": "5s", "timeout": "5s", "retries": 6, "start_period": start_period}


def compose_document(topology: Topology) -> dict[str, Any]:
    commands = all_commands(topology, COMPOSE)
    services: dict[str, Any] = {}
    for index, name in enumerate(topology.shard_names()):
        services[name] = {
            "image": IMAGE,
            "build": BUILD,
            "command": commands[name][0],
            "networks": ["wan"],
            "ports": [
                f"127.0.0.1:{topology.host_port_base + index}:{SHARD_PORT}",
                f"127.0.0.1:{topology.host_metrics_base + index}:{METRICS_PORT}",
            ],
            "volumes": [f"{name}-checkpoints:{CHECKPOINT_DIR}"],
            "healthcheck": _healthcheck(
                ["dilocox", "health", "--server", f"127.0.0.1:{SHARD_PORT}", "--insecure"], "10s"
            ),
            "stop_grace_period": "15s",
        }
    for index, site in enumerate(topology.sites):
        process = topology.num_shards + index
        services[site.name] = {
            "image": IMAGE,
            "build": BUILD,
            "command": ["sh", "-c", as_shell(commands[site.name])],
            "cap_add": ["NET_ADMIN"],  # to shape its own WAN egress with tc
            "networks": ["wan", f"{site.name}-net"],
            "ports": [f"127.0.0.1:{topology.host_metrics_base + process}:{METRICS_PORT}"],
            "depends_on": {name: {"condition": "service_healthy"} for name in topology.shard_names()},
            "healthcheck": _healthcheck(["python", "-c", METRICS_PROBE], "60s"),
            "stop_grace_period": "15s",
        }
    networks: dict[str, Any] = {"wan": {}}
    for site in topology.sites:
        # A site's own network: where its nodes would talk NCCL/gloo unshaped (one container here).
        networks[f"{site.name}-net"] = {"internal": True}
    volumes = {f"{name}-checkpoints": {} for name in topology.shard_names()}
    return {"services": services, "networks": networks, "volumes": volumes}


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))


def _key(key: str) -> str:
    return key if key.replace("-", "").replace("_", "").isalnum() else json.dumps(key)


def to_yaml(value: Any, indent: int = 0) -> str:
    """Block-style YAML for dicts/lists of scalars; short scalar lists are written inline."""
    pad = "  " * indent
    lines = []
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(item, dict) and item:
                lines.append(f"{pad}{_key(key)}:\n{to_yaml(item, indent + 1)}")
            elif isinstance(item, dict):
                lines.append(f"{pad}{_key(key)}: {{}}")
            elif isinstance(item, list) and all(not isinstance(x, (dict, list)) for x in item):
                lines.append(f"{pad}{_key(key)}: [{', '.join(_scalar(x) for x in item)}]")
            elif isinstance(item, list):
                lines.append(f"{pad}{_key(key)}:\n{to_yaml(item, indent + 1)}")
            else:
                lines.append(f"{pad}{_key(key)}: {_scalar(item)}")
    else:
        for item in value:
            if isinstance(item, (dict, list)):
                body = to_yaml(item, indent + 1).lstrip()
                lines.append(f"{pad}- {body}")
            else:
                lines.append(f"{pad}- {_scalar(item)}")
    return "\n".join(lines)


def render(topology: Topology) -> str:
    header = HEADER.format(shards=topology.num_shards, sites=len(topology.sites), rate=topology.wan_rate_mbit)
    return header + "\n" + to_yaml(compose_document(topology)) + "\n"
