"""`dilocox bench load --wan-mbit R`: many sites against real shard processes (2; `--shards`), each site's push and pull
paced to a link of R Mbit/s, beside push streams that stall.

At WAN pace a push is in transit for seconds (a 256 KB compressed push at 1 Mbit/s: 2 s per shard), so
hundreds are in flight at once — the load that starved the old shard's 32 work threads. Each site is a raw
grpc.aio client, a coroutine on one event loop of this process: its push is framed as the real client frames
it (incompressible random values, `--push-kb` per shard, in its 2 MB chunks) and sent a message at a time,
each after its time on the link (a message reaches the shard whole, when its last byte has crossed); its pull
reads the version's weights (an observer pull: the weights alone) a chunk at a time at the same rate, so
gRPC's flow control paces the shard's sending. `--stalled N` push streams per shard send a header and the
first of several 64 KB chunks, then nothing until the row ends.

The stalled site has joined, so round 1 waits for it until the shards' deadline (5 s) and closes without it;
that round is not timed. Per row, over the timed rounds: the median and worst round latency (the round's first
push sent → the last site's pull read), what the link alone takes (push + pull bytes at R), the median and
worst `Status` latency polled from every shard all along, one shard's CPU milliseconds per site and round, and
the CPU seconds per round of the shards and of the sites' clients (which share this machine's cores with the
shards).
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import resource
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch

from dilocox.bench.site_layouts import process_usage, shard_pids, shard_processes
from dilocox.common.collector import settle_collector
from dilocox.common.config.run import WireConfig
from dilocox.common.wire.framing import EncodedSlice, frame_slices, wire_bytes
from dilocox.proto import dilocox_pb2 as pb
from dilocox.proto import dilocox_pb2_grpc as pb_grpc
from dilocox.worker.exchange.aggregator_client import AggregatorClient

RUN = "bench-load-wan"
STALL_CHUNK_BYTES = 64 * 1024  # the stalled streams' chunks: several declared, one sent
STALLED_DEADLINE_S = 5.0  # the shards' --round-deadline-s: round 1 (untimed) closes without the stalled site
WIDTH = 256
SERVICE = "/dilocox.v1.Aggregator/"  # a site's raw calls: its push chunks pre-serialized, its pulls unparsed


class _Site:
    """One site: its push framed per shard, pushed and pulled at `rate` bytes/s over grpc.aio calls.

    Every site of a row is a coroutine on one event loop rather than threads of its own: 256 sites as
    ~1,000 threads of blocking gRPC calls spent more CPU than the shards they measure, all of it behind
    this process's one interpreter lock (the sites stand in for machines of their own). For the same
    reason a site's push chunks are serialized once, not at every send, and its pulls are read as bytes,
    not parsed: this process shares the machine's cores with the shards it measures."""

    def __init__(
        self, name: str, client: AggregatorClient, rate: float, seed: int, chunk_bytes: int = WireConfig.chunk_bytes
    ) -> None:
        self.name, self.rate = name, rate
        g = torch.Generator().manual_seed(seed)
        by_shard: dict[int, list[EncodedSlice]] = {}
        for s in client.assignment:
            by_shard.setdefault(s.shard, []).append(
                EncodedSlice.exact(s.key, torch.randn(s.slice_shape, generator=g) * 1e-3)
            )
        self.chunks = {
            shard: [
                (message := pb.PushMessage(chunk=c).SerializeToString(), len(message))
                for c in frame_slices(items, client.slice_map.index, chunk_bytes, 1)
            ]
            for shard, items in by_shard.items()
        }
        self.channels: list[grpc.aio.Channel] = []

    def open(self, addresses: list[str]) -> None:
        """(On the row's event loop.) A channel per shard."""
        self.channels = [
            grpc.aio.insecure_channel(a, options=[("grpc.max_receive_message_length", 64 << 20)]) for a in addresses
        ]
        self.pushes = [
            c.stream_unary(
                SERVICE + "Push", request_serializer=wire_bytes, response_deserializer=pb.PushReply.FromString
            )
            for c in self.channels
        ]
        self.pulls = [
            c.unary_stream(
                SERVICE + "Pull", request_serializer=pb.PullRequest.SerializeToString, response_deserializer=None
            )
            for c in self.channels
        ]

    def header(self, shard: int, round_: int) -> pb.PushMessage:
        return pb.PushMessage(
            header=pb.PushHeader(
                run_id=RUN, cluster=self.name, round=round_, weight=1.0, chunks=len(self.chunks[shard])
            )
        )

    async def push(self, round_: int) -> None:
        async def one(shard: int) -> None:
            async def messages():
                yield self.header(shard, round_)
                for message, size in self.chunks[shard]:
                    await asyncio.sleep(size / self.rate)
                    yield message

            await self.pushes[shard](messages(), timeout=600)

        await asyncio.gather(*(one(shard) for shard in self.chunks))

    async def pull(self, version: int) -> None:
        async def one(pull) -> None:  # noqa: ANN001
            request = pb.PullRequest(
                run_id=RUN, cluster=self.name, min_version=version, wait_seconds=600, observer=True
            )
            async for chunk in pull(request, timeout=900):  # a chunk's bytes, unparsed
                await asyncio.sleep(len(chunk) / self.rate)

        await asyncio.gather(*(one(pull) for pull in self.pulls))

    async def round(self, round_: int) -> None:
        await self.push(round_)
        await self.pull(round_)

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.channels))


