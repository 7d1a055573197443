"""Shard checkpoints: atomic save, exact restore, and a kill -9'd shard process resuming mid-run."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from dilocox.common.subprocesses import stop_gracefully
from dilocox.common.wire.assignment import model_digest
from dilocox.common.wire.outer_optimizer import OuterNesterov
from dilocox.server.shard import Shard
from dilocox.server.state import checkpoint
from dilocox.worker.exchange.aggregator_client import AggregatorClient
from dilocox.worker.exchange.cluster import slice_tensors
from tests.tiny_worker import stop_once_at, tiny_worker

RUN = "ckpt-run"
PARAMS = [("emb", (40, 8)), ("w", (8, 24)), ("b", (24,))]


def tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: 0.01 * torch.randn(s, generator=g) for n, s in PARAMS}


def slices(shard: Shard, full: dict[str, torch.Tensor]):
    return [(k, s.view(full[s.name]).clone()) for k, s in shard.owned.items()]


def test_restore_gives_the_same_shard_and_the_same_next_round(tmp_path):
    original = Shard(0, 1, RUN, 0.7, 0.9, min_clusters=2)
    for c in ("a", "b"):
        original.join(RUN, c, model_digest(PARAMS), PARAMS)
    original.commit_push("a", 0, 1.0, slices(original, {n: torch.randn(s) for n, s in PARAMS}))
    for r in (1, 2):
        original.commit_push("a", r, 3.0, slices(original, tensors(10 * r)))
        original.commit_push("b", r, 1.0, slices(original, tensors(10 * r + 1)))
    path = checkpoint.save(original, tmp_path)
    assert path.exists() and not list(tmp_path.glob("*.tmp"))  # renamed into place, no leftovers

    restored = Shard(0, 1, RUN, 0.7, 0.9, min_clusters=2)
    checkpoint.restore(restored, checkpoint.load(path))
    assert restored.version == 2 and sorted(restored.members) == ["a", "b"]
    for key in original.owned:
        assert torch.equal(restored.snapshot.tensors[key], original.snapshot.tensors[key])
        assert torch.equal(restored.optimizer.buffers[key], original.optimizer.buffers[key])
        assert restored.snapshot.contributions[key].keys() == original.snapshot.contributions[key].keys()
        for cluster, kept in original.snapshot.contributions[key].items():
            assert restored.snapshot.contributions[key][cluster].slice.payload == kept.slice.payload
    saved = checkpoint.load(path)["snapshot"]["contributions"]
    # Payloads are saved as uint8 tensors (written straight from memory, not pickled whole).
    assert all(
        isinstance(p[4], torch.Tensor) and p[4].dtype == torch.uint8 for per in saved.values() for p in per.values()
    )
    for shard in (original, restored):  # both take round 3 to the same place
        shard.commit_push("a", 3, 2.0, slices(shard, tensors(30)))
        shard.commit_push("b", 3, 2.0, slices(shard, tensors(31)))
    for key in original.owned:
        assert torch.equal(restored.snapshot.tensors[key], original.snapshot.tensors[key])

    other = Shard(1, 2, RUN)
    try:
        checkpoint.restore(other, checkpoint.load(path))
        raise AssertionError("a checkpoint of another shard must be refused")
    except ValueError as error:
        assert "shard_index" in str(error)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_shard(port: int, ckpt_dir, resume: bool) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "dilocox.common.cli",
        "server",
        "--port",
        str(port),
        "--run-id",
        RUN,
        "--outer-lr",
        "0.7",
        "--outer-momentum",
        "0.9",
        "--min-clusters",
        "2",
        "--round-deadline-s",
        "0",
        "--checkpoint-dir",
        str(ckpt_dir),
        "--log-format",
        "json",
        "--insecure",
        *(["--resume"] if resume else []),
    ]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def test_killed_shard_resumes_from_its_checkpoint(tmp_path):
    """Kill -9 a shard mid-round, restart with --resume: weights equal the
    checkpoint exactly, the interrupted round is applied exactly once after the clients re-push. The waits
    bound failures only (a pull returns once its version is out): a loaded machine once ran past 10 s."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    shard_proc = start_shard(port, tmp_path, resume=False)
    a = AggregatorClient([address], RUN, "a", connect_timeout=30, rpc_timeout=120, shard_wait_s=60)
    b = AggregatorClient([address], RUN, "b", connect_timeout=30, rpc_timeout=120, shard_wait_s=60)
    observer = AggregatorClient([address], RUN, "observer", connect_timeout=30, rpc_timeout=120, shard_wait_s=60)
    try:
        a.join(PARAMS)
        b.join(PARAMS)
        a.push(0, 1.0, slice_tensors(a.assignment, {n: torch.randn(s) for n, s in PARAMS}))
        for c in (a, b):
            c.pull(0, wait_seconds=60)
        for r in (1, 2, 3):
            a.push(r, 3.0, slice_tensors(a.assignment, tensors(10 * r)))
            b.push(r, 1.0, slice_tensors(b.assignment, tensors(10 * r + 1)))
            for c in (a, b):
                assert c.pull(r, wait_seconds=60)[0] == r
        a.push(4, 3.0, slice_tensors(a.assignment, tensors(40)))  # round 4 is half-collected …
        shard_proc.send_signal(signal.SIGKILL)  # … when the shard dies
        shard_proc.wait(timeout=10)

        saved = checkpoint.load(checkpoint.checkpoint_path(tmp_path, 0))
        assert saved["snapshot"]["version"] == 3
        shard_proc = start_shard(port, tmp_path, resume=True)

        observer.join(PARAMS)  # a newcomer pulls the restarted shard's weights in full
        version, pulled, _ = observer.pull(0, wait_seconds=60)
        assert version == 3
        for key, tensor in pulled.items():  # exactly the checkpointed weights
            assert torch.equal(tensor, saved["snapshot"]["tensors"][(key.name, key.row_start, key.row_stop)])

        # Round 4 lost a's push with the crash; now it waits for all three members, who (re)push it.
        reference = OuterNesterov(0.7, 0.9)
        reference.buffers = {k: t.clone() for k, t in saved["snapshot"]["momentum"].items()}
        deltas = {"a": (3.0, tensors(40)), "b": (1.0, tensors(41)), "observer": (2.0, tensors(42))}
        clients = {"a": a, "b": b, "observer": observer}
        for name, client in clients.items():
            weight, delta = deltas[name]
            client.push(4, weight, slice_tensors(client.assignment, delta))
        version, final, _ = a.pull(4, wait_seconds=60)
        assert version == 4
        total = sum(w for w, _ in deltas.values())
        for s in a.assignment:
            k = (s.name, s.row_start, s.row_stop)
            grad = sum(w * s.view(d[s.name]) for w, d in deltas.values()) / total
            want = reference.step(k, saved["snapshot"]["tensors"][k], grad)
            torch.testing.assert_close(final[s.key], want, rtol=1e-6, atol=1e-7)  # applied once, not twice
    finally:
        for client in (a, b, observer):
            client.close()
        stop_gracefully(shard_proc, grace_s=10)


