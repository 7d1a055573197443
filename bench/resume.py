"""`dilocox bench resume`: what a site's restart costs over the WAN — the rounds it missed, replayed on
the replica its checkpoint holds, against pulling the weights and momentum in full.

Measured, not modelled: a real run in this process (`run_in_process`: gRPC shards on localhost, clusters
training the model on the bundled corpus, the default compressor) keeps the first cluster's replica after
every round as its checkpoint would (`AggregatorClient.replica_state`). Once the run is over, while the
shards still serve, a restarted client of that cluster is given the replica of k versions ago and pulls;
its gRPC bytes are counted, its replica is compared with a full pull's bit for bit, and a client with no
replica pulls in full for the comparison. The run ends without the end-of-run flush (`flush_codec none`),
so the rounds replayed are ordinary compressed rounds, as in the middle of a run.

The projection to the dense 107B model over 1 Gbit/s takes the exact bytes of one cluster's compressed
round at that size (`bench projection`'s `compressed_bytes`, the default compressor at its highest rank):
a site k rounds behind in a run of M sites downloads k × M of them (every site's contribution, its own
included: a restart kept no copy), against 8 bytes per parameter in full.
"""

from __future__ import annotations

import argparse
import math

import torch

from dilocox.bench.projection import MODELS, compressed_bytes, dense_107b
from dilocox.bench.report import write_report
from dilocox.common.config.run import CompressionConfig, InnerConfig, ModelConfig, RunConfig
from dilocox.worker.exchange.aggregator_client import AggregatorClient

COLUMNS = ["model", "params", "behind", "how", "bytes_down", "full_pull_bytes", "share_of_full", "replica_equal"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--models",
        default="gpt,llama-20m",
        help="models to run (default gpt,llama-20m: the default GPT and a Llama preset)",
    )
    parser.add_argument("--behind", default="1,2,5", help="versions behind to resume from (default 1,2,5)")
    parser.add_argument("--rounds", type=int, default=8, help="rounds of each run (default 8)")
    parser.add_argument("--inner-steps", type=int, default=2, help="inner steps per round (default 2)")
    parser.add_argument("--clusters", type=int, default=2, help="sites of each run (default 2)")
    parser.add_argument("--shards", type=int, default=2, help="shards of each run (default 2)")
    parser.add_argument(
        "--link-gbit", type=float, default=1.0, help="the WAN link of the projection, Gbit/s (default 1)"
    )
    parser.add_argument("--project-sites", default="2,8,20", help="sites of the 107B projection (default 2,8,20)")
    parser.add_argument("--away-models", default="llama-3-70b,dense-107b", help="models of the a-day-away projection")
    parser.add_argument(
        "--away-s",
        type=float,
        default=86_400.0,
        help="how long a site is away in that projection (default a day: the shards' --keep-rounds-s)",
    )
    parser.add_argument(
        "--round-s",
        type=float,
        default=1_000.0,
        help="one round's time in it (default 1,000 s: H = 100 inner steps of 10 s)",
    )


def _config(model: str, args: argparse.Namespace) -> RunConfig:
    return RunConfig(
        run_id=f"bench-resume-{model}",
        rounds=args.rounds,
        eval_batches=1,
        model=ModelConfig(model=model, block_size=64),
        inner=InnerConfig(steps=args.inner_steps, batch_size=4),
        compress=CompressionConfig(flush_codec="none"),
    )


def _param_specs(config: RunConfig) -> list[tuple[str, tuple[int, ...]]]:
    from dilocox.worker.models.build import build_model

    model = build_model(config.model, config.model.vocab_size, config.seed)
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


def _probe(
    addresses: list[str], config: RunConfig, cluster: str, params, replica: dict | None
) -> tuple[AggregatorClient, int]:  # noqa: ANN001
    """A restarted `cluster` (given `replica`, or none) that joins and pulls once; with the bytes it pulled."""
    client = AggregatorClient(addresses, config.run_id, cluster, config.wire, connect_timeout=30, rpc_timeout=120)
    names = [name for name, _ in params]
    if replica is not None:
        client.restore_replica(replica, names)
    client.join(params)
    return client, client.pull(0, names, wait_seconds=30)[2]


def _same(a: AggregatorClient, b: AggregatorClient) -> bool:
    assert a.outer is not None and b.outer is not None
    return (
        a.held.keys() == b.held.keys()
        and all(torch.equal(a.held[k], b.held[k]) for k in a.held)
        and all(torch.equal(a.outer.buffers[k], b.outer.buffers[k]) for k in b.outer.buffers)
    )