async def _stall(site: _Site, per_shard: int, release: asyncio.Event) -> None:
    """`per_shard` push streams to each shard from a joined site that send a header and a chunk, then nothing
    until `release`."""

    async def one(shard: int) -> None:
        async def messages():
            yield site.header(shard, 1)
            yield site.chunks[shard][0][0]
            await release.wait()

        try:
            await site.pushes[shard](messages(), timeout=3600)
        except grpc.aio.AioRpcError:
            pass  # refused after the shard's idle timeout, or cancelled at the row's end

    await asyncio.gather(*(one(shard) for shard in site.chunks for _ in range(per_shard)))


async def _paced_rounds(
    addresses: list[str], paced: list[_Site], stalled: _Site | None, per_shard: int, rounds: int, pids: list[int]
) -> tuple[list[float], list[float], float]:
    """Rounds 1..rounds+1 of every paced site at once, beside the stalled streams; round 1 is not timed.
    Returns the timed rounds' latencies and the shards' and this process's CPU seconds before round 2."""
    everyone = [*paced, *([stalled] if stalled else [])]
    for site in everyone:
        site.open(addresses)
    release = asyncio.Event()
    stalling = asyncio.ensure_future(_stall(stalled, per_shard, release)) if stalled else None
    latencies, cpu_before, load_before = [], [], 0.0
    try:
        for round_ in range(1, rounds + 2):
            if round_ == 2:
                cpu_before, load_before = [process_usage(p)[1] for p in pids], _own_cpu_s()
            started = time.perf_counter()
            await asyncio.gather(*(site.round(round_) for site in paced))
            if round_ >= 2:
                latencies.append(time.perf_counter() - started)
    finally:
        release.set()
        if stalling is not None:
            await asyncio.wait_for(stalling, timeout=30)
        for site in everyone:
            await site.close()
    return latencies, cpu_before, load_before


