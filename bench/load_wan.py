"""`dilocox bench load --wan-mbit R`: many sites against 2 real shard processes, each site's push and pull
paced to a link of R Mbit/s, beside push streams that stall (issue 45).

At WAN pace a push is in transit for seconds (a 256 KB compressed push at 1 Mbit/s: 2 s per shard), so
hundreds are in flight at once — the load that starved the old shard's 32 work threads. Each site is a
raw gRPC client in a thread of this process: its push is framed as the real client frames it
(incompressible random values, `--push-kb` per shard) and sent a chunk at a time, sleeping so that the
stream's bytes keep to the link's rate; its pull reads the version's weights (an observer pull: the
weights alone) a chunk at a time at the same rate, so gRPC's flow control paces the shard's sending.
`--stalled N` push streams per shard send a header and one chunk and then nothing until the row ends.

The stalled site has joined, so round 1 waits for it until the shards' deadline (5 s) and closes without
it; that round is not timed. Per row, over the timed rounds: the median and worst round latency (the
round's first push sent → the last site's pull read), what the link alone takes (push + pull bytes at R), the median and worst `Status` latency polled from
both shards all along, the shards' CPU milliseconds per site and round, and the CPU seconds per round
of the shards and of the sites' clients (which share this machine's cores with the shards).
"""

from __future__ import annotations

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
from dilocox.common.wire.framing import EncodedSlice, frame_slices
from dilocox.proto import dilocox_pb2 as pb
from dilocox.proto import dilocox_pb2_grpc as pb_grpc
from dilocox.worker.exchange.aggregator_client import AggregatorClient

RUN = "bench-load-wan"
CHUNK_BYTES = 64 * 1024  # small chunks, so that pacing is smooth
STALLED_DEADLINE_S = 5.0  # the shards' --round-deadline-s: round 1 (untimed) closes without the stalled site
WIDTH = 256


