"""`dilocox bench shard`: MB/s of pseudo-gradients one shard decodes and applies, vs memory bandwidth.

For each uplink codec, clusters' pushes are encoded beforehand exactly as a cluster sends them (the
TensorCompressor, then zstd framing into TensorChunks); the timed part is what the shard does with them
after gRPC has delivered the messages: reassemble and decompress the chunks (`assemble_units`), vet and
record the slices (`Shard.commit_push`), and at the last cluster's push close the round: decode every
contribution, take the token-weighted mean and apply the outer Nesterov step. Throughput is counted in
dense fp32 pseudo-gradient bytes (clusters × the shard's elements × 4) per second, and in wire bytes.

The reference is measured in the same run and the same number of threads: a large tensor copy in torch
and in numpy (bytes read + written per second), the best of a few tries. The ratio says how close the
shard's Python + torch path gets to the memory bandwidth that bounds it.
"""

from __future__ import annotations

import argparse
import threading
import time

import numpy as np
import torch

from dilocox.bench.report import write_report
from dilocox.common.config.run import ModelConfig
from dilocox.common.wire.assignment import assign_slices, model_digest, slices_of_shard
from dilocox.common.wire.compression import CompressionConfig, TensorCompressor
from dilocox.common.wire.framing import EncodedSlice, encode_slice, frame_payload
from dilocox.common.wire.slice_assembly import assemble_units
from dilocox.server.shard import Shard
from dilocox.worker.models.build import model_param_specs

CODECS = {
    "fp32 (DiLoCo)": CompressionConfig(codec="fp32"),
    "int8": CompressionConfig(codec="int8"),
    "low-rank ≤8 int4 (DiLoCoX default)": CompressionConfig(),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--n-layer", type=int, default=4, help="layers of the synthetic GPT whose pseudo-gradients travel (default 4)"
    )
    parser.add_argument("--n-embd", type=int, default=512, help="its width (default 512: 12.9M parameters)")
    parser.add_argument("--clusters", type=int, default=2, help="clusters pushing each round (default 2)")
    parser.add_argument(
        "--shards", type=int, default=2, help="the model is split over this many shards; shard 0 is timed"
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="timed rounds per codec, after one warm-up round (default 3)"
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads, for the shard and the reference (default 1)"
    )
    parser.add_argument(
        "--reference-mb", type=int, default=256, help="size of the memory-bandwidth reference buffer (default 256 MB)"
    )


def memory_bandwidth(megabytes: int, tries: int = 5) -> dict[str, float]:
    """Copy bandwidth in MB/s (read + write), best of `tries`, for torch and numpy; and `torch_add`: an
    in-place add of two tensors, in MB/s of the two inputs (what a shard's decode + apply reads)."""
    n = megabytes * 1_000_000 // 4
    a, b = torch.rand(n), torch.empty(n)
    na, nb = a.numpy(), np.empty(n, dtype=np.float32)
    out = {}
    for name, copy in (("torch_copy", lambda: b.copy_(a)), ("numpy_copy", lambda: np.copyto(nb, na))):
        copy()
        best = min(_timed(copy) for _ in range(tries))
        out[name] = round(2 * 4 * n / best / 1e6, 1)
    a.add_(b)
    out["torch_add"] = round(2 * 4 * n / min(_timed(lambda: a.add_(b)) for _ in range(tries)) / 1e6, 1)
    return out


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


class StatusProbe:
    """Asks the shard its status back to back from another thread while a push closes a round; the
    longest answer is how long the close kept the shard's lock (joins, status and pulls of other
    versions wait that long)."""

    def __init__(self, shard: Shard) -> None:
        self.shard, self.longest_s = shard, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._probe, daemon=True)

    def _probe(self) -> None:
        while not self._stop.is_set():
            asked = time.perf_counter()
            self.shard.status()
            self.longest_s = max(self.longest_s, time.perf_counter() - asked)
            time.sleep(0.001)

    def __enter__(self) -> StatusProbe:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _encode_push(compressor: TensorCompressor | None, slices, deltas: dict) -> list:
    chunks = []
    for s in slices:
        tensor = deltas[s.key]
        if compressor is None:
            chunks += list(encode_slice(s.key, tensor))
        else:
            enc = compressor.compress(s.key, tensor)
            chunks += list(frame_payload(s.key, enc.payload, enc.codec, enc.dtype, tuple(tensor.shape)))
    return chunks


