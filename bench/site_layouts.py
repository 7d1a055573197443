"""`dilocox bench train --layouts`: one site (a torchrun job of pp × dp ranks) against real shards.

Each layout runs the real thing: `dilocox server` processes and one `dilocox worker --pp P --dp D`, which
starts its own torchrun job. Measured from outside, so that any version of the worker can be compared
with the same yardstick: every rank's peak resident set (sampled from /proc, keyed by the rank torchrun
gave it), and from the worker's `round_done` lines the site's tokens/s over its compute time and the
seconds of each round boundary (the round's wall time minus its inner steps). Where the worker logs its
`boundary_done` phases and `exchange_memory` (this version does), they are reported too.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

# Host-memory settings compared in one run (`dilocox bench train --layout-variants`): the start in memory and
# checkpoints staged asynchronously (kept buffers), against the start on disk and checkpoints written from
# the live state (docs/decisions.md, "What does a rank hold for the exchange").
VARIANTS = {
    "memory": (),
    "checkpointed": ("--checkpoint-dir", "{work}/checkpoints"),
    "lean": ("--checkpoint-dir", "{work}/checkpoints", "--checkpoint-staging", "sync", "--spill-dir", "{work}/spill"),
}


@dataclass
class LayoutRun:
    pp: int
    dp: int
    dp_replicate: int = 1
    model_flags: tuple[str, ...] = ("--n-layer", "4", "--n-embd", "384", "--block-size", "128")
    rounds: int = 3
    inner_steps: int = 4
    batch_size: int = 8
    microbatches: int = 4
    shards: int = 2
    extra: tuple[str, ...] = ()  # more worker flags; "{work}" is this run's own folder
    variant: str = ""  # a name for `extra` in the rows (VARIANTS)
    events: list[dict] = field(default_factory=list)
    peak_rss_kb: dict[int, int] = field(default_factory=dict)  # rank -> peak RSS


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "dilocox.common.cli", *args]


def _rank_of(pid: int) -> int | None:
    try:
        env = pathlib.Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (torchrun starts its ranks in sessions of their own: no process group holds them)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            children = pathlib.Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        for c in children:
            found.append(int(c))
            todo.append(int(c))
    return found


def _hwm_kb(pid: int) -> int:
    try:
        for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _sample(proc: subprocess.Popen, run: LayoutRun, stop: threading.Event) -> None:
    """Peak RSS per rank: VmHWM of every descendant that torchrun gave a RANK, read until it exits."""
    while not stop.is_set():
        for pid in descendants(proc.pid) + [proc.pid]:
            rank = _rank_of(pid)
            if rank is None and pid == proc.pid and run.pp * run.dp == 1:
                rank = 0
            if rank is not None:
                run.peak_rss_kb[rank] = max(run.peak_rss_kb.get(rank, 0), _hwm_kb(pid))
        stop.wait(0.2)


@contextlib.contextmanager
def shard_processes(count: int, run_id: str, workdir: pathlib.Path, extra: tuple[str, ...] = ()) -> Iterator[list[str]]:
    """`count` real `dilocox server` processes on free localhost ports (`extra`: more server flags); yields
    their addresses."""
    shards, addresses = [], []
    try:
        for i in range(count):
            port_file = workdir / f"{run_id}-shard{i}.port"
            shards.append(
                subprocess.Popen(
                    _cli(
                        "server",
                        "--num-shards",
                        str(count),
                        "--shard-index",
                        str(i),
                        "--port",
                        "0",
                        "--port-file",
                        str(port_file),
                        "--run-id",
                        run_id,
                        "--insecure",
                        "--log-format",
                        "json",
                        *extra,
                    ),
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
            deadline = time.monotonic() + 60
            while not port_file.exists():
                if time.monotonic() > deadline or shards[-1].poll() is not None:
                    raise RuntimeError(f"shard {i} of {run_id} did not start")
                time.sleep(0.05)
            addresses.append(f"127.0.0.1:{port_file.read_text().strip()}")
        yield addresses
    finally:
        for shard in shards:
            shard.terminate()
        for shard in shards:
            try:
                shard.wait(timeout=30)
            except subprocess.TimeoutExpired:
                shard.kill()


def process_usage(pid: int) -> tuple[float, float]:
    """(RSS in MB, CPU seconds) of one process."""
    rss = next(
        (
            int(line.split()[1]) / 1024
            for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines()
            if line.startswith("VmRSS:")
        ),
        0.0,
    )
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return rss, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def shard_pids(addresses: list[str]) -> list[str]:
    """The shard processes listening on these ports (this benchmark's children)."""
    ports = {a.rsplit(":", 1)[1] for a in addresses}
    found = []
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"server" in cmd and b"--port-file" in cmd and entry.name != str(os.getpid()):
                port_file = pathlib.Path(cmd[cmd.index(b"--port-file") + 1].decode())
                if port_file.exists() and port_file.read_text().strip() in ports:
                    found.append(entry.name)
    return found


def run_worker(
    cmd: list[str],
    log_path: pathlib.Path,
    run: LayoutRun | None = None,
    timeout_s: float = 900.0,
    stop_after_round: int | None = None,
) -> tuple[int, list[dict]]:
    """Run one worker (a site), sampling its ranks' peak RSS into `run`; returns (exit code, its events).
    `stop_after_round`: SIGTERM the site once rank 0 has finished that round (to test a resume)."""
    with log_path.open("w") as log_file:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log_file)
        stop = threading.Event()
        sampler = threading.Thread(target=_sample, args=(proc, run, stop), daemon=True) if run is not None else None
        if sampler is not None:
            sampler.start()
        try:
            deadline = time.monotonic() + timeout_s
            while proc.poll() is None and time.monotonic() < deadline:
                if stop_after_round is not None and _finished_round(log_path, stop_after_round):
                    proc.send_signal(signal.SIGTERM)
                    stop_after_round = None
                time.sleep(0.2)
            if proc.poll() is None:
                proc.kill()
            rc = proc.wait()
        finally:
            stop.set()
            if sampler is not None:
                sampler.join(timeout=5)
    text = log_path.read_text()
    return rc, [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def _finished_round(log_path: pathlib.Path, round_: int) -> bool:
    for line in log_path.read_text().splitlines():
        if line.startswith("{") and '"round_done"' in line:
            event = json.loads(line)
            if event.get("round") == round_ and event.get("rank", 0) == 0:
                return True
    return False


def layout_flags(run: LayoutRun, device: str = "cpu") -> list[str]:
    layout = ["--pp", str(run.pp), "--dp", str(run.dp)]
    if run.dp_replicate > 1:
        layout += ["--dp-replicate", str(run.dp_replicate)]
    return [
        *layout,
        "--microbatches",
        str(run.microbatches),
        "--rounds",
        str(run.rounds),
        "--inner-steps",
        str(run.inner_steps),
        "--inner-batch-size",
        str(run.batch_size),
        "--eval-batches",
        "1",
        "--device",
        device,
        *run.model_flags,
        *run.extra,
    ]


def planned_device_mb(run: LayoutRun, device: str = "cpu") -> list[int]:
    """The memory plan's bytes per rank (worker/site/memory_plan.py, what `dilocox plan` prints) for the
    worker flags this layout runs with, in MB: what a GPU's `device_peak_mb_per_rank` is set against."""
    import argparse

    from dilocox.common.config.run_flags import add_config_arguments, config_from_args
    from dilocox.worker.site.memory_plan import plan_memory, planned_precision

    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    config, _ = parser.parse_known_args(layout_flags(run, device))
    config = planned_precision(config_from_args(config), on_gpu=device != "cpu")
    plan = plan_memory(config, config.model.vocab_size, fused_attention=device != "cpu")
    return [round(r.device_total / 2**20) for r in plan.ranks]


def run_layout(
    run: LayoutRun, workdir: pathlib.Path, threads: int = 1, timeout_s: float = 900.0, device: str = "cpu"
) -> LayoutRun:
    """Start the shards and one site of `run`'s layout, wait for the site to finish, collect its events."""
    run_id = f"layout-{run.pp}x{run.dp}x{run.dp_replicate}" + (f"-{run.variant}" if run.variant else "")
    own = workdir / run_id
    flags = [flag.replace("{work}", str(own)) for flag in layout_flags(run, device)]
    with shard_processes(run.shards, run_id, workdir) as addresses:
        cmd = _cli(
            "worker",
            "--servers",
            ",".join(addresses),
            "--run-id",
            run_id,
            "--insecure",
            "--log-format",
            "json",
            "--threads",
            str(threads),
            *flags,
        )
        log_path = workdir / f"{run_id}.log"
        rc, run.events = run_worker(cmd, log_path, run, timeout_s)
    if rc != 0:
        raise RuntimeError(f"worker {run_id} exited {rc}: {log_path.read_text()[-3000:]}")
    return run


def summarize(run: LayoutRun) -> dict:
    """One row: tokens/s of the site, boundary seconds, peak RSS per rank, exchange bytes per held parameter."""
    rounds = [e for e in run.events if e.get("event") == "round_done" and e.get("rank", 0) == 0]
    steady = rounds[1:] or rounds  # the first round pays one-off costs (pipeline shape inference, first compress)
    compute = sum(e["compute_s"] for e in steady)
    tokens = sum(e["tokens"] for e in steady)
    boundary = [e["seconds"] - e["compute_s"] for e in steady]
    held = {e.get("rank", 0): e["params_held"] for e in run.events if e.get("event") == "rank_share"}
    memory = {e.get("rank", 0): e for e in run.events if e.get("event") == "exchange_memory"}
    phases: dict[str, list[float]] = {}
    for e in run.events:
        if e.get("event") == "boundary_done" and e.get("rank", 0) == 0 and e.get("round", 0) > 1:
            for key, value in e.items():
                if key.endswith("_s"):
                    phases.setdefault(key, []).append(value)
    rss = [round(run.peak_rss_kb[r] / 1024) for r in sorted(run.peak_rss_kb)]
    row = {
        "layout": f"pp{run.pp}×dp{run.dp}"
        + (f" (replicate {run.dp_replicate})" if run.dp_replicate > 1 else "")
        + (f" {run.variant}" if run.variant else ""),
        "ranks": run.pp * run.dp,
        "tokens_per_s": round(tokens / compute) if compute else 0,
        "boundary_s": round(sum(boundary) / len(boundary), 3) if boundary else 0.0,
        "peak_rss_mb_per_rank": rss,
        "params_held_m": [round(held[r] / 1e6, 2) for r in sorted(held)],
    }
    device = {e.get("rank", 0): e["peak_allocated_mb"] for e in run.events if e.get("event") == "device_memory"}
    if device:
        row["device_peak_mb_per_rank"] = [device[r] for r in sorted(device)]
    row["replay_mismatches"] = sum(1 for e in run.events if e.get("event") == "replay_mismatch")
    if memory:
        row["exchange_bytes_per_held_param"] = [memory[r]["bytes_per_held_param"] for r in sorted(memory)]
        # Without the payloads of the last push (kept to replay the round: a few KB compressed).
        row["exchange_bytes_per_owned_param"] = [
            round(
                (memory[r]["total_bytes"] - memory[r].get("own_push_bytes", 0)) / max(1, memory[r]["params_owned"]), 2
            )
            for r in sorted(memory)
        ]
    steady_rss = {}
    for e in run.events:  # resident memory as each round's training ended (round 1 is before any checkpoint is kept)
        if e.get("event") == "boundary_done" and e.get("round", 0) > 1 and "rss_before_mb" in e:
            steady_rss.setdefault(e.get("rank", 0), []).append(e["rss_before_mb"])
    if steady_rss:
        row["steady_rss_mb_per_rank"] = [max(steady_rss[r]) for r in sorted(steady_rss)]
    if phases:
        row["boundary_phases_s"] = {k: round(sum(v) / len(v), 4) for k, v in sorted(phases.items())}
    return row


def measure_layouts(
    layouts: list[tuple[int, int, int]],
    threads: int = 1,
    device: str = "cpu",
    variants: tuple[str, ...] = (),
    **options,
) -> list[dict]:
    """One row per layout and variant (VARIANTS; none: the plain run), in this order."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="dilocox-layouts-") as tmp:
        for pp, dp, replicate in layouts:
            for variant in variants or ("",):
                extra = VARIANTS[variant] if variant else ()
                run = run_layout(
                    LayoutRun(pp, dp, replicate, extra=extra, variant=variant, **options),
                    pathlib.Path(tmp),
                    threads,
                    device=device,
                )
                rows.append(summarize(run))
                print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


if __name__ == "__main__":  # python -m dilocox.bench.site_layouts 1x1 1x2 2x1 2x2 (pp x dp[xreplicate])
    specs = [tuple(int(v) for v in a.split("x")) for a in sys.argv[1:]] or [(1, 1), (1, 2), (2, 1), (2, 2)]
    measure_layouts(
        [(s[0], s[1], s[2] if len(s) > 2 else 1) for s in specs], threads=int(os.environ.get("THREADS", "1"))
    )
