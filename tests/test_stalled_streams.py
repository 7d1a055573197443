"""Push streams that stall never take a shard down: 40 streams that send a header and a chunk and
then stay silent — their client alive — beside two honest sites. With the old servicer each held one of
the shard's 32 work threads, and nothing closed or answered until their client died."""

from __future__ import annotations

import statistics
import subprocess
import threading
import time

import grpc
import pytest
import torch

from dilocox.common.config.run import OuterConfig
from dilocox.common.wire.assignment import model_digest
from dilocox.common.wire.framing import EncodedSlice, frame_slices
from dilocox.proto import dilocox_pb2 as pb
from dilocox.proto import dilocox_pb2_grpc as pb_grpc
from dilocox.server.shard import Shard
from dilocox.worker.exchange.aggregator_client import AggregatorClient
from dilocox.worker.exchange.cluster import slice_tensors
from tests.ports import free_port
from tests.test_restart import PARAMS, RUN, _shard_cmd, _wait_listening

STALLED = 40
IDLE_TIMEOUT_S = 15.0
ROUNDS = 5


def _tensors(cluster: str, round_: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * round_ + ord(cluster))
    return {n: torch.randn(s, generator=g) for n, s in PARAMS}


def _stalled_push(stub: pb_grpc.AggregatorStub, chunk: pb.TensorChunk, release: threading.Event, outcome: list) -> None:
    def messages():
        yield pb.PushMessage(header=pb.PushHeader(run_id=RUN, cluster="stalled", round=1, weight=1.0, chunks=2))
        yield pb.PushMessage(chunk=chunk)
        release.wait(120)  # silent, the connection alive

    try:
        stub.Push(messages(), timeout=120)
        outcome.append(("accepted", ""))
    except grpc.RpcError as error:
        outcome.append((error.code().name, error.details()))


def test_forty_stalled_push_streams_beside_two_honest_sites(tmp_path):
    port = free_port()
    cmd = _shard_cmd(
        port,
        tmp_path / "ckpt",
        "--push-idle-timeout-s",
        str(IDLE_TIMEOUT_S),
        "--round-deadline-s",
        "3",
        "--log-format",
        "json",
    )
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    release, outcomes, stallers = threading.Event(), [], []
    try:
        _wait_listening(port, proc)
        stub = pb_grpc.AggregatorStub(channel)
        a = AggregatorClient([f"127.0.0.1:{port}"], RUN, "a", shard_wait_s=0)
        b = AggregatorClient([f"127.0.0.1:{port}"], RUN, "b", shard_wait_s=0)
        stalled = AggregatorClient([f"127.0.0.1:{port}"], RUN, "stalled", shard_wait_s=0)
        for client in (a, b, stalled):
            client.join(PARAMS)
        a.push(0, 1.0, slice_tensors(a.assignment, _tensors("a", 0)))  # the initial weights
        # A valid first chunk of the stalled cluster's round-1 push, then silence.
        items = [EncodedSlice.exact(key, t) for key, t in slice_tensors(stalled.assignment, _tensors("s", 1)).items()]
        chunk = next(iter(frame_slices(items, stalled.slice_map.index, 1 << 20, 1)))
        stallers = [
            threading.Thread(target=_stalled_push, args=(stub, chunk, release, outcomes)) for _ in range(STALLED)
        ]
        for t in stallers:
            t.start()
        time.sleep(1.0)  # every stalled stream is in, past its header

        status_s, versions = [], []
        for round_ in range(1, ROUNDS + 1):
            pushers = [
                threading.Thread(
                    target=c.push, args=(round_, 1.0, slice_tensors(c.assignment, _tensors(c.cluster, round_)))
                )
                for c in (a, b)
            ]
            for t in pushers:
                t.start()
            while any(t.is_alive() for t in pushers):
                asked = time.monotonic()
                reply = stub.Status(pb.StatusRequest(), timeout=10)
                status_s.append(time.monotonic() - asked)
                time.sleep(0.1)
            for t in pushers:
                t.join()
            versions.append(a.pull(round_, wait_seconds=30)[0])
        refused_meanwhile = len(outcomes)
        assert versions == list(range(1, ROUNDS + 1))  # every round closed ...
        assert refused_meanwhile == 0  # ... while every stalled stream was still open (none had timed out yet)
        # Status answered throughout (the old servicer's ran past their 10 s deadline): typically in
        # milliseconds; the median within a second, so that a busy machine's slow moment does not decide.
        assert statistics.median(status_s) < 1.0, status_s
        assert reply.version >= ROUNDS - 1

        for t in stallers:
            t.join(timeout=30)
        assert len(outcomes) == STALLED
        assert {code for code, _ in outcomes} == {"UNAVAILABLE"}, outcomes[:3]
        assert all(
            f"sent nothing for {IDLE_TIMEOUT_S:g}s after 1 of the 2 chunk messages" in details
            for _, details in outcomes
        )

        final = dict(a.pull(ROUNDS, wait_seconds=30)[1])
        for client in (a, b, stalled):
            client.close()
    finally:
        release.set()
        channel.close()
        proc.terminate()
        proc.wait(timeout=30)
    # The final weights are a replay of the honest pushes alone: nothing of the stalled streams was applied.
    outer = OuterConfig()  # the server's defaults
    replay = Shard(0, 1, RUN, outer_lr=outer.lr, outer_momentum=outer.momentum)
    for cluster in ("a", "b"):
        replay.join(RUN, cluster, model_digest(PARAMS), PARAMS, "{}")
    for round_ in range(ROUNDS + 1):
        for cluster in ("a", "b") if round_ else ("a",):
            keys = slice_tensors(replay.assignment, _tensors(cluster, round_))
            replay.commit_push(cluster, round_, 1.0, [EncodedSlice.exact(k, t) for k, t in keys.items()])
    assert replay.version == ROUNDS
    assert final.keys() == replay.snapshot.tensors.keys()
    for key, tensor in replay.snapshot.tensors.items():
        assert torch.equal(final[key], tensor), key


