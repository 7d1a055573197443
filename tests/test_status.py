"""`dilocox status`: a table (or JSON lines) of every shard's live state, unreachable shards included."""

from __future__ import annotations

import json
import re
import socket
import time

import pytest
import structlog
import torch

from dilocox.common import cli
from dilocox.worker.exchange.aggregator_client import AggregatorClient
from dilocox.worker.exchange.cluster import slice_tensors
from dilocox.worker.status import COLUMNS, SITE_COLUMNS

RUN = "run-status"
PARAMS = [("w", (16, 4)), ("b", (4,))]


@pytest.fixture(autouse=True)
def _restore_logging():
    """`dilocox status` points structlog at this test's captured stderr, which closes after it: put the
    process-wide configuration back, or later tests' log calls would write to a closed file."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


def _dead_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _drive_one_round(addresses: list[str]) -> None:
    """Clusters a and b close round 1; a then pushes half of round 2 on nothing (a stays 'collecting')."""
    clients = [AggregatorClient(addresses, RUN, c, connect_timeout=10, rpc_timeout=30) for c in ("a", "b")]
    try:
        for client in clients:
            client.join(PARAMS)
        full = {name: torch.ones(shape) for name, shape in PARAMS}
        clients[0].push(0, 1.0, slice_tensors(clients[0].assignment, full))
        for client in clients:
            client.push(1, 10.0, slice_tensors(client.assignment, full))
        clients[0].pull(min_version=1, wait_seconds=10)
        clients[0].push(2, 10.0, slice_tensors(clients[0].assignment, full))
    finally:
        for client in clients:
            client.close()


def test_status_table_and_json(shard_set, capsys):
    shards = shard_set(2, RUN, min_clusters=2)
    started = time.monotonic()
    _drive_one_round(shards.addresses)
    driven_s = time.monotonic() - started
    servers = ",".join(shards.addresses)
    capsys.readouterr()  # the shards' own logs

    assert cli.main(["status", "--servers", servers, "--insecure"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == [w for c in COLUMNS for w in c.split()]
    assert len(lines) == 3 + 1 + 3  # the shards, a blank line, the sites
    for index, (line, address) in enumerate(zip(lines[1:3], shards.addresses)):
        cells = line.split()
        assert cells[:6] == [
            f"{index}/2",
            address,
            "collecting",
            "1",
            "2",
            "2",
        ]  # the run's last version unknown: no config
        assert "1/2" in cells and "ago" in cells
        assert len(re.findall(r"\b\d+(?:\.\d+)? (?:B|KiB|MiB)\b", line)) == 2, line  # bytes in and out
    assert lines[3] == "" and lines[4].split() == [w for c in SITE_COLUMNS for w in c.split()]
    # Per site: in the run, 1 round made, none late, last round 1 with 10 tokens; H and idle not said; the update
    # check passed.
    assert [line.split() for line in lines[5:]] == [
        [site, "yes", "1", "0", "1", "10", "-", "-", "ok"] for site in ("a", "b")
    ]

    assert cli.main(["status", "--servers", servers, "--insecure", "--json"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["address"] for r in records] == shards.addresses
    for r in records:
        assert r["state"] == "collecting" and r["version"] == 1 and r["open_round"] == 2
        assert r["clusters"] == ["a", "b"] and r["contributed"] == ["a"] and r["run_id"] == RUN
        assert r["bytes_in"] > 0 and r["bytes_out"] > 0 and r["last_round_closed_at"] > 0
        assert 0 <= r["last_round_seconds"] <= driven_s  # the round ran inside the test's drive: no speed bound
        assert [
            (x["cluster"], x["member"], x["rounds_made"], x["rounds_late"], x["last_tokens"]) for x in r["sites"]
        ] == [("a", True, 1, 0, 10.0), ("b", True, 1, 0, 10.0)]


def test_status_marks_an_unreachable_shard_and_fails(shard_set, capsys):
    shards = shard_set(1, RUN)
    dead = _dead_address()
    capsys.readouterr()
    code = cli.main(["status", "--servers", f"{shards.addresses[0]},{dead}", "--insecure", "--timeout", "3"])
    out = capsys.readouterr().out
    assert code == 1
    rows = out.splitlines()
    assert rows[1].split()[:4] == ["0/1", shards.addresses[0], "uninitialised", "-1"]
    assert rows[2].split()[:3] == ["?", dead, "unreachable"]
    assert f"{dead}: UNAVAILABLE" in out

    assert cli.main(["status", "--servers", dead, "--insecure", "--json", "--timeout", "3"]) == 1
    record = json.loads(capsys.readouterr().out)
    assert record["state"] == "unreachable" and record["error"] == "UNAVAILABLE"


def test_the_version_column_says_how_far_the_run_is():
    """`X/N`: version X of the run's last N (its rounds and the flush), once the shard knows N."""
    from dilocox.worker.status import table_row

    record = {
        "state": "waiting",
        "shard_index": 0,
        "num_shards": 1,
        "address": "a:1",
        "version": 3,
        "open_round": 4,
        "clusters": ["a"],
        "min_clusters": 1,
        "contributed": [],
        "last_round_seconds": 0.0,
        "last_round_closed_at": 0.0,
        "bytes_in": 0,
        "bytes_out": 0,
        "final_version": 17,
    }
    assert table_row(record, now=0.0)[3] == "3/17"
    assert table_row({**record, "final_version": None}, now=0.0)[3] == "3"


def test_a_site_record_reads_as_every_field_without_a_deep_copy():
    """Status builds one per site under the shard's lock: a shallow copy, the same as `dataclasses.asdict`
    while every field is a scalar (a nested field would need asdict again)."""
    import dataclasses

    from dilocox.server.rounds.round_close import SiteRecord

    record = SiteRecord()
    record.made(2, 5.0)
    record.said(4, 0.5)
    assert record.as_status() == dataclasses.asdict(record)
    assert all(isinstance(v, (int, float, str, bool)) for v in record.as_status().values())