def measure_codec(specs, compress: CompressionConfig, args: argparse.Namespace) -> dict:
    shard = Shard(0, args.shards, "bench-shard", min_clusters=args.clusters)
    clusters = [f"cluster-{i}" for i in range(args.clusters)]
    for c in clusters:
        shard.join("bench-shard", c, model_digest(specs), specs)
    owned = slices_of_shard(assign_slices(specs, args.shards), 0)
    gen = torch.Generator().manual_seed(0)
    weights = {s.key: torch.randn(s.slice_shape, generator=gen) * 0.02 for s in owned}
    shard.commit_push(clusters[0], 0, 1.0, list(weights.items()))
    compressors = [
        TensorCompressor(compress, seed=i) if compress.codec != "fp32" else None for i in range(args.clusters)
    ]
    elements = sum(s.numel for s in owned)
    timed_s, wire, status_wait = 0.0, 0, 0.0
    for round_ in range(1, args.rounds + 2):
        pushes = []
        for compressor in compressors:
            # a pseudo-gradient with a low-rank core plus noise, as after H inner steps
            deltas = {}
            for s in owned:
                shape = s.slice_shape
                if len(shape) == 2:
                    core = torch.randn(shape[0], 8, generator=gen) @ torch.randn(8, shape[1], generator=gen)
                    deltas[s.key] = 1e-3 * core + 1e-4 * torch.randn(shape, generator=gen)
                else:
                    deltas[s.key] = 1e-4 * torch.randn(shape, generator=gen)
            pushes.append(_encode_push(compressor, owned, deltas))
        started = time.perf_counter()
        for cluster, chunks in zip(clusters, pushes):
            units = assemble_units(
                iter(chunks), lambda key, chunk: shard.vet_slice(key, chunk.codec, tuple(chunk.shape))
            )
            encoded = [
                EncodedSlice(u.key, u.meta.codec, u.meta.dtype, tuple(u.meta.shape), bytes(u.payload)) for u in units
            ]
            if cluster == clusters[-1]:  # this push closes the round: how long does a status call wait meanwhile?
                with StatusProbe(shard) as probe:
                    result = shard.commit_push(cluster, round_, 1000.0, encoded)
                if round_ > 1:
                    status_wait = max(status_wait, probe.longest_s)
            else:
                result = shard.commit_push(cluster, round_, 1000.0, encoded)
        elapsed = time.perf_counter() - started
        assert result.round_closed, "the round must close at the last cluster's push"
        if round_ > 1:  # round 1 is the warm-up
            timed_s += elapsed
            wire += sum(c.ByteSize() for chunks in pushes for c in chunks)
    dense = 4 * elements * args.clusters * args.rounds
    return {
        "elements": elements,
        "dense_MB": dense / 1e6,
        "wire_MB": wire / 1e6,
        "seconds": timed_s,
        "status_wait_s": status_wait,
        "dense_MB_per_s": dense / timed_s / 1e6,
        "wire_MB_per_s": wire / timed_s / 1e6,
    }


def run(args: argparse.Namespace, out_dir) -> str:
    torch.set_num_threads(args.threads)
    specs = model_param_specs(ModelConfig(n_layer=args.n_layer, n_embd=args.n_embd), 256)
    params = sum(int(np.prod(shape)) for _, shape in specs)
    reference = memory_bandwidth(args.reference_mb)
    best_reference = max(v for k, v in reference.items() if k.endswith("_copy"))
    rows = []
    for label, compress in CODECS.items():
        m = measure_codec(specs, compress, args)
        rows.append(
            {
                "codec": label,
                "shard_elements": m["elements"],
                "dense_MB_per_s": round(m["dense_MB_per_s"], 1),
                "wire_MB_per_s": round(m["wire_MB_per_s"], 1),
                "vs_memory_bandwidth": round(m["dense_MB_per_s"] / best_reference, 3),
                "round_close_s": round(m["seconds"] / args.rounds, 4),
                "status_wait_max_s": round(m["status_wait_s"], 4),
            }
        )
    notes = (
        f"Synthetic GPT ({args.n_layer} layers × {args.n_embd} wide, {params:,} parameters) split over {args.shards} "
        "shards; shard 0 "
        f"timed with {args.clusters} clusters, {args.rounds} rounds per codec after a warm-up, {args.threads} torch "
        "thread(s). "
        "Timed per round: reassembling + zstd-decompressing the pushed chunks, vetting and recording them, and "
        "closing the "
        "round (decode every contribution, weighted mean, outer Nesterov). `dense_MB_per_s`: fp32 pseudo-gradient "
        "bytes "
        "(clusters × elements × 4) per second; `wire_MB_per_s`: serialized chunk bytes per second. "
        "`status_wait_max_s`: the longest a status call from another thread waited while the last push closed a round "
        "(the time the close held the shard's lock; the step itself runs outside it).\n\n"
        f"Memory-bandwidth reference, same run, same threads (copy of {args.reference_mb} MB, read + write; add: its "
        "inputs; best of 5): "
        + ", ".join(f"{k} {v:,.0f} MB/s" for k, v in reference.items())
        + f". `vs_memory_bandwidth` = dense MB/s / {best_reference:,.0f} MB/s (the faster copy).\n"
    )
    meta = {"args": vars(args), "reference_MB_per_s": reference, "params": params}
    return write_report(
        out_dir, "shard", "Shard throughput: pseudo-gradients decoded and applied", rows, list(rows[0]), notes, meta
    )
