"""`dilocox bench scale`: the aggregation service at real model sizes.

Real shard processes on localhost gRPC and real clients — the project's own `AggregatorClient`, its
compressor and its replay of the outer step — fed synthetic pseudo-gradients with the parameter list of
a real LLM preset (Llama / GPT-2 shapes, built on the meta device). No inner training: the figures are
the system's own cost. Per setting (model × clusters M × shards N × codec), per round after a warm-up:
bytes per cluster each way, push time (the compressor's share of it), the round's close on the shard
(first push → published), pull + replay + digest check, the shard's decode + apply throughput against a
memory-bandwidth reference measured in the same run, peak RSS of each shard against the fp32 bytes it
owns and of the client process, and a late joiner's full pull.

The clusters run as threads of this process (one Python process, so their peak RSS is reported
together). A *full* cluster holds what a real cluster's exchange holds: its copy of the global weights
and the outer momentum, the compressor's residuals (error feedback), and replays every round. Its
pseudo-gradient is made slice by slice as the push asks for it (a real cluster can form θ_global − θ_local
a slice at a time too), so the bench adds no model-sized tensor of its own. With `--full-clusters K`
only the first K clusters are full; the others *push only*: the same compressor without error feedback
(no residuals), no replica, no pulls — what lets 1B parameters and 4 clusters share one 24 GB machine
while the shards see M real contributions per round.

Shards checkpoint every round (the server's default) into a temporary folder, keeping one; after the
timed rounds shard 0 is restarted with `--resume` to time the restore.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import pathlib
import statistics
import tempfile
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import torch

from dilocox.bench.report import write_report
from dilocox.bench.scale_plots import write_scale_plots
from dilocox.bench.shard_throughput import memory_bandwidth
from dilocox.bench.wan_procs import ChildProcess, child_env, dilocox_cli, stop_all, wait_for_file
from dilocox.common.config.run import ModelConfig
from dilocox.common.wire.compression import CompressionConfig, TensorCompressor
from dilocox.worker.exchange.aggregator_client import AggregatorClient
from dilocox.worker.models.build import model_param_specs
from dilocox.worker.models.spec import resolve_model

RUN = "bench-scale"
CODECS = {"fp32": CompressionConfig(codec="fp32"), "default": CompressionConfig()}
QUICK = {"models": ["llama-20m"], "clusters": [2], "shards": [1, 2], "codecs": ["fp32", "default"], "rounds": 2}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--models", default="llama-20m,gpt2-small", help="model presets, comma-separated (default llama-20m,gpt2-small)"
    )
    parser.add_argument("--clusters", default="2,4", help="values of M, comma-separated (default 2,4)")
    parser.add_argument("--shards", default="1,2", help="values of N, comma-separated (default 1,2)")
    parser.add_argument("--codecs", default="fp32,default", help="fp32 and/or default compression (default both)")
    parser.add_argument(
        "--rounds", type=int, default=2, help="timed rounds per setting, after one warm-up round (default 2)"
    )
    parser.add_argument(
        "--full-clusters",
        type=int,
        default=0,
        help="clusters holding a full replica that replay every round (default 0: all); the others push only",
    )
    parser.add_argument(
        "--no-error-feedback",
        dest="error_feedback",
        action="store_false",
        help="no cluster keeps error-feedback residuals (4 bytes per parameter less per full cluster)",
    )
    parser.add_argument(
        "--plot-only",
        metavar="REPORTS",
        help="run nothing: draw the plots from these scale.json reports (comma-separated), merged",
    )
    parser.add_argument("--quick", action="store_true", help="a CI-sized sweep: llama-20m, M=2, N=1,2, both codecs")


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _param_specs(preset: str) -> list[tuple[str, tuple[int, ...]]]:
    spec = resolve_model(preset)
    vocab = int(spec.hf_config.get("vocab_size", 256)) if spec.hf_config else 256
    return model_param_specs(ModelConfig(model=preset), vocab)


def _peak_rss_mb(pid: int | str = "self") -> float:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / 1e6  # kB (KiB) → MB, as the owned bytes are counted
    return float("nan")


def _reset_peak_rss() -> None:
    try:
        pathlib.Path("/proc/self/clear_refs").write_text("5")  # Linux ≥ 4.0: VmHWM starts again from now
    except OSError:
        pass


def _synthetic(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A pseudo-gradient slice with a few strong directions (what low rank finds) plus noise."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g).mul_(1e-4)
    if len(shape) == 2:  # one slice-sized tensor: the bench's own memory should not show in the figures
        t.addmm_(torch.randn(shape[0], 4, generator=g), torch.randn(4, shape[1], generator=g), alpha=1e-3)
    return t


class _SyntheticDelta(Mapping):
    """A round's pseudo-gradient (or, `scale=0.02`, the initial weights), made slice by slice when the
    push reads it (never whole)."""

    def __init__(self, assignment, seed: int, scale: float | None = None) -> None:
        self._shapes = {s.key: s.slice_shape for s in assignment}
        self._order = {s.key: i for i, s in enumerate(assignment)}
        self._seed = seed
        self._scale = scale

    def __getitem__(self, key) -> torch.Tensor:  # noqa: ANN001 - a SliceKey
        seed = self._seed * 100_003 + self._order[key]
        if self._scale is not None:
            return torch.randn(self._shapes[key], generator=torch.Generator().manual_seed(seed)).mul_(self._scale)
        return _synthetic(self._shapes[key], seed)

    def __iter__(self):  # noqa: ANN204
        return iter(self._shapes)

    def __len__(self) -> int:
        return len(self._shapes)


class _TimedCompressor(TensorCompressor):
    """The default compressor, timing its own work (part of every push)."""

    seconds = 0.0

    def compress(self, key, delta, codec=None):  # noqa: ANN001, ANN201 - same signature as the parent
        started = time.perf_counter()
        try:
            return super().compress(key, delta, codec)
        finally:
            self.seconds += time.perf_counter() - started


def _shard(i: int, n: int, clusters: int, work: pathlib.Path, events: list, resume: bool = False) -> ChildProcess:
    def on_event(name: str, event: dict, _arrived: float) -> None:
        if event.get("event") in ("round_closed", "checkpoint_saved", "checkpoint_loaded"):
            events.append(event)

    port_file = work / f"shard-{i}.port"
    port_file.unlink(missing_ok=True)
    argv = dilocox_cli(
        "server",
        "--num-shards",
        str(n),
        "--shard-index",
        str(i),
        "--port",
        "0",
        "--port-file",
        str(port_file),
        "--run-id",
        RUN,
        "--min-clusters",
        str(clusters),
        "--round-deadline-s",
        "0",
        "--keep-serving",
        "--checkpoint-dir",
        str(work / "checkpoints"),
        "--checkpoint-keep",
        "1",
        "--insecure",
        "--log-format",
        "json",
        *(["--resume"] if resume else []),
    )
    return ChildProcess(
        f"shard-{i}", argv, work / f"shard-{i}{'-resumed' if resume else ''}.log", on_event, env=child_env(1)
    )


def _start_shards(n: int, clusters: int, work: pathlib.Path, events: list) -> tuple[list[ChildProcess], list[str]]:
    procs = [_shard(i, n, clusters, work, events) for i in range(n)]
    return procs, [f"127.0.0.1:{wait_for_file(work / f'shard-{i}.port', proc)}" for i, proc in enumerate(procs)]


def _time_restore(n: int, clusters: int, work: pathlib.Path, procs: list[ChildProcess], events: list) -> float | None:
    """Stop shard 0 (it checkpoints on SIGTERM) and start it again with --resume: the restore's seconds."""
    stop_all(procs[:1])
    procs[0] = _shard(0, n, clusters, work, events, resume=True)
    wait_for_file(work / "shard-0.port", procs[0])
    loaded = [e for e in events if e.get("event") == "checkpoint_loaded"]
    return loaded[-1]["seconds"] if loaded else None