def test_one_cluster_holds_at_most_its_share_of_push_streams():
    """A cluster identity past `--push-streams-per-cluster` streams at once is refused RESOURCE_EXHAUSTED
    (naming the flag), another cluster is not, and a slot frees when a stream ends (here: its idle timeout)."""
    from dilocox.server.serving.grpc_server import start_server
    from dilocox.server.serving.push_intake import PushLimits

    shard = Shard(0, 1, RUN)
    server, port = start_server(
        shard, "127.0.0.1", 0, push_limits=PushLimits(idle_timeout_s=2.0, streams_per_cluster=2)
    )
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    release, outcomes = threading.Event(), []
    try:
        for cluster in ("a", "stalled"):
            shard.join(RUN, cluster, model_digest(PARAMS), PARAMS, "{}")
        shard.commit_push(
            "a",
            0,
            1.0,
            [EncodedSlice.exact(k, t) for k, t in slice_tensors(shard.assignment, _tensors("a", 0)).items()],
        )
        stub = pb_grpc.AggregatorStub(channel)
        chunk = next(
            iter(
                frame_slices(
                    [EncodedSlice.exact(k, t) for k, t in slice_tensors(shard.assignment, _tensors("s", 0)).items()],
                    shard.slice_map.index,
                    1 << 20,
                    1,
                )
            )
        )
        held = [threading.Thread(target=_stalled_push, args=(stub, chunk, release, outcomes)) for _ in range(2)]
        for t in held:
            t.start()
        time.sleep(0.5)
        extra: list = []
        _stalled_push(stub, chunk, release, extra)  # a third at once: refused before it is read
        assert extra[0][0] == "RESOURCE_EXHAUSTED" and "--push-streams-per-cluster 2" in extra[0][1], extra
        for t in held:
            t.join(timeout=30)
        assert [code for code, _ in outcomes] == ["UNAVAILABLE", "UNAVAILABLE"]  # idle past 2 s: refused, slots freed
        again: list = []
        _stalled_push(stub, chunk, release, again)
        assert again[0][0] == "UNAVAILABLE"  # admitted (then idle): the slots were given back
    finally:
        release.set()
        channel.close()
        server.stop(grace=1.0).wait(10)


def test_health_is_not_serving_while_the_work_pool_is_starved():
    """Every work thread held (long tasks): the health service, which answers from the event loop, says
    NOT_SERVING once a task has waited `health_stall_s`, and SERVING again once the pool takes work; `Status`,
    on threads of its own, answers at once all along (behind a round's queued pushes it once waited for all)."""
    from dilocox.server.serving.grpc_server import start_server
    from dilocox.server.serving.health import check

    shard = Shard(0, 1, RUN)
    server, port = start_server(shard, "127.0.0.1", 0, max_workers=4, health_stall_s=1.0)
    release = threading.Event()
    try:
        address = f"127.0.0.1:{port}"
        assert check(address)[0]
        held = [server._pool.submit(release.wait, 60) for _ in range(4)]  # the pool's every thread, busy
        deadline = time.monotonic() + 10
        while check(address)[0] and time.monotonic() < deadline:
            time.sleep(0.2)
        serving, said = check(address)
        assert not serving and "NOT_SERVING" in said, said
        with grpc.insecure_channel(address) as channel:  # on the work pool it would wait out the held tasks (60 s)
            assert pb_grpc.AggregatorStub(channel).Status(pb.StatusRequest(), timeout=10).shard_index == 0
        release.set()
        for future in held:
            future.result(timeout=10)
        deadline = time.monotonic() + 10
        while not check(address)[0] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert check(address)[0]
    finally:
        release.set()
        server.stop(grace=1.0).wait(10)


