"""Rounds kept on the shards' disk (server/state/rounds_on_disk.py): a site away for longer than the rounds a
shard keeps in memory still resumes by delta — across a shard's own restart — and what is kept stays a
chain bounded by age and by a disk budget."""

from __future__ import annotations

import json
import os
import time

import torch

from dilocox.common.config.run import CompressionConfig
from dilocox.common.wire.assignment import model_digest
from dilocox.common.wire.compression import TensorCompressor
from dilocox.server.shard import Shard
from dilocox.server.state import checkpoint
from dilocox.server.state.rounds_on_disk import RoundsOnDisk
from dilocox.worker.exchange.aggregator_client import AggregatorClient
from tests.test_checkpoint import PARAMS, slices, tensors
from tests.tiny_worker import stop_once_at, tiny_worker

RUN = "disk-rounds"


def _shard(
    tmp_path, keep_s: float = 3600.0, budget: int = 10**9, clock=time.time, resumed_from: Shard | None = None
) -> Shard:  # noqa: ANN001
    shard = Shard(0, 1, RUN, 0.7, 0.9, min_clusters=2, keep_rounds=2)
    if resumed_from is not None:
        checkpoint.restore(shard, checkpoint.load(checkpoint.save(resumed_from, tmp_path / "ckpt")))
    shard.recent.keep_on_disk(
        RoundsOnDisk(tmp_path / "rounds", 0, RUN, keep_s, budget, clock),
        shard.snapshot,
        resumed=resumed_from is not None,
    )
    return shard


def _run(shard: Shard, rounds: range) -> None:
    if shard.snapshot is None:
        for c in ("a", "b"):
            shard.join(RUN, c, model_digest(PARAMS), PARAMS)
        shard.commit_push("a", 0, 1.0, slices(shard, tensors(0)))
    for r in rounds:
        shard.commit_push("a", r, 3.0, slices(shard, tensors(10 * r)))
        shard.commit_push("b", r, 1.0, slices(shard, tensors(10 * r + 1)))


def _flushed(shard: Shard) -> None:
    shard.recent.disk.flush()  # the writer has written everything queued


def _payloads(rounds) -> list:  # noqa: ANN001
    return [
        (
            v,
            {
                k: {c: (x.weight, bytes(x.slice.payload), x.scale) for c, x in per.items()}
                for k, per in contributions.items()
            },
        )
        for v, contributions in rounds
    ]


def test_a_site_further_behind_than_memory_replays_from_disk_also_after_the_shard_restarts(tmp_path):
    memory_only = Shard(0, 1, RUN, 0.7, 0.9, min_clusters=2, keep_rounds=2)
    _run(memory_only, range(1, 26))
    assert memory_only.recent.since(3, memory_only.snapshot) is None  # 22 behind, 2 kept: a full pull

    shard = _shard(tmp_path)
    _run(shard, range(1, 26))
    _flushed(shard)
    rounds = shard.recent.since(3, shard.snapshot)
    assert [v for v, _ in rounds] == list(range(4, 26))
    # Each version's contributions come back as they were pushed (the memory-only shard saw the same pushes).
    newest_two = _payloads(memory_only.recent.since(23, memory_only.snapshot))
    assert _payloads(rounds)[-2:] == newest_two

    # The shard is killed and resumes from its checkpoint at 25: the rounds on disk are still served, and the
    # run goes on from there, each new version kept as well.
    restarted = _shard(tmp_path, resumed_from=shard)
    assert _payloads(restarted.recent.since(3, restarted.snapshot)) == _payloads(rounds)
    _run(restarted, range(26, 28))
    _flushed(restarted)
    assert [v for v, _ in restarted.recent.since(3, restarted.snapshot)] == list(range(4, 28))


def test_a_fresh_start_or_an_older_checkpoint_never_serves_another_runs_rounds(tmp_path):
    shard = _shard(tmp_path)
    _run(shard, range(1, 9))
    _flushed(shard)
    older = Shard(0, 1, RUN, 0.7, 0.9, min_clusters=2, keep_rounds=2)
    _run(older, range(1, 5))  # as a checkpoint kept at version 4 would restore
    resumed = _shard(tmp_path, resumed_from=older)
    _flushed(resumed)
    assert resumed.recent.disk.versions() == {1, 2, 3, 4}  # 5..8 are made anew by the resumed run
    fresh = _shard(tmp_path)
    assert fresh.recent.disk.versions() == set() and not list((tmp_path / "rounds" / "shard-0").iterdir())