class _Site:
    """One site: a raw stub per shard, its push framed per shard, pushed and pulled at `rate` bytes/s."""

    def __init__(self, name: str, addresses: list[str], client: AggregatorClient, rate: float, seed: int) -> None:
        self.name, self.rate = name, rate
        self.channels = [grpc.insecure_channel(a, options=[("grpc.max_receive_message_length", 64 << 20)]) for a in addresses]
        self.stubs = [pb_grpc.AggregatorStub(c) for c in self.channels]
        g = torch.Generator().manual_seed(seed)
        by_shard: dict[int, list[EncodedSlice]] = {}
        for s in client.assignment:
            by_shard.setdefault(s.shard, []).append(EncodedSlice.exact(s.key, torch.randn(s.slice_shape, generator=g) * 1e-3))
        self.chunks = {shard: list(frame_slices(items, client.slice_map.index, CHUNK_BYTES, 1)) for shard, items in by_shard.items()}

    def push(self, round_: int) -> None:
        def one(shard: int) -> None:
            chunks = self.chunks[shard]

            def messages():
                yield pb.PushMessage(header=pb.PushHeader(run_id=RUN, cluster=self.name, round=round_, weight=1.0, chunks=len(chunks)))
                for chunk in chunks:
                    time.sleep(chunk.ByteSize() / self.rate)
                    yield pb.PushMessage(chunk=chunk)

            self.stubs[shard].Push(messages(), timeout=600)

        threads = [threading.Thread(target=one, args=(shard,)) for shard in self.chunks]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def pull(self, version: int) -> None:
        def one(stub: pb_grpc.AggregatorStub) -> None:
            request = pb.PullRequest(run_id=RUN, cluster=self.name, min_version=version, wait_seconds=600, observer=True)
            for chunk in stub.Pull(request, timeout=900):
                time.sleep(chunk.ByteSize() / self.rate)

        threads = [threading.Thread(target=one, args=(stub,)) for stub in self.stubs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def close(self) -> None:
        for c in self.channels:
            c.close()


def _stall(addresses: list[str], client: AggregatorClient, per_shard: int, release: threading.Event) -> tuple[_Site, list[threading.Thread]]:
    """`per_shard` push streams to each shard from a joined site that send a header and a chunk, then nothing
    until `release` (the site, to close, and the streams' threads)."""
    site = _Site("stalled", addresses, client, rate=1e12, seed=1)

    def one(shard: int) -> None:
        def messages():
            yield pb.PushMessage(header=pb.PushHeader(run_id=RUN, cluster="stalled", round=1, weight=1.0, chunks=len(site.chunks[shard])))
            yield pb.PushMessage(chunk=site.chunks[shard][0])
            release.wait(3600)

        try:
            site.stubs[shard].Push(messages(), timeout=3600)
        except grpc.RpcError:
            pass  # refused after the shard's idle timeout, or cancelled at the row's end

    threads = [threading.Thread(target=one, args=(shard,), daemon=True) for shard in site.chunks for _ in range(per_shard)]
    for t in threads:
        t.start()
    return site, threads


def measure(sites: int, rounds: int, mbit: float, push_kb: int, stalled: int, pull_cache_mb: int | None = None) -> dict:
    rate = mbit * 1e6 / 8
    rows = max(1, push_kb * 1024 * 2 // (4 * WIDTH))  # two shards: each gets about push_kb of it
    params = [("w", (rows, WIDTH)), ("b", (WIDTH,))]
    release, status_s = threading.Event(), []
    # The stalled site is a member: round 1 waits for it until the deadline, then closes without it (a
    # warm-up, not timed); its streams stay open, stalled, through every timed round.
    server_flags = ("--round-deadline-s", str(STALLED_DEADLINE_S), *(("--pull-cache-mb", str(pull_cache_mb)) if pull_cache_mb is not None else ()))
    with tempfile.TemporaryDirectory(prefix="dilocox-load-wan-") as tmp, shard_processes(2, RUN, pathlib.Path(tmp), server_flags) as addresses:
        pids = [int(pid) for pid in shard_pids(addresses)]
        clients = [AggregatorClient(addresses, RUN, f"c{i}", connect_timeout=60, rpc_timeout=600) for i in range(sites)]
        stalled_client = AggregatorClient(addresses, RUN, "stalled", connect_timeout=60)
        pool = ThreadPoolExecutor(max_workers=sites)
        paced, stall_threads = [], []
        try:
            clients[0].join(params)
            list(pool.map(lambda c: c.join(params), clients[1:]))
            stalled_client.join(params)
            clients[0].push(0, 1.0, {s.key: torch.zeros(s.slice_shape) for s in clients[0].assignment})
            paced = [_Site(c.cluster, addresses, c, rate, seed=10 + i) for i, c in enumerate(clients)]
            timed = list(paced)
            push_bytes = max(sum(ch.ByteSize() for ch in chunks) for chunks in paced[0].chunks.values())
            if stalled:
                stall_site, stall_threads = _stall(addresses, stalled_client, stalled, release)
                paced.append(stall_site)
            polling = threading.Event()
            poller = threading.Thread(target=_poll_status, args=(addresses, polling, status_s), daemon=True)
            poller.start()
            latencies, cpu_before = [], None
            for round_ in range(1, rounds + 2):
                if round_ == 2:
                    cpu_before, load_before = [process_usage(p)[1] for p in pids], _own_cpu_s()
                started = time.perf_counter()
                list(pool.map(lambda s, r=round_: (s.push(r), s.pull(r)), timed))
                if round_ >= 2:
                    latencies.append(time.perf_counter() - started)
            usage, load_cpu = [process_usage(p) for p in pids], _own_cpu_s() - load_before
            polling.set()
            poller.join(timeout=10)
        finally:
            release.set()
            for t in stall_threads:
                t.join(timeout=30)
            pool.shutdown()
            for site in paced:
                site.close()
            for c in [*clients, stalled_client]:
                c.close()
    pull_bytes = rows * WIDTH * 4 // 2 + WIDTH * 4  # an observer pull: the weights, about half the model per shard
    cpu = sum(u[1] - b for u, b in zip(usage, cpu_before))
    return {"sites": sites, "mbit": mbit, "stalled_streams": 2 * stalled, "push_kb_per_shard": round(push_bytes / 1024), "pull_cache_mb": pull_cache_mb,
            "link_s": round((push_bytes + pull_bytes) / rate, 2), "round_latency_median_s": round(statistics.median(latencies), 2),
            "round_latency_max_s": round(max(latencies), 2), "status_median_s": round(statistics.median(status_s), 3) if status_s else None,
            "status_max_s": round(max(status_s), 3) if status_s else None, "status_calls": len(status_s),
            "shard_cpu_ms_per_site_round": round(1000 * cpu / (rounds * sites), 2),
            "cpu_s_per_round": f"{cpu / rounds:.1f} shards + {load_cpu / rounds:.1f} sites"}  # fmt: skip


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