def _three_figures(x: float) -> float:
    """`x` to 3 significant figures: whole MB/s read 0.0 for a tiny setting whose close was slow (a shared
    machine), a rate that `bench projection` then divides by."""
    return float(f"{x:.3g}")


def run_setting(
    preset: str,
    specs,
    clusters: int,
    shards: int,
    codec: str,
    rounds: int,
    reference: dict,
    full: int = 0,
    error_feedback: bool = True,
) -> dict:
    params = sum(torch.Size(s).numel() for _, s in specs)
    events: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="dilocox-scale-") as tmp:
        work = pathlib.Path(tmp)
        procs, addresses = _start_shards(shards, clusters, work, events)
        clients: list[AggregatorClient] = []
        try:
            _reset_peak_rss()
            full = full or clusters
            light = dataclasses.replace(CODECS[codec], error_feedback=False)  # push-only clusters keep no residuals
            own = CODECS[codec] if error_feedback else light
            compressors = [
                _TimedCompressor(own if i < full else light, seed=7) if codec != "fp32" else None
                for i in range(clusters)
            ]
            clients = [
                AggregatorClient(addresses, RUN, f"c{i}", compressor=compressors[i], rpc_timeout=1800)
                for i in range(clusters)
            ]
            for c in clients:
                c.join(specs)
            clients[0].push(0, 1.0, _SyntheticDelta(clients[0].assignment, 0, scale=0.02))
            pool = ThreadPoolExecutor(max_workers=clusters)
            list(pool.map(lambda c: c.pull(0, wait_seconds=600), clients[:full]))
            timings: list[dict] = []
            light_turn = threading.Lock()
            for round_ in range(1, rounds + 2):  # round 1 is the warm-up
                before = [
                    (c.traffic.bytes_up, c.traffic.bytes_down, comp.seconds if comp else 0.0)
                    for c, comp in zip(clients, compressors)
                ]

                def one(i: int) -> dict:
                    c = clients[i]
                    started = time.perf_counter()
                    # One push-only cluster at a time: their slices in flight are the bench's, not a cluster's.
                    with contextlib.nullcontext() if i < full else light_turn:
                        # noqa: B023 below: `one` runs on the pool within this round's iteration
                        c.push(round_, 1000.0, _SyntheticDelta(c.assignment, 1000 * round_ + i))  # noqa: B023
                    pushed = time.perf_counter()
                    if i < full:
                        c.pull(round_, wait_seconds=1800)  # noqa: B023
                    return {"push_s": pushed - started, "pull_s": time.perf_counter() - pushed if i < full else 0.0}

                per_cluster = list(pool.map(one, range(clusters)))
                if round_ == 1:
                    continue
                timings.append(
                    {
                        "up": sum(c.traffic.bytes_up - b[0] for c, b in zip(clients, before)) / clusters,
                        "down": sum(c.traffic.bytes_down - b[1] for c, b in zip(clients[:full], before)) / full,
                        "compress_s": sum(
                            (comp.seconds if comp else 0.0) - b[2] for comp, b in zip(compressors, before)
                        )
                        / clusters,
                        "push_s": max(t["push_s"] for t in per_cluster),
                        "pull_s": max(t["pull_s"] for t in per_cluster),
                    }
                )
            client_rss = _peak_rss_mb()
            for c in clients:  # their replicas go before the joiner builds its own
                c.close()
            clients = []
            joiner = AggregatorClient(addresses, RUN, "late-joiner", rpc_timeout=1800)
            clients.append(joiner)
            joiner.join(specs)
            started = time.perf_counter()
            joiner.pull(0, wait_seconds=600)
            joiner_s = time.perf_counter() - started
            shard_rss = [_peak_rss_mb(p.proc.pid) for p in procs]
            pool.shutdown()
            for c in clients:
                c.close()
            clients = []
            restore_s = _time_restore(shards, clusters, work, procs, events)
            checkpoint_mb = (work / "checkpoints" / "shard-0.pt").stat().st_size / 1e6
        finally:
            for c in clients:
                c.close()
            stop_all(procs)
    closes = [e for e in events if e.get("event") == "round_closed" and e.get("round", 0) >= 2]
    saves = [e["seconds"] for e in events if e.get("event") == "checkpoint_saved" and e.get("version", 0) >= 2]
    owned_mb = 4 * params / shards / 1e6
    # The median round: on a shared 2-core machine single closes vary 10x (page faults, the clients'
    # threads), the median is what a round usually costs.
    decode_apply = statistics.median([e["update_s"] for e in closes]) if closes else 0.0
    dense_mb = clusters * owned_mb  # what one shard decodes and applies per round, as dense fp32
    mean = {k: sum(t[k] for t in timings) / len(timings) for k in timings[0]}
    return {
        "model": preset,
        "params_M": round(params / 1e6, 1),
        "M": clusters,
        "full_M": full,
        "error_feedback": error_feedback and codec != "fp32",
        "N": shards,
        "codec": codec,
        "up_MB": round(mean["up"] / 1e6, 4),
        "down_MB": round(mean["down"] / 1e6, 4),
        "push_s": round(mean["push_s"], 3),
        "compress_s": round(mean["compress_s"], 3),
        "close_s": round(statistics.median([e["latency_s"] for e in closes]), 3) if closes else None,
        "pull_replay_s": round(mean["pull_s"], 3),
        "decode_apply_MB_s": _three_figures(dense_mb / decode_apply) if decode_apply else None,
        "vs_copy_bw": round(dense_mb / decode_apply / reference["torch_copy"], 3) if decode_apply else None,
        "vs_add": round(dense_mb / decode_apply / reference["torch_add"], 3) if decode_apply else None,
        "shard_rss_MB": round(max(shard_rss), 0),
        "shard_rss_vs_owned": round(max(shard_rss) / owned_mb, 1),
        "clients_rss_MB": round(client_rss, 0),
        "clients_rss_per_param_B": round(client_rss * 1e6 / clusters / params, 1),
        "joiner_full_pull_s": round(joiner_s, 3),
        "checkpoint_MB": round(checkpoint_mb, 1),
        "checkpoint_write_s": round(statistics.median(saves), 3) if saves else None,
        "checkpoint_restore_s": restore_s,
    }


