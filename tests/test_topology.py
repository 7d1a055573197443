"""One topology drives the compose file and a plain-process run: the file is current, every service's
command parses with the CLI's own parser, and the same commands train together on localhost."""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import shlex
import subprocess
import sys

import pytest

from dilocox.common.cli import build_parser
from dilocox.common.deploy.compose_file import compose_document, render, to_yaml
from dilocox.common.deploy.topology import COMPOSE, LOCALHOST, Topology, all_commands, as_shell
from tests.json_logs import json_events
from tests.ports import free_port_range

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_committed_compose_file_is_the_rendered_topology():
    assert (ROOT / "docker-compose.yml").read_text() == render(Topology()), "run `dilocox compose render`"


def _steps_of(command: list[str]) -> list[list[str]]:
    """A compose command back into its dilocox steps (`sh -c "a && exec b"` → [a, b])."""
    if command[:2] != ["sh", "-c"]:
        return [command]
    return [shlex.split(part.removeprefix("exec ")) for part in command[2].split(" && ")]


def _parses(argv: list[str]) -> argparse.Namespace:
    assert argv[0] == "dilocox", argv
    return build_parser(argv[1:]).parse_args(argv[1:])


@pytest.mark.parametrize("placement", [COMPOSE, LOCALHOST], ids=["compose", "localhost"])
def test_every_service_command_parses_with_the_cli_parser(placement):
    topology = Topology()
    for service, steps in all_commands(topology, placement).items():
        for step in steps:
            args = _parses(step)
            assert args.command in {"server", "worker", "link"}, service
    document = compose_document(topology)
    for service, spec in document["services"].items():
        steps = _steps_of(spec["command"])
        assert steps == all_commands(topology, COMPOSE)[service]
        for step in steps:
            _parses(step)
        health = spec["healthcheck"]["test"][1:]
        if health[0] == "dilocox":
            assert _parses(health).command == "health"


def test_compose_document_wires_health_volumes_and_the_shaped_wan():
    topology = Topology()
    document = compose_document(topology)
    sites = [s.name for s in topology.sites]
    for site in sites:
        spec = document["services"][site]
        assert spec["cap_add"] == ["NET_ADMIN"]
        assert set(spec["depends_on"]) == set(topology.shard_names())
        assert all(v == {"condition": "service_healthy"} for v in spec["depends_on"].values())
        assert spec["command"][2].startswith(
            "dilocox link shape --towards shard-0 --rate-mbit 20 && exec dilocox worker"
        )
        assert document["networks"][f"{site}-net"] == {"internal": True}
    for shard in topology.shard_names():
        assert document["services"][shard]["volumes"] == [f"{shard}-checkpoints:/var/lib/dilocox/checkpoints"]
    assert as_shell([["a", "b c"], ["d"]]) == "a 'b c' && exec d"


def test_yaml_emitter_round_trips_through_json_scalars():
    text = to_yaml({"a": {"b": ["x y", 1, True], "c": {}}, "d": [{"e": "f"}]})
    assert text == 'a:\n  b: ["x y", 1, true]\n  c: {}\nd:\n  - e: "f"'


@pytest.mark.timeout(300)
def test_topology_trains_as_plain_processes(tmp_path):
    """The compose topology's own commands (localhost placement), shortened to 3 rounds."""
    base = Topology()
    ports = free_port_range(base.num_shards, host="127.0.0.1")
    metrics = free_port_range(base.num_shards + len(base.sites), host="127.0.0.1")
    # min_clusters=2: with the compose default (1) a site that starts first may close round 1 alone.
    topology = dataclasses.replace(
        base, rounds=3, inner_steps=10, min_clusters=2, host_port_base=ports, host_metrics_base=metrics
    )
    procs: dict[str, subprocess.Popen] = {}
    try:
        for name, steps in all_commands(topology, LOCALHOST).items():
            (argv,) = steps
            log = open(tmp_path / f"{name}.log", "w")
            procs[name] = subprocess.Popen(
                [sys.executable, "-m", "dilocox.common.cli", *argv[1:]],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=tmp_path,
            )
        for site in topology.sites:
            assert procs[site.name].wait(timeout=240) == 0, (tmp_path / f"{site.name}.log").read_text()[-3000:]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
    closed = [e for e in json_events(tmp_path / "shard-0.log") if e.get("event") == "round_closed"]
    assert [e["round"] for e in closed] == [1, 2, 3, 4]  # 3 rounds, then the end-of-run flush
    assert all(e["clusters"] == len(topology.sites) for e in closed)
    for site in topology.sites:
        done = [e for e in json_events(tmp_path / f"{site.name}.log") if e.get("event") == "cluster_done"]
        assert len(done) == site.ranks  # every rank of the torchrun job finished
        assert all(e["final_eval_loss"] < e["initial_eval_loss"] for e in done)
