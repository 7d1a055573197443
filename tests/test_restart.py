"""Restarts lose nothing: a shard started without --resume never overwrites its
checkpoint, --fresh moves it aside, the last versions are kept and never replaced by older ones, SIGTERM
answers held pulls at once and exits in seconds, and an empty push is refused."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import grpc
import pytest
import torch

from dilocox.common.wire.assignment import model_digest
from dilocox.common.wire.checkpoint_format import checkpoint_path
from dilocox.common.wire.framing import EncodedSlice
from dilocox.proto import dilocox_pb2 as pb
from dilocox.proto import dilocox_pb2_grpc as pb_grpc
from dilocox.server.shard import Shard
from dilocox.server.state import checkpoint
from dilocox.worker.exchange.aggregator_client import AggregatorClient
from dilocox.worker.exchange.cluster import slice_tensors
from tests.ports import listening

RUN = "restart-run"
PARAMS = [("w", (8, 6)), ("b", (6,))]


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in PARAMS}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _shard_cmd(port: int, ckpt_dir, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "dilocox.common.cli",
        "server",
        "--port",
        str(port),
        "--run-id",
        RUN,
        "--round-deadline-s",
        "0",
        "--checkpoint-dir",
        str(ckpt_dir),
        "--log-format",
        "json",
        "--insecure",
        *extra,
    ]


def _wait_listening(port: int, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not listening(port):
        assert proc.poll() is None and time.monotonic() < deadline, (
            proc.stderr.read() if proc.poll() is not None else "timeout"
        )
        time.sleep(0.1)


def _publish(shard: Shard, round_: int) -> None:
    slices = [EncodedSlice.exact(key, t) for key, t in slice_tensors(shard.assignment, _tensors(round_)).items()]
    shard.commit_push("c", round_, 1.0, slices)


def _saved_checkpoint(tmp_path, rounds: int = 2) -> Shard:
    """A shard that published version `rounds` and saved it, in process."""
    shard = Shard(0, 1, RUN)
    shard.join(RUN, "c", model_digest(PARAMS), PARAMS, "{}")
    for round_ in range(rounds + 1):
        _publish(shard, round_)
    checkpoint.save(shard, tmp_path)
    return shard


def test_restart_without_resume_over_a_checkpoint_is_refused_and_leaves_it_untouched(tmp_path):
    _saved_checkpoint(tmp_path)
    path = checkpoint_path(tmp_path, 0)
    before = path.read_bytes()
    done = subprocess.run(_shard_cmd(_free_port(), tmp_path), capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert (
        f"{path} holds run '{RUN}' at version 2" in done.stderr
        and "--resume" in done.stderr
        and "--fresh" in done.stderr
    )
    assert path.read_bytes() == before


def test_restart_fresh_moves_the_old_checkpoint_aside(tmp_path):
    _saved_checkpoint(tmp_path)
    before = checkpoint_path(tmp_path, 0).read_bytes()
    port = _free_port()
    proc = subprocess.Popen(
        _shard_cmd(port, tmp_path, "--fresh"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        _wait_listening(port, proc)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    moved = list(tmp_path.glob("replaced-shard-0-*/shard-0.pt"))
    assert len(moved) == 1 and moved[0].read_bytes() == before


def test_restart_keeps_the_last_versions_and_never_goes_back(tmp_path):
    shard = _saved_checkpoint(tmp_path / "scratch", rounds=0)
    keeper = checkpoint.Checkpointer(shard, tmp_path, keep=3)
    for round_ in range(1, 6):
        _publish(shard, round_)
        keeper(shard.snapshot)
    kept = sorted(p.name for p in tmp_path.glob("shard-0*.pt"))
    assert kept == ["shard-0.pt", "shard-0.v3.pt", "shard-0.v4.pt"]
    assert checkpoint.load(checkpoint_path(tmp_path, 0))["snapshot"]["version"] == 5
    empty = Shard(0, 1, RUN)  # a shard that holds less than its folder: never written over it
    checkpoint.Checkpointer(empty, tmp_path).save_now()
    assert checkpoint.load(checkpoint_path(tmp_path, 0))["snapshot"]["version"] == 5


def test_restart_sigterm_during_a_held_pull_exits_without_waiting_for_it(tmp_path):
    """A pull parked for 600 s does not hold a SIGTERM'd shard: it ends the pull (UNAVAILABLE, so the client
    retries the restarted shard), writes its final checkpoint and exits 0. The 60 s below only guards against a
    hang; ten times that is what waiting for the pull would take, so no machine speed decides the outcome."""
    port = _free_port()
    proc = subprocess.Popen(
        _shard_cmd(port, tmp_path, "--min-clusters", "2"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    outcome = {}
    try:
        _wait_listening(port, proc)
        with AggregatorClient([f"127.0.0.1:{port}"], RUN, "a", shard_wait_s=0) as client:
            client.join(PARAMS)
            client.push(0, 1.0, slice_tensors(client.assignment, _tensors(0)))
            channel = grpc.insecure_channel(f"127.0.0.1:{port}")

            def held_pull() -> None:  # waits for version 1, which never comes (nobody pushes round 1)
                try:
                    list(
                        pb_grpc.AggregatorStub(channel).Pull(
                            pb.PullRequest(run_id=RUN, cluster="a", min_version=1, wait_seconds=600), timeout=660
                        )
                    )
                except grpc.RpcError as error:
                    outcome["code"] = error.code()

            waiter = threading.Thread(target=held_pull)
            waiter.start()
            time.sleep(1.0)
            proc.terminate()
            proc.wait(timeout=60)
            waiter.join(timeout=60)
            channel.close()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and not waiter.is_alive(), proc.returncode
    assert outcome.get("code") == grpc.StatusCode.UNAVAILABLE  # retryable: a client tries the restarted shard
    assert checkpoint.load(checkpoint_path(tmp_path, 0))["snapshot"]["version"] == 0  # the final checkpoint


def test_restart_empty_push_is_refused(shard_set):
    shards = shard_set(1, RUN)
    with AggregatorClient(shards.addresses, RUN, "a", shard_wait_s=0) as client:
        client.join(PARAMS)
        client.push(0, 1.0, slice_tensors(client.assignment, _tensors(0)))
    stub = pb_grpc.AggregatorStub(grpc.insecure_channel(shards.addresses[0]))
    header = pb.PushMessage(header=pb.PushHeader(run_id=RUN, cluster="a", round=1, weight=1.0))
    with pytest.raises(grpc.RpcError) as refused:
        stub.Push(iter([header]), timeout=10)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "at least one slice" in refused.value.details()
    assert shards.shards[0].accumulator is None or not shards.shards[0].accumulator.contributions


def test_restart_keeps_the_traffic_counters(tmp_path):
    """bytes_in/bytes_out (and the Prometheus counters read from them) go on across a restart."""
    shard = _saved_checkpoint(tmp_path)
    shard.bytes_in, shard.bytes_out, shard.dropped_bytes = 1234, 5678, 90
    checkpoint.save(shard, tmp_path)
    restarted = Shard(0, 1, RUN)
    checkpoint.restore(restarted, checkpoint.load(checkpoint_path(tmp_path, 0)))
    status = restarted.status()
    assert (status["bytes_in"], status["bytes_out"], restarted.dropped_bytes) == (1234, 5678, 90)
