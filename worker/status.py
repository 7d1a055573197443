"""`dilocox status`: ask every shard what it is doing, as a table (or JSON lines for scripts).

An operator's first question during a run is "is every shard alive, on the same version, with every
site in the round, and is traffic flowing?", so each shard is one row with exactly that; a shard that
does not answer is a row too (state `unreachable`), and the exit status is 1 so scripts notice.
"""

from __future__ import annotations

import argparse
import json
import time

from dilocox.common.logs import configure_logging
from dilocox.common.security import TlsFiles, add_security_arguments, security_from_args
from dilocox.worker.exchange.aggregator_client import AggregatorClient, AggregatorError

COLUMNS = (
    "SHARD",
    "ADDRESS",
    "STATE",
    "VERSION",
    "ROUND",
    "CLUSTERS",
    "IN ROUND",
    "LAST ROUND",
    "CLOSED",
    "BYTES IN",
    "BYTES OUT",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--servers", required=True, help="comma-separated host:port of the shards")
    parser.add_argument(
        "--json", action="store_true", help="one JSON object per shard (one per line) instead of a table"
    )
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for each shard (default 10)")
    add_security_arguments(parser, "worker")


def shard_record(address: str, reply) -> dict:  # noqa: ANN001 - a StatusReply or an AggregatorError
    """One shard's state as plain JSON types (ints stay ints, unlike MessageToDict's int64 strings)."""
    if isinstance(reply, AggregatorError):
        return {"address": address, "state": "unreachable", "error": reply.code.name, "details": reply.details}
    return {
        "address": address,
        "state": reply.state or ("waiting" if reply.initialised else "uninitialised"),
        "run_id": reply.run_id,
        "shard_index": reply.shard_index,
        "num_shards": reply.num_shards,
        "version": reply.version,
        "open_round": reply.open_round,
        "clusters": list(reply.clusters),
        "contributed": list(reply.contributed),
        "min_clusters": reply.min_clusters,
        "num_elements": reply.num_elements,
        "initialised": reply.initialised,
        "last_round_seconds": reply.last_round_seconds,
        "last_round_closed_at": reply.last_round_closed_at,
        "bytes_in": reply.bytes_in,
        "bytes_out": reply.bytes_out,
        "final_version": reply.final_version if reply.final_version >= 0 else None,
        "replay_mismatches": reply.replay_mismatches,
        "checkpoint_failures": reply.checkpoint_failures,
        "checkpoint_failing_rounds": reply.checkpoint_failing_rounds,
        "checkpoint_error": reply.checkpoint_error,
        "sites": [
            {
                "cluster": s.cluster,
                "member": s.member,
                "rounds_made": s.rounds_made,
                "rounds_late": s.rounds_late,
                "last_round": s.last_round,
                "last_tokens": s.last_tokens,
                "inner_steps": s.inner_steps,
                "idle_s": s.idle_s,
                "rounds_flagged": s.rounds_flagged,
                "rounds_excluded": s.rounds_excluded,
                "rounds_clipped": s.rounds_clipped,
                "quarantined": s.quarantined,
                "last_flag": s.last_flag,
                "last_flag_round": s.last_flag_round,
            }
            for s in reply.sites
        ],
    }


SITE_COLUMNS = ("SITE", "IN RUN", "ROUNDS MADE", "LATE", "LAST ROUND", "TOKENS", "H", "IDLE", "UPDATE CHECK")


def site_rows(records: list[dict]) -> list[tuple[str, ...]]:
    """One row per site over all shards: a site is in the run where every shard has it, has made a round
    where every shard closed it with its part (the fewest over shards), and was late as often as the
    shard that saw it late most; tokens, H and idle are of its last round, as the shards report them."""
    by_site: dict[str, list[dict]] = {}
    for record in records:
        for site in record.get("sites", []):
            by_site.setdefault(site["cluster"], []).append(site)
    rows = []
    for name, seen in sorted(by_site.items()):
        last = max(seen, key=lambda s: s["last_round"])
        rows.append(
            (
                name,
                "yes" if all(s["member"] for s in seen) else "no",
                str(min(s["rounds_made"] for s in seen)),
                str(max(s["rounds_late"] for s in seen)),
                str(last["last_round"]) if last["last_round"] else "-",
                f"{last['last_tokens']:.0f}",
                str(last["inner_steps"]) if last["inner_steps"] else "-",
                f"{last['idle_s']:.1f}s" if last["inner_steps"] else "-",
                _check_cell(seen),
            )
        )
    return rows


def _check_cell(seen: list[dict]) -> str:
    """The shards' update check on a site (server/checks/update_check.py): ok, or flagged N× (the latest reason
    and round; the most any shard counted), quarantined where any shard holds it so."""
    flagged = max(s.get("rounds_flagged", 0) for s in seen)
    if not flagged:
        return "ok"
    latest = max(seen, key=lambda s: s.get("last_flag_round", 0))
    state = "quarantined" if any(s.get("quarantined") for s in seen) else "flagged"
    return f"{state}:{flagged}x:{latest.get('last_flag', '')}@{latest.get('last_flag_round', 0)}"


def _aligned(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def table_row(record: dict, now: float) -> tuple[str, ...]:
    if record["state"] == "unreachable":
        return ("?", record["address"], "unreachable", *["-"] * (len(COLUMNS) - 3))
    closed_at = record["last_round_closed_at"]
    return (
        f"{record['shard_index']}/{record['num_shards']}",
        record["address"],
        record["state"],
        str(record["version"])
        if record["final_version"] is None
        else f"{record['version']}/{record['final_version']}",  # X of N
        str(record["open_round"]),
        f"{len(record['clusters'])} (min {record['min_clusters']})",
        f"{len(record['contributed'])}/{len(record['clusters'])}",
        f"{record['last_round_seconds']:.1f}s" if closed_at else "-",
        f"{max(0.0, now - closed_at):.0f}s ago" if closed_at else "-",
        human_bytes(record["bytes_in"]),
        human_bytes(record["bytes_out"]),
    )


def format_table(records: list[dict], now: float | None = None) -> str:
    now = time.time() if now is None else now
    lines = _aligned([COLUMNS, *(table_row(r, now) for r in records)])
    sites = site_rows(records)
    if sites:
        lines += ["", *_aligned([SITE_COLUMNS, *sites])]
    lines += [f"{r['address']}: {r['error']}: {r['details']}" for r in records if r["state"] == "unreachable"]
    runs = sorted({r["run_id"] for r in records if "run_id" in r})
    if len(runs) > 1:
        lines.append(f"warning: the shards serve different runs: {runs}")
    mismatched = [r for r in records if r.get("replay_mismatches")]
    if mismatched:
        lines.append(
            "replay mismatches (clusters whose replay of the outer step differed, then pulled in full): "
            + ", ".join(f"shard {r['shard_index']}: {r['replay_mismatches']}" for r in mismatched)
        )
    for r in records:
        if r.get("checkpoint_failing_rounds"):
            lines.append(
                f"warning: shard {r['shard_index']} ({r['address']}) could not save its checkpoint for the last "
                f"{r['checkpoint_failing_rounds']} version(s): {r['checkpoint_error']} — it serves on; a restart now "
                "would resume from an older version (free space or fix the --checkpoint-dir)"
            )
    if records and all(r["state"] == "finished" for r in records):
        lines.append(
            f"run {runs[0]} finished at version {records[0]['version']}: get its model with "
            "`dilocox export --servers <these shards> --run-id <run> --out DIR`"
        )
    return "\n".join(lines)


def shards_of(args: argparse.Namespace, command: str) -> tuple[list[str], TlsFiles | None, str | None]:
    """An operator command's shards (`--servers`) and how to reach them (TLS files, run token): a usage
    error naming `command` (`dilocox status`, `dilocox readmit`) where either is wrong."""
    addresses = [a.strip() for a in args.servers.split(",") if a.strip()]
    if not addresses:
        raise SystemExit(f"{command}: --servers names no shard")
    try:
        tls, token = security_from_args(args, "worker")
    except ValueError as error:
        raise SystemExit(f"{command}: {error}") from None
    return addresses, tls, token


def run(args: argparse.Namespace) -> int:
    configure_logging("kv", "warning")  # stdout carries only the table / JSON; warnings go to stderr
    addresses, tls, token = shards_of(args, "dilocox status")
    with AggregatorClient(addresses, run_id="", cluster="status", tls=tls, token=token, shard_wait_s=0) as client:
        records = [shard_record(a, reply) for a, reply in zip(addresses, client.status_each(timeout=args.timeout))]
    if args.json:
        for record in records:
            print(json.dumps(record))
    else:
        print(format_table(records))
    return 1 if any(r["state"] == "unreachable" for r in records) else 0