def test_communicator_repushes_a_round_the_shard_lost(shard_set):
    """A shard restarted from a checkpoint has forgotten the open round's pushes: the waiting client
    pushes the same bytes again and gets its result."""
    from dilocox.worker.exchange.communicator import Communicator

    shards = shard_set(1, RUN)
    shard = shards.shards[0]
    client = AggregatorClient(shards.addresses, RUN, "a", connect_timeout=10, rpc_timeout=30)
    try:
        client.join(PARAMS)
        client.push(0, 1.0, slice_tensors(client.assignment, {n: torch.randn(s) for n, s in PARAMS}))
        client.pull(0, wait_seconds=10)
        shard.min_clusters = 2  # hold round 1 open after a's push …
        comm = Communicator(client, repush_after_s=0.3)
        comm.submit(1, 5.0, slice_tensors(client.assignment, tensors(1)))
        deadline = time.monotonic() + 10
        while not (shard.accumulator and shard.accumulator.contributions) and time.monotonic() < deadline:
            time.sleep(0.02)
        with shard._cond:  # … and lose it, as a restart from the version-0 checkpoint would
            shard.accumulator = None
            shard.min_clusters = 1
        exchange, _ = comm.collect(timeout=20)
        assert exchange.version == 1 and shard.version == 1
        assert comm.close() == "idle"
    finally:
        client.close()