def measure(
    sites: int,
    rounds: int,
    mbit: float,
    push_kb: int,
    stalled: int,
    pull_cache_mb: int | None = None,
    shards: int = 2,
    pin: bool = False,
) -> dict:
    """One row. `pin`: each shard process on a core of its own and the sites on the cores left (`pin_cores`)."""
    rate = mbit * 1e6 / 8
    rows = max(1, push_kb * 1024 * shards // (4 * WIDTH))  # each shard gets about push_kb of it
    params = [("w", (rows, WIDTH)), ("b", (WIDTH,))]
    status_s: list[float] = []
    # The stalled site is a member: round 1 waits for it until the deadline, then closes without it (a
    # warm-up, not timed); its streams stay open, stalled, through every timed round.
    server_flags = (
        "--round-deadline-s",
        str(STALLED_DEADLINE_S),
        *(("--pull-cache-mb", str(pull_cache_mb)) if pull_cache_mb is not None else ()),
    )
    with (
        tempfile.TemporaryDirectory(prefix="dilocox-load-wan-") as tmp,
        shard_processes(shards, RUN, pathlib.Path(tmp), server_flags) as addresses,
    ):
        pids = [int(pid) for pid in shard_pids(addresses)]
        clients = [AggregatorClient(addresses, RUN, f"c{i}", connect_timeout=60, rpc_timeout=600) for i in range(sites)]
        stalled_client = AggregatorClient(addresses, RUN, "stalled", connect_timeout=60)
        cores_before = None
        try:
            cores_before = pin_cores(pids) if pin else None
            clients[0].join(params)
            with ThreadPoolExecutor(max_workers=16) as pool:
                list(pool.map(lambda c: c.join(params), clients[1:]))
            stalled_client.join(params)
            clients[0].push(0, 1.0, {s.key: torch.zeros(s.slice_shape) for s in clients[0].assignment})
            paced = [_Site(c.cluster, c, rate, seed=10 + i) for i, c in enumerate(clients)]
            push_bytes = max(sum(size for _, size in chunks) for chunks in paced[0].chunks.values())
            stall_site = (
                _Site("stalled", stalled_client, rate=1e12, seed=1, chunk_bytes=STALL_CHUNK_BYTES) if stalled else None
            )
            polling = threading.Event()
            poller = threading.Thread(target=_poll_status, args=(addresses, polling, status_s), daemon=True)
            poller.start()
            settle_collector()  # the sites' client, like a shard: torch's objects out of its collections
            latencies, cpu_before, load_before = asyncio.run(
                _paced_rounds(addresses, paced, stall_site, stalled, rounds, pids)
            )
            usage, load_cpu = [process_usage(p) for p in pids], _own_cpu_s() - load_before
            polling.set()
            poller.join(timeout=10)
        finally:
            for c in [*clients, stalled_client]:
                c.close()
            if cores_before is not None:
                _set_cores(os.getpid(), cores_before)
    pull_bytes = (
        rows * WIDTH * 4 // shards + WIDTH * 4
    )  # an observer pull: the weights, about a shard's part of the model
    cpu = sum(u[1] - b for u, b in zip(usage, cpu_before))
    return {
        "sites": sites,
        "shards": shards,
        "mbit": mbit,
        "stalled_streams": shards * stalled,
        "push_kb_per_shard": round(push_bytes / 1024),
        "pull_cache_mb": pull_cache_mb,
        "link_s": round((push_bytes + pull_bytes) / rate, 2),
        "round_latency_median_s": round(statistics.median(latencies), 2),
        "round_latency_max_s": round(max(latencies), 2),
        "status_median_s": round(statistics.median(status_s), 3) if status_s else None,
        "status_max_s": round(max(status_s), 3) if status_s else None,
        "status_calls": len(status_s),
        "one_shard_cpu_ms_per_site_round": round(1000 * cpu / (rounds * sites * shards), 2),
        "pinned": pin,
        "cpu_s_per_round": f"{cpu / rounds:.1f} shards + {load_cpu / rounds:.1f} sites",
    }


def pin_cores(shard_pids: list[int]) -> set[int]:
    """Each shard process on a core of its own and this process (the simulated sites) on the cores left, as if
    the shards ran on machines of their own and the sites elsewhere: on a small machine the sites' clients
    otherwise take turns with the shards on every core. Threads started later inherit their starter's cores.
    Returns this process's cores before, to restore."""
    cores = pinnable_cores(len(shard_pids))
    for pid, core in zip(shard_pids, cores):
        _set_cores(pid, {core})
    _set_cores(os.getpid(), set(cores[len(shard_pids) :]))
    return set(cores)


def pinnable_cores(shards: int) -> list[int]:
    """This process's cores, if there is one per shard and one for the sites (ValueError if not)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) <= shards:
        raise ValueError(
            f"--pin needs a core per shard and one for the sites: {shards} shard(s), {len(cores)} core(s) here"
        )
    return cores


def _set_cores(pid: int, cores: set[int]) -> None:
    """Every thread of process `pid` on `cores` (the affinity call itself sets one thread's)."""
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cores)
        except ProcessLookupError:
            pass  # a thread that ended meanwhile


def _own_cpu_s() -> float:
    """CPU seconds of this process: the sites' clients, which share the machine with the shards."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _poll_status(addresses: list[str], stop: threading.Event, out: list[float]) -> None:
    channels = [grpc.insecure_channel(a) for a in addresses]
    stubs = [pb_grpc.AggregatorStub(c) for c in channels]
    try:
        while not stop.is_set():
            for stub in stubs:
                asked = time.perf_counter()
                try:
                    stub.Status(pb.StatusRequest(), timeout=30)
                    out.append(time.perf_counter() - asked)
                except grpc.RpcError:
                    out.append(float("inf"))
            stop.wait(0.25)
    finally:
        for c in channels:
            c.close()