def run(args: argparse.Namespace, out_dir) -> str:
    if args.plot_only:
        rows = [row for path in args.plot_only.split(",") for row in json.loads(pathlib.Path(path).read_text())["rows"]]
        names = write_scale_plots(pathlib.Path(out_dir), rows)
        return f"{len(rows)} rows from {args.plot_only}: " + (
            ", ".join(names) if names else "no plots (matplotlib missing?)"
        )
    torch.set_num_threads(1)
    if args.quick:
        models, ms, ns, codecs, rounds = (
            QUICK["models"],
            QUICK["clusters"],
            QUICK["shards"],
            QUICK["codecs"],
            QUICK["rounds"],
        )
    else:
        models, ms, ns = args.models.split(","), _ints(args.clusters), _ints(args.shards)
        codecs, rounds = args.codecs.split(","), args.rounds
    reference = memory_bandwidth(256)
    rows = []
    for preset in models:
        specs = _param_specs(preset)
        for codec in codecs:
            for m in ms:
                for n in ns:
                    rows.append(
                        run_setting(
                            preset,
                            specs,
                            m,
                            n,
                            codec,
                            rounds,
                            reference,
                            min(args.full_clusters, m),
                            args.error_feedback,
                        )
                    )
                    print(json.dumps(rows[-1]), flush=True)
    notes = (
        f"Synthetic pseudo-gradients with the presets' parameter lists; shards are real `dilocox server` processes "
        f"(1 torch thread each), the M clusters are threads of the bench process. Per round after a warm-up, "
        f"mean of {rounds}. `up_MB`/`down_MB`: per cluster per round (gRPC message bytes). `push_s`, `pull_replay_s`: "
        f"the slowest cluster (the pull waits for the round to close, then replays and checks it). `close_s`: "
        "the shard's first push → published (median round). `decode_apply_MB_s`: dense fp32 bytes (M × the shard's "
        "elements × 4) "
        "per second of the shard's decode + mean + outer step (median round); `vs_copy_bw`: against a torch copy "
        "measured in the "
        f"same run ({reference['torch_copy']:.0f} MB/s read + write); `vs_add`: against an in-place torch add "
        f"({reference['torch_add']:.0f} MB/s of its two inputs). `shard_rss_vs_owned`: peak RSS over the fp32 bytes "
        "the shard "
        f"owns. `clients_rss_MB`: peak RSS of the bench process holding all M clusters' exchange state.\n"
    )
    plots = write_scale_plots(pathlib.Path(out_dir), rows)
    notes += f"\nPlots: {', '.join(plots)}.\n" if plots else ""
    return write_report(
        out_dir, "scale", "The aggregation service at model size", rows, list(rows[0]), notes, {"args": vars(args)}
    )