def test_worker_stops_and_resumes_its_local_state(shard_set, tmp_path):
    """A cluster stopped with SIGTERM and restarted with --resume carries on where it was:
    same round count, AdamW step and data position as an uninterrupted run."""
    shards = shard_set(1, RUN)
    shard = shards.shards[0]
    rounds, h = 24, 3  # enough rounds that the SIGTERM lands mid-run even on a starved CI core

    flags = ("--cluster", "solo", "--rounds", str(rounds), "--inner-steps", str(h), "--checkpoint-dir", str(tmp_path))
    stop_once_at(tiny_worker(shards.addresses, RUN, *flags), shard, 3)
    stopped_at = shard.version
    assert 3 <= stopped_at < rounds
    second = tiny_worker(shards.addresses, RUN, *flags, "--resume")
    try:
        _, second_log = second.communicate(timeout=180)
    finally:
        if second.poll() is None:
            second.kill()
    assert second.returncode == 0, second_log[-3000:]
    assert shard.version == rounds + 1  # the rounds, then the end-of-run flush of the residuals
    events = {
        e["event"]: e for e in map(json.loads, filter(lambda line: line.startswith("{"), second_log.splitlines()))
    }
    restored, joined_at = events["worker_checkpoint_restored"]["round"], events["cluster_started"]["version"]
    # The loss watch's best eval comes back with the checkpoint (a restart no longer forgets it).
    assert 0 < events["worker_checkpoint_restored"]["eval_best"] < 10, events["worker_checkpoint_restored"]
    # The checkpoint held the replica, so the resume pulled only the rounds since it, checked by
    # the shard's state digest (a mismatch would have been a full pull, said as such).
    resumed = events["replica_resumed"]
    assert resumed["how"] == "delta" and resumed["reason"] == "", resumed
    assert 1 <= resumed["rounds_replayed"] <= 3 and resumed["bytes_down"] < resumed["full_pull_bytes"] / 4, resumed
    assert "replay_mismatch" not in events and "replica_resync" not in events
    # A SIGTERM can land after the round's push reached the shard but before the worker recorded it: the
    # shard then holds that round (it is not trained again) while the checkpoint does not count it.
    assert joined_at - restored in (0, 1), (restored, joined_at)
    trained = (restored + rounds - joined_at) * h
    from dilocox.worker.checkpoint_restore import read_progress

    state = read_progress(tmp_path / "solo" / f"round-{rounds:06d}")
    assert state["round"] == rounds and state["committed"]
    assert state["step"] == trained  # no inner step repeated, none lost but that in-flight round's
    assert state["data"]["replica0"]["batches_drawn"] == trained