def test_the_new_limits_refuse_nonsense_before_the_shard_listens(capsys):
    """Each limit's nonsense is refused with its flag's name before anything listens. One case runs as a real
    `dilocox server` process (its exit path: the ValueError becomes "dilocox server: …" and a failing status);
    the others take the same path in this process (tests/cli_refusal.py)."""
    import sys

    from tests.cli_refusal import refusal

    done = subprocess.run(
        [sys.executable, "-m", "dilocox.common.cli", "server", "--port", "0", "--insecure", "--health-stall-s", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0 and "--health-stall-s must be > 0" in done.stderr, done.stderr[-500:]
    for flag, message in (
        ("--push-idle-timeout-s", "--push-idle-timeout-s must be > 0"),
        ("--push-streams-per-cluster", "--push-streams-per-cluster must be ≥ 1"),
        ("--work-threads", "--work-threads must be ≥ 1"),
    ):
        status, err = refusal(capsys, ["server", "--port", "0", "--insecure", flag, "0"])
        assert status != 0 and message in err, (flag, err[-500:])


def test_a_pull_takes_its_small_chunks_from_the_pool_together_and_learns_its_end_in_the_same_hop():
    """One hop to the work pool per 256 KB of a pull, not one per chunk plus one for its end and one to close
    it (each hop wakes the event loop and a pool thread); a batch ends at the first chunk that reaches the
    limit, and the batch that runs out says so."""
    from dilocox.proto import dilocox_pb2 as pb
    from dilocox.server.serving.aio_servicer import PULL_BATCH_BYTES, _take_chunks

    sizes = [100 << 10, 100 << 10, 100 << 10, 10 << 10, 3 * PULL_BATCH_BYTES, 1 << 10]

    def sent(name: str, size: int) -> bytes:  # a pull's chunk as its stream yields it: its wire bytes
        return pb.TensorChunk(name=name, zstd_frame=bytes(size)).SerializeToString()

    def names(batch: list[bytes]) -> list[str]:
        return [pb.TensorChunk.FromString(c).name for c in batch]

    chunks = iter([sent(f"c{i}", n) for i, n in enumerate(sizes)])
    batches, ended = [], False
    while not ended:
        batch, ended = _take_chunks(chunks, PULL_BATCH_BYTES)
        batches.append(names(batch))
    assert batches == [["c0", "c1", "c2"], ["c3", "c4"], ["c5"]]
    small = iter([sent("only", 10)])
    assert [(names(b), e) for b, e in [_take_chunks(small, PULL_BATCH_BYTES)]] == [(["only"], True)]


def test_a_pull_cancelled_while_its_look_runs_gives_back_what_the_look_took():
    """A client gone while its pull's look runs on the pool: the look still ends holding a snapshot and its
    stream; they are given back when it does (a hold left behind would keep that version from ever being
    stepped in place), and the cancelled pull sees its cancellation."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from dilocox.server.serving.aio_servicer import AsyncAggregatorServicer

    released, closed, running, finish = [], [], threading.Event(), threading.Event()

    def stream():
        try:
            yield "chunk"
        finally:
            closed.append(True)

    chunks = stream()
    next(chunks)  # started, as a look's first batch leaves it

    def look():
        running.set()
        finish.wait(10)
        return "snapshot", chunks, (["chunk"], False)

    async def main() -> None:
        servicer = object.__new__(
            AsyncAggregatorServicer
        )  # only what `_looked` uses: the loop, the pool, the shard's release
        servicer.loop, servicer.pool = asyncio.get_running_loop(), ThreadPoolExecutor(1)
        servicer.shard = type("Shard", (), {"release": staticmethod(released.append)})()
        pull = asyncio.ensure_future(servicer._looked(look))
        await asyncio.get_running_loop().run_in_executor(None, running.wait, 10)
        pull.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pull
        assert released == []  # the look is still running
        finish.set()
        for _ in range(100):
            if released:
                break
            await asyncio.sleep(0.02)
        servicer.pool.shutdown()

    asyncio.run(main())
    assert released == ["snapshot"] and closed == [True]
