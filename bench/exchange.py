"""`dilocox bench exchange`: what a round's exchange costs in CPU, stage by stage, against its rooflines.

The WAN stopped being what a round waits for once pseudo-gradients went out ~100× compressed; the
exchange's own arithmetic took its place (docs/performance.md, "Paper-scale projection"). This bench
times each stage a cluster and a shard run per round, on the matrices of one transformer layer of a
preset (a Llama layer's q/k/v/o and MLP projections), in ns per parameter, and next to each stage the
reference that bounds it, measured in the same run and with the same threads:

| stage | what runs (the project's own functions) | reference |
| --- | --- | --- |
| pseudo-gradient | Δ = s − θ into the exchange buffer | a copy |
| compress + EF | `TensorCompressor.compress` (power iteration, QR, ordering, int4, the residual) | the two matmuls of
a rank-r power iteration |
| frame + zstd | `frame_payload` | — |
| vet | `codecs.vet` of a received payload | — |
| decode | `codecs.decode_lazy` into a buffer (the ordered product, bit-exact everywhere) | an add |
| replay | `aggregation.apply_round` of M contributions, as a cluster's replay runs it | an add |
| replay check | `replica_digest.state_digest` over weights and momentum, hashed as a cluster asks | sha256 of the same
bytes |
| shard vet | `codecs.vet` of M dense fp32 payloads, as a shard vets each push on arrival (the finiteness pass) | an
add |
| shard close | `apply_round` of M dense fp32 contributions in place, as a shard closes (vetted: views of their bytes)
| an add |

for 1 thread, 2 threads and all cores. Then the training thread's tokens/s with the exchange running
beside it, continuously, against the same training alone: the GIL and core contention figure
(bench/exchange_contention.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from collections.abc import Callable

import torch

from dilocox.bench.exchange_contention import FloorWork, training_beside_exchange
from dilocox.bench.report import write_report
from dilocox.common.wire import codecs
from dilocox.common.wire.aggregation import apply_round, decode_by_blocks
from dilocox.common.wire.compression import CompressionConfig, TensorCompressor
from dilocox.common.wire.framing import EncodedSlice, SliceKey, frame_payload
from dilocox.common.wire.outer_optimizer import OuterNesterov
from dilocox.common.wire.replica_digest import state_digest
from dilocox.worker.exchange.replay_check import ReplayCheck
from dilocox.worker.exchange.threads import exchange_thread_budget

STAGES = (
    "pseudo_gradient",
    "compress_ef",
    "frame_zstd",
    "vet",
    "decode",
    "replay",
    "replay_check",
    "shard_vet",
    "shard_close",
)
REFERENCE = {
    "pseudo_gradient": "copy",
    "compress_ef": "matmul",
    "decode": "add",
    "replay": "add",
    "replay_check": "sha256",
    "shard_vet": "add",
    "shard_close": "add",
}
# A cluster's per-round exchange: its own Δ and push, the M − 1 forwarded payloads it vets, the replay of
# the M contributions, and the replay check. The shard's vet and close are the shard's, not the cluster's.
CLUSTER_STAGES = ("pseudo_gradient", "compress_ef", "frame_zstd", "vet", "replay", "replay_check")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default="llama-1b",
        help="preset whose transformer layer gives the matrices (default llama-1b: "
        "2048×2048, 256×2048, 5632×2048, 2048×5632)",
    )
    parser.add_argument("--layers", type=int, default=1, help="layers of those matrices timed together (default 1)")
    parser.add_argument(
        "--clusters", type=int, default=2, help="contributions per round, M, in the replay and the close (default 2)"
    )
    parser.add_argument(
        "--threads", default="1,2,all", help="torch thread counts to time the stages with (default 1,2,all)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per stage; the best is kept (default 3)")
    parser.add_argument(
        "--pace-s",
        type=float,
        default=1.0,
        help="the paced figure runs one exchange round every this many seconds (default 1)",
    )
    parser.add_argument(
        "--train-seconds",
        type=float,
        default=20.0,
        help="seconds of training per side of the training-beside-exchange figure (default 20; 0 skips it)",
    )


def layer_shapes(model: str, layers: int = 1) -> dict[str, tuple[int, int]]:
    """The 2-D weights of `layers` transformer layers of a Llama-family preset, by name."""
    from dilocox.worker.models.spec import presets_dir

    config = json.loads((presets_dir() / f"{model}.json").read_text())
    hidden = config.get("hidden_size") or config["n_embd"]
    ffn = config.get("intermediate_size") or 4 * hidden
    heads = config.get("num_attention_heads") or config["n_head"]
    kv = (config.get("num_key_value_heads") or heads) * (hidden // heads)
    one = {
        "q_proj": (hidden, hidden),
        "k_proj": (kv, hidden),
        "v_proj": (kv, hidden),
        "o_proj": (hidden, hidden),
        "gate_proj": (ffn, hidden),
        "up_proj": (ffn, hidden),
        "down_proj": (hidden, ffn),
    }
    return {f"layers.{i}.{name}": shape for i in range(layers) for name, shape in one.items()}


def _best(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: first-touch page faults and lazy initialisation are not the stage's cost
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


class LayerExchange:
    """One layer's exchange state, as a cluster and a shard hold it: the start and local weights, a
    compressor with error feedback (after one round, so the residual is in play), the replica and the
    outer momentum, and M contributions of the round (the cluster's own and M − 1 others')."""

    def __init__(self, shapes: dict[str, tuple[int, int]], clusters: int, rank: int = 8, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.keys = [SliceKey(name, 0, shape[0]) for name, shape in shapes.items()]
        self.shapes = {k: shapes[k.name] for k in self.keys}
        self.params = sum(r * c for r, c in shapes.values())
        self.start = torch.randn(self.params, generator=g)
        self.local = self.start + 1e-3 * torch.randn(self.params, generator=g)
        self.work = torch.empty(self.params)
        self.config = CompressionConfig(rank_min=rank, rank_max=rank, adaptive_rank=False)
        self.compressors = [TensorCompressor(self.config, seed=seed + m, name=f"cluster-{m}") for m in range(clusters)]
        self.deltas = self._views(self.work)
        self._form_delta()
        # Round 1 of every cluster: the payloads of the round to replay, and a residual for the timed round.
        self.payloads = [
            {k: c.compress(k, self.deltas[k] * (1 + 0.1 * m)) for k in self.keys}
            for m, c in enumerate(self.compressors)
        ]
        self.replica = {k: torch.randn(self.shapes[k], generator=g) for k in self.keys}
        self.outer = OuterNesterov(lr=0.7, momentum=0.9)
        self.outer.buffers = {k: 1e-3 * torch.randn(self.shapes[k], generator=g) for k in self.keys}
        self.dense = [
            {k: codecs.encode("fp32", self.deltas[k] * (1 + 0.1 * m))[0] for k in self.keys} for m in range(clusters)
        ]
        self.shard_weights = {k: self.replica[k].clone() for k in self.keys}
        # The round's contributions as the wire delivered them (built once: reassembly is the push's cost).
        self.lowrank_slices = {
            k: [EncodedSlice(k, e.codec, e.dtype, e.shape, bytearray(e.payload)) for e in (p[k] for p in self.payloads)]
            for k in self.keys
        }
        # As the shard holds them: each vetted as its push arrived (`shard_vet`), so the close decodes views.
        self.dense_slices = {
            k: [EncodedSlice(k, "fp32", "float32", self.shapes[k], bytearray(d[k]), vetted=True) for d in self.dense]
            for k in self.keys
        }
        self.decoded = {k: torch.empty(self.shapes[k]) for k in self.keys}
        self.shard_outer = OuterNesterov(lr=0.7, momentum=0.9)
        self.shard_outer.buffers = {k: v.clone() for k, v in self.outer.buffers.items()}

    def _views(self, flat: torch.Tensor) -> dict[SliceKey, torch.Tensor]:
        views, offset = {}, 0
        for k in self.keys:
            rows, cols = self.shapes[k]
            views[k] = flat[offset : offset + rows * cols].view(rows, cols)
            offset += rows * cols
        return views

    # ------------------------------------------------------------------ stages
    def _form_delta(self) -> None:
        torch.sub(self.start, self.local, out=self.work)

    def _compress(self) -> None:
        for k in self.keys:
            self.compressors[0].compress(k, self.deltas[k])

    def _frame(self) -> None:
        for k in self.keys:
            enc = self.payloads[0][k]
            for _ in frame_payload(k, enc.payload, enc.codec, enc.dtype, enc.shape):
                pass

    def _vet(self) -> None:
        for k in self.keys:
            enc = self.payloads[1 % len(self.payloads)][k]
            codecs.vet(enc.codec, bytearray(enc.payload), enc.dtype, enc.shape)

    def _decode(self) -> None:
        """A received payload to its values, into memory the receiver already holds (the replay and the
        close build it block by block into scratch; a new tensor would add its first-touch page faults)."""
        for k in self.keys:
            enc = self.payloads[0][k]
            codecs.decode_lazy(enc.codec, bytearray(enc.payload), enc.dtype, enc.shape).rows_into(
                0, enc.shape[0], self.decoded[k]
            )

    def _contributions(self, k: SliceKey, dense: bool = False) -> tuple[list, list[str]]:
        """The round's M contributions to slice `k` as `apply_round` takes them from the wire's slices."""
        slices = self.dense_slices[k] if dense else self.lowrank_slices[k]
        return [(f"cluster-{m}", 1000.0 + m, s.decode_lazy) for m, s in enumerate(slices)], [s.codec for s in slices]

    def _replay(self) -> None:
        for k in self.keys:  # as worker/exchange/replay.apply_pull
            items, names = self._contributions(k)
            self.replica[k] = apply_round(
                items, self.outer, k, self.replica[k], in_place=True, decode_together=decode_by_blocks(names)
            )

    def _replay_check(self) -> None:
        state_digest(self.keys, self.replica, self.outer.buffers, ReplayCheck().digest)

    def _shard_vet(self) -> None:
        for k in self.keys:  # as server/serving/servicer.py's assembly vets each pushed slice (codecs.vet)
            for s in self.dense_slices[k]:
                codecs.vet(s.codec, s.payload, s.dtype, s.shape)

    def _shard_close(self) -> None:
        for (
            k
        ) in self.keys:  # as server/rounds/round_state.py closes a dense fp32 round with no pull holding the version
            items, names = self._contributions(k, dense=True)
            apply_round(
                items,
                self.shard_outer,
                k,
                self.shard_weights[k],
                in_place=True,
                decode_together=decode_by_blocks(names),
            )

    def stage(self, name: str) -> Callable[[], None]:
        return {
            "pseudo_gradient": self._form_delta,
            "compress_ef": self._compress,
            "frame_zstd": self._frame,
            "vet": self._vet,
            "decode": self._decode,
            "replay": self._replay,
            "replay_check": self._replay_check,
            "shard_vet": self._shard_vet,
            "shard_close": self._shard_close,
        }[name]

    def round_of_cluster(self) -> None:
        """One cluster's whole per-round exchange, in order (what runs beside training)."""
        for name in CLUSTER_STAGES:
            self.stage(name)()

    # ------------------------------------------------------------------ references
    def references(self) -> dict[str, Callable[[], None]]:
        qs = {k: torch.randn(self.shapes[k][1], self.config.rank_max) for k in self.keys}
        ps = {k: torch.randn(self.shapes[k][0], self.config.rank_max) for k in self.keys}
        other, out = torch.randn(self.params), torch.empty(self.params)
        digest_bytes = [t.numpy().data for k in self.keys for t in (self.replica[k], self.outer.buffers[k])]

        def matmuls(thin_first: bool) -> Callable[[], None]:
            def run() -> None:
                for k in self.keys:
                    m = self.deltas[k]
                    if thin_first:
                        (qs[k].T @ m.T).T, (ps[k].T @ m).T
                    else:
                        m @ qs[k], m.T @ ps[k]

            return run

        def sha256() -> None:
            h = hashlib.sha256()
            for data in digest_bytes:
                h.update(data)
            h.digest()

        return {
            "copy": lambda: out.copy_(self.local),
            "add": lambda: out.add_(other),
            "matmul": matmuls(True),
            "matmul_plain": matmuls(False),
            "sha256": sha256,
        }