def test_killed_pp_dp_site_resumes_from_its_checkpoint(shard_set, tmp_path):
    """A pp=2 × dp=2 site killed outright (SIGKILL to its whole torchrun job) and started again with
    --resume continues from its newest committed checkpoint (written by torch.distributed.checkpoint,
    each rank its own part) and finishes the run; no committed round is trained twice."""
    from dilocox.worker.checkpoint_restore import read_progress

    run_id, rounds, h = "site-resume", 7, 2
    shards = shard_set(2, run_id)

    def site(*extra: str, log: pathlib.Path | None = None) -> subprocess.Popen:
        cmd = [
            sys.executable,
            "-m",
            "dilocox.common.cli",
            "worker",
            "--servers",
            ",".join(shards.addresses),
            "--run-id",
            run_id,
            "--cluster",
            "site",
            "--pp",
            "2",
            "--dp",
            "2",
            "--rounds",
            str(rounds),
            "--inner-steps",
            str(h),
            "--n-layer",
            "2",
            "--n-embd",
            "32",
            "--block-size",
            "32",
            "--inner-batch-size",
            "4",
            "--eval-batches",
            "1",
            "--threads",
            "1",
            "--insecure",
            "--checkpoint-dir",
            str(tmp_path),
            "--log-format",
            "json",
            *extra,
        ]
        err = log.open("w") if log is not None else subprocess.PIPE  # a full pipe nobody reads would stall the ranks
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, text=True, start_new_session=True)

    # The first run keeps its start on disk and writes its checkpoints from the live state (nothing
    # staged); the resume reads what it wrote and goes on with the defaults.
    first = site("--spill-dir", str(tmp_path / "spill"), "--checkpoint-staging", "sync", log=tmp_path / "first.log")
    try:
        deadline = time.monotonic() + 180
        while min(s.version for s in shards.shards) < 3 and time.monotonic() < deadline and first.poll() is None:
            time.sleep(0.05)
        assert min(s.version for s in shards.shards) >= 3, (
            "the site did not get going: " + (tmp_path / "first.log").read_text()[-3000:]
        )
        kill_tree(first.pid)  # torchrun starts its ranks in sessions of their own: kill every one
        first.wait(timeout=30)
        killed_at = min(s.version for s in shards.shards)
        assert killed_at < rounds
        second = site("--resume")
        _, log = second.communicate(timeout=240)
        (tmp_path / "resumed.log").write_text(log)
        assert second.returncode == 0, log[-4000:]
    finally:
        if first.poll() is None:
            kill_tree(first.pid)
    assert all(s.version == rounds + 1 for s in shards.shards)  # the rounds, then the flush
    events = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    restored = {e["rank"]: e["round"] for e in events if e["event"] == "worker_checkpoint_restored"}
    assert sorted(restored) == [0, 1, 2, 3] and len(set(restored.values())) == 1  # one checkpoint for the site
    started = {e["rank"]: e["version"] for e in events if e["event"] == "cluster_started"}
    assert len(set(started.values())) == 1  # the ranks agree on the round to go on from
    resumed_from, joined_at = restored[0], started[0]
    assert 1 <= resumed_from <= joined_at <= killed_at + 1
    # Every rank's replica came back with the checkpoint; each pulled only the rounds since
    replicas = {e["rank"]: e for e in events if e["event"] == "replica_resumed"}
    assert sorted(replicas) == [0, 1, 2, 3], replicas
    assert all(e["how"] == "delta" and e["bytes_down"] < e["full_pull_bytes"] / 2 for e in replicas.values()), replicas
    assert not [e for e in events if e["event"] in ("replay_mismatch", "replica_resync")]
    before = [json.loads(line) for line in (tmp_path / "first.log").read_text().splitlines() if line.startswith("{")]
    assert {e["staging"] for e in before if e["event"] == "worker_checkpoint_staged"} == {"sync"}
    assert sorted(e["rank"] for e in before if e["event"] == "exchange_spill") == [0, 1, 2, 3]
    assert not os.listdir(tmp_path / "spill")  # the killed ranks' spill files went with them
    final = read_progress(tmp_path / "site" / f"round-{rounds:06d}")
    assert final["committed"] and sorted(final["data"]) == ["replica0", "replica1"]
    assert final["step"] == (resumed_from + rounds - joined_at) * h  # no inner step of a committed round repeated


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every process below it, all found before any is killed."""
    import os

    from dilocox.bench.site_layouts import descendants

    for p in [pid, *descendants(pid)]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("delay_s", [0.0, 0.05, 0.3])
def test_sigterm_after_a_checkpoint_is_staged_commits_it_and_says_so(shard_set, tmp_path, delay_s):
    """A SIGTERM at several moments after `worker_checkpoint_staged` never loses the staged
    round: the worker logs the signal, leaves between steps, lets the round's exchange finish, and its
    checkpoint is COMMITTED when the process exits (or the log says why not)."""
    from dilocox.worker.checkpoint import COMMITTED

    shards = shard_set(1, RUN)
    cmd = [
        sys.executable,
        "-m",
        "dilocox.common.cli",
        "worker",
        "--servers",
        shards.addresses[0],
        "--run-id",
        RUN,
        "--cluster",
        "solo",
        "--rounds",
        "40",
        "--inner-steps",
        "3",
        "--n-layer",
        "1",
        "--n-embd",
        "32",
        "--block-size",
        "32",
        "--inner-batch-size",
        "4",
        "--eval-batches",
        "1",
        "--threads",
        "1",
        "--insecure",
        "--checkpoint-dir",
        str(tmp_path),
        "--log-format",
        "json",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 120
        staged = None
        while staged is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line, "the worker exited before staging a checkpoint: " + "".join(lines[-30:])
            lines.append(line)
            if '"worker_checkpoint_staged"' in line and json.loads(line)["round"] >= 3:
                staged = json.loads(line)["round"]
        assert staged is not None, "no checkpoint staged in time"
        time.sleep(delay_s)
        proc.send_signal(signal.SIGTERM)
        _, rest = proc.communicate(timeout=90)
        lines.append(rest)
    finally:
        if proc.poll() is None:
            proc.kill()
    log_text = "".join(lines)
    assert proc.returncode == 143, log_text[-3000:]
    events = [json.loads(line) for line in log_text.splitlines() if line.startswith("{")]
    stopping = [e for e in events if e["event"] == "worker_stopping"]
    assert len(stopping) == 1 and stopping[0]["signal"] == "SIGTERM", log_text[-3000:]
    # The round staged last before the stop (the log is read behind the worker: later rounds may have been staged).
    staged = [e["round"] for e in events[: events.index(stopping[0])] if e["event"] == "worker_checkpoint_staged"][-1]
    uncommitted = {e["round"] for e in events if e["event"] == "worker_checkpoint_uncommitted"}
    committed = (tmp_path / "solo" / f"round-{staged:06d}" / COMMITTED).exists()
    assert committed or staged in uncommitted, log_text[-3000:]
    # One shard, one site, the shard up throughout: the staged round's exchange completes, so it is committed.
    assert committed, log_text[-3000:]


def test_a_time_boxed_site_of_two_ranks_agrees_on_its_steps_and_on_a_sigterm(shard_set, tmp_path):
    """On a torchrun site (dp 2, gloo): its ranks end every time-boxed round on the
    same step, set by the clock, not the configured H; a SIGTERM to the job stops both ranks at the same
    step, and the checkpoint of the last pushed round is committed."""
    from dilocox.worker.checkpoint import COMMITTED

    run_id = "site-stop"
    shards = shard_set(1, run_id)
    cmd = [
        sys.executable,
        "-m",
        "dilocox.common.cli",
        "worker",
        "--servers",
        shards.addresses[0],
        "--run-id",
        run_id,
        "--cluster",
        "site",
        "--dp",
        "2",
        "--rounds",
        "40",
        "--inner-steps",
        "3",
        "--inner-round-time-s",
        "0.6",
        "--inner-max-steps",
        "400",
        "--n-layer",
        "1",
        "--n-embd",
        "32",
        "--block-size",
        "32",
        "--inner-batch-size",
        "4",
        "--eval-batches",
        "1",
        "--threads",
        "1",
        "--insecure",
        "--checkpoint-dir",
        str(tmp_path),
        "--log-format",
        "json",
    ]
    log_path = tmp_path / "site.log"
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=log_path.open("w"), text=True, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 180
        while shards.shards[0].version < 4 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert shards.shards[0].version >= 4, log_path.read_text()[-3000:]
        proc.send_signal(signal.SIGTERM)  # torchrun's agent passes it to both ranks
        proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
    text = log_path.read_text()
    assert proc.returncode == 143, text[-3000:]
    events = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    done: dict[int, dict[int, int]] = {}
    for e in events:
        if e["event"] == "round_done":
            done.setdefault(e["round"], {})[e["rank"]] = e["inner_steps"]
    assert len(done) >= 3 and all(
        sorted(per_rank) == [0, 1] and len(set(per_rank.values())) == 1 for per_rank in done.values()
    ), done
    assert any(steps[0] != 3 for steps in done.values()), done  # the clock's H, not the configured one
    stopping = {e["rank"]: (e["round"], e["steps_in_round"]) for e in events if e["event"] == "worker_stopping"}
    assert sorted(stopping) == [0, 1] and len(set(stopping.values())) == 1, stopping
    staged = [e["round"] for e in events if e["event"] == "worker_checkpoint_staged" and e["rank"] == 0]
    pushed_last = max(r for r in staged if r < stopping[0][0])
    assert (tmp_path / "site" / f"round-{pushed_last:06d}" / COMMITTED).exists(), text[-3000:]