def test_kept_for_keep_s_and_within_the_budget_oldest_first_never_the_newest(tmp_path):
    now = [1000.0]
    shard = _shard(tmp_path, keep_s=100.0, clock=lambda: now[0])
    for r in range(1, 11):
        _run(shard, range(r, r + 1))
        _flushed(shard)
        now[0] += 20.0
    _flushed(shard)
    disk = shard.recent.disk
    kept = sorted(disk.versions())
    assert kept == list(range(5, 11)), (
        kept
    )  # v saved at 1000 + 20·(v − 1); at the last write (1180) those over 100 s old went
    size = disk.bytes_on_disk() // len(kept)
    tight = _shard(tmp_path / "tight", budget=3 * size + size // 2)
    _run(tight, range(1, 8))
    _flushed(tight)
    assert sorted(tight.recent.disk.versions()) == [5, 6, 7]  # the budget holds three: the oldest went first
    tiny = _shard(tmp_path / "tiny", budget=1)
    _run(tiny, range(1, 4))
    _flushed(tiny)
    assert sorted(tiny.recent.disk.versions()) == [3]  # over any budget, the newest stays


def test_a_damaged_file_is_not_served_and_the_site_pulls_in_full(tmp_path):
    shard = _shard(tmp_path)
    _run(shard, range(1, 8))
    _flushed(shard)
    damaged = tmp_path / "rounds" / "shard-0" / "v3.pt"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    assert shard.recent.since(2, shard.snapshot) is None
    assert not damaged.exists() and 3 not in shard.recent.disk.versions()
    assert [v for v, _ in shard.recent.since(3, shard.snapshot)] == [4, 5, 6, 7]
    # A file replaced by a pickle that would run code when loaded is refused, never run (weights-only loader).
    marker = tmp_path / "ran"
    torch.save({"contributions": _MakesFolder(str(marker))}, tmp_path / "rounds" / "shard-0" / "v5.pt")
    assert (
        shard.recent.since(4, shard.snapshot) is None and not marker.exists() and 5 not in shard.recent.disk.versions()
    )
    _MakesFolder(str(marker)).__reduce__()[0](str(marker))  # the call it holds does make the folder, when run
    assert marker.is_dir()


class _MakesFolder:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):  # noqa: ANN204 - what a hostile file would hold: a call made on unpickling
        return (os.mkdir, (self.path,))


def test_a_write_the_disk_refuses_ends_the_chain_there(tmp_path, monkeypatch):
    from dilocox.server.state import rounds_on_disk

    real = rounds_on_disk.save_state

    def full_disk(state, path):  # noqa: ANN001
        if state["version"] == 6:
            raise OSError(28, "No space left on device")
        return real(state, path)

    monkeypatch.setattr(rounds_on_disk, "save_state", full_disk)
    shard = _shard(tmp_path)
    _run(shard, range(1, 10))
    _flushed(shard)
    assert shard.recent.disk.write_failures == 1
    assert sorted(shard.recent.disk.versions()) == [7, 8, 9]  # 1-5 no longer lead up to the newest
    assert shard.recent.since(5, shard.snapshot) is None and [v for v, _ in shard.recent.since(6, shard.snapshot)] == [
        7,
        8,
        9,
    ]


def test_a_site_stopped_for_20_rounds_resumes_by_delta(shard_set, tmp_path):
    """The issue's case: a site stopped (SIGTERM, its checkpoint written) while the run goes on for 20
    rounds, against shards that keep 2 versions in memory, resumes by delta from their disk."""
    shards = shard_set(1, RUN, round_deadline_s=3.0, keep_rounds=2)
    shard = shards.shards[0]
    shard.recent.keep_on_disk(RoundsOnDisk(tmp_path / "rounds", 0, RUN), None, resumed=False)
    rounds = 26

    flags = (
        "--cluster",
        "away",
        "--rounds",
        str(rounds),
        "--inner-steps",
        "2",
        "--checkpoint-dir",
        str(tmp_path / "site"),
    )
    stop_once_at(tiny_worker(shards.addresses, RUN, *flags), shard, 3)
    stopped_at = shard.version
    # Another site goes on alone for 20 rounds: the first waits out the deadline for the stopped site.
    steady = AggregatorClient(
        shards.addresses,
        RUN,
        "steady",
        compressor=TensorCompressor(CompressionConfig(), seed=1),
        connect_timeout=30,
        rpc_timeout=60,
    )
    try:
        info = steady.join(shard.param_specs, shard.run_config_json)
        for r in range(stopped_at + 1, stopped_at + 21):
            g = torch.Generator().manual_seed(r)
            steady.push(r, 256.0, {s.key: 1e-3 * torch.randn(s.slice_shape, generator=g) for s in info.assignment})
            shards.wait_version(r, timeout=60)
    finally:
        steady.close()
    assert shard.version == stopped_at + 20
    second = tiny_worker(shards.addresses, RUN, *flags, "--resume")
    try:
        _, log = second.communicate(timeout=240)
    finally:
        if second.poll() is None:
            second.kill()
    assert second.returncode == 0, log[-3000:]
    events = {e["event"]: e for e in map(json.loads, filter(lambda line: line.startswith("{"), log.splitlines()))}
    resumed = events["replica_resumed"]
    assert resumed["how"] == "delta" and resumed["reason"] == "", resumed
    assert resumed["rounds_replayed"] >= 20, resumed
    assert 0 < resumed["bytes_down"] < resumed["full_pull_bytes"], resumed
    assert "replay_mismatch" not in events and "replica_resync" not in events