def time_stages(layer: LayerExchange, threads: int, repeats: int) -> list[dict]:
    torch.set_num_threads(threads)
    refs = {name: _best(fn, repeats) for name, fn in layer.references().items()}
    # The matmuls' reference is the faster of the two layouts of the same products (M Q, Mᵀ P written
    # plainly, or thin factor first): the roofline is what the hardware can do, not one library path.
    refs["matmul"] = min(refs["matmul"], refs.pop("matmul_plain"))
    rows = []
    for name in STAGES:
        seconds = _best(layer.stage(name), repeats)
        per = 1e9 * seconds / layer.params
        ref = REFERENCE.get(name)
        ref_ns = 1e9 * refs[ref] / layer.params if ref else None
        rows.append(
            {
                "threads": threads,
                "stage": name,
                "ns_per_param": round(per, 2),
                "reference": ref or "",
                "reference_ns": round(ref_ns, 2) if ref_ns else "",
                "x_reference": round(per / ref_ns, 2) if ref_ns else "",
            }
        )
    total = sum(r["ns_per_param"] for r in rows if r["stage"] in CLUSTER_STAGES)
    rows.append({"threads": threads, "stage": "cluster exchange (sum)", "ns_per_param": round(total, 2)})
    return rows


def run(args: argparse.Namespace, out_dir) -> str:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    counts = sorted({cores if t.strip() == "all" else int(t) for t in args.threads.split(",") if t.strip()})
    shapes = layer_shapes(args.model, args.layers)
    layer = LayerExchange(shapes, args.clusters)
    rows = [row for threads in counts for row in time_stages(layer, threads, args.repeats)]
    notes = [
        f"{args.model}, {args.layers} layer(s): {layer.params:,} parameters in {len(shapes)} matrices "
        f"({', '.join(sorted({f'{r}×{c}' for r, c in shapes.values()}))}); rank {layer.config.rank_max}, int4 factors, "
        f"error feedback; M = {args.clusters} contributions in the replay and the close; best of {args.repeats}; "
        f"{cores} cores."
    ]
    meta: dict = {"model": args.model, "params": layer.params, "cores": cores, "clusters": args.clusters}
    if args.train_seconds > 0:
        budget = exchange_thread_budget(0, training_threads=max(1, cores - 1))
        beside = training_beside_exchange(layer, args.train_seconds, max(1, cores - 1), budget)
        paced = training_beside_exchange(layer, args.train_seconds, max(1, cores - 1), budget, args.pace_s)
        floors = {
            kind: training_beside_exchange(FloorWork(kind, layer.params), args.train_seconds, max(1, cores - 1), budget)
            for kind in ("idle", "cache", "stream")
        }
        meta["training"] = {"exchange": beside, "paced": paced, **floors}
        notes.append(
            f"Training beside the exchange (the default GPT, {args.train_seconds:g} s a side, trainer on "
            f"{beside['train_threads']} thread(s), the exchange on {beside['exchange_threads']}, looping "
            f"{beside['exchange_rounds_meanwhile']} rounds without rest): {beside['tokens_per_s_with_exchange']:,} "
            f"tokens/s against {beside['tokens_per_s_alone']:,} alone, **{beside['share_kept']:.1%} kept**. The same "
            f"beside work that is not the exchange, same run: sleeping {floors['idle']['share_kept']:.1%}, an "
            f"in-cache add loop {floors['cache']['share_kept']:.1%}, a model-sized add streaming memory "
            f"{floors['stream']['share_kept']:.1%}. Training time lost per exchange round: "
            f"{beside['lost_s_per_round'] * 1000:.0f} ms. Paced at one exchange round every {args.pace_s:g} s "
            f"({paced['exchange_rounds_meanwhile']} rounds): **{paced['share_kept']:.1%} kept**."
        )
    columns = ["threads", "stage", "ns_per_param", "reference", "reference_ns", "x_reference"]
    return write_report(
        out_dir, "exchange", "Exchange cost per stage (ns per parameter)", rows, columns, "\n\n".join(notes), meta
    )