def measure(model: str, args: argparse.Namespace, behind: list[int]) -> list[dict]:
    from dilocox.sim.inprocess import run_in_process

    config = _config(model, args)
    params = _param_specs(config)
    names = [name for name, _ in params]
    first = "cluster-0"
    saved: dict[int, dict[str, bytes]] = {}  # version -> the first cluster's replica at it

    def keep_replica(client: AggregatorClient, _report) -> None:  # noqa: ANN001
        if client.cluster == first:
            state, versions = client.replica_state(names), set(client.held_versions.values())
            if len(versions) == 1:  # every shard at one version (the checkpoint of a boundary)
                saved[versions.pop()] = state

    rows: list[dict] = []

    def probe(addresses: list[str]) -> None:
        full, full_bytes = _probe(addresses, config, first, params, None)
        total = sum(p.numel() for p in full.held.values())
        try:
            for k in behind:
                version = config.rounds - k
                if version not in saved:
                    rows.append({"model": model, "behind": k, "how": "no replica kept at that version"})
                    continue
                resumed, got = _probe(addresses, config, first, params, saved[version])
                try:
                    kinds = {kind for kind, _, _ in resumed.pull_kinds.values()}
                    rows.append(
                        {
                            "model": model,
                            "params": total,
                            "behind": k,
                            "how": "delta" if kinds <= {"rounds", "current"} else "full",
                            "bytes_down": got,
                            "full_pull_bytes": full_bytes,
                            "share_of_full": round(got / full_bytes, 4),
                            "replica_equal": _same(resumed, full),
                        }
                    )
                finally:
                    resumed.close()
        finally:
            full.close()

    run_in_process(
        config,
        num_clusters=args.clusters,
        num_shards=args.shards,
        on_round=keep_replica,
        before_stop=probe,
        keep_rounds=max(behind) + 1,
    )
    return rows


def projection(args: argparse.Namespace, behind: list[int]) -> list[dict]:
    specs = dense_107b()
    params = sum(torch.Size(shape).numel() for _, shape in specs)
    round_bytes = compressed_bytes(specs, args.shards)
    full = 8 * params
    rows = []
    for sites in [int(s) for s in args.project_sites.split(",") if s.strip()]:
        for k in behind:
            delta = k * sites * round_bytes
            rows.append(
                {
                    "sites": sites,
                    "behind": k,
                    "delta_bytes": delta,
                    "full_bytes": full,
                    "delta_gb": round(delta / 1e9, 2),
                    "full_gb": round(full / 1e9, 1),
                    "share_of_full": round(delta / full, 4),
                    "delta_s": round(delta * 8 / (args.link_gbit * 1e9)),
                    "full_s": round(full * 8 / (args.link_gbit * 1e9)),
                }
            )
    return rows


def away_projection(args: argparse.Namespace) -> list[dict]:
    """A site back after `away_s`: the rounds it missed against the whole model, and what the shards keep on
    disk to serve them (server/state/rounds_on_disk.py): every site's compressed round of the window, over all
    shards."""
    rows = []
    missed = math.ceil(args.away_s / args.round_s)
    for name in [m.strip() for m in args.away_models.split(",") if m.strip()]:
        specs = MODELS[name]()
        params = sum(torch.Size(shape).numel() for _, shape in specs)
        round_bytes, full = compressed_bytes(specs, args.shards), 8 * params
        for sites in [int(s) for s in args.project_sites.split(",") if s.strip()]:
            delta = missed * sites * round_bytes
            rows.append(
                {
                    "model": name,
                    "sites": sites,
                    "away_s": args.away_s,
                    "rounds_missed": missed,
                    "delta_gb": round(delta / 1e9, 1),
                    "delta_s": round(delta * 8 / (args.link_gbit * 1e9)),
                    "full_gb": round(full / 1e9, 1),
                    "full_s": round(full * 8 / (args.link_gbit * 1e9)),
                    "kept_on_disk_gb": round(delta / 1e9, 1),
                    "delta_bytes": delta,
                    "full_bytes": full,
                }
            )
    return rows


def run(args: argparse.Namespace, out_dir) -> str:
    behind = sorted({int(k) for k in args.behind.split(",") if k.strip()})
    rows = [row for model in args.models.split(",") if model.strip() for row in measure(model.strip(), args, behind)]
    projected, away = projection(args, behind), away_projection(args)
    notes = (
        f"Measured: {args.clusters} sites × {args.shards} shards in this process over localhost gRPC, {args.rounds} "
        "rounds of "
        f"{args.inner_steps} inner steps, the default compressor; bytes at the gRPC message layer. `replica_equal`: "
        "the resumed replica (weights and outer momentum) equals a full pull's bit for bit.\n\n"
        f"## Projected: the dense 107B model over {args.link_gbit:g} Gbit/s\n\n"
        + _table(projected, ["sites", "behind", "delta_gb", "full_gb", "share_of_full", "delta_s", "full_s"])
        + "\n\nOne cluster's compressed round at 107B is exact (the default compressor at its highest rank); a site k "
        "rounds behind in a run of M sites replays k × M of them. Past the point where they outweigh the weights and "
        "momentum, the shards send those instead.\n\n"
        f"## Projected: a site back after {args.away_s:g} s, at {args.round_s:g} s a round, over {args.link_gbit:g} "
        "Gbit/s\n\n"
        + _table(
            away, ["model", "sites", "rounds_missed", "delta_gb", "delta_s", "full_gb", "full_s", "kept_on_disk_gb"]
        )
        + "\n\nThe shards keep every round of the window on disk (`--keep-rounds-s`, default a day; "
        "`kept_on_disk_gb`: over "
        "all shards, every site's compressed round), so the site replays them instead of pulling the model."
    )
    return write_report(
        out_dir,
        "resume",
        "What a restart pulls: the rounds missed against the whole model",
        rows,
        COLUMNS,
        notes=notes,
        meta={"args": vars(args), "projection": projected, "away": away},
    )


def _table(rows: list[dict], columns: list[str]) -> str:
    from dilocox.bench.report import markdown_table

    return markdown_table(rows, columns)
