"""`dilocox sim`: the whole system on one machine — shard processes and cluster processes on localhost.

Every shard and every cluster is a real OS process talking real gRPC over loopback, exactly as in a
deployment; only the addresses are local. The sim reads the clusters' JSON log lines, prints one
line per round across clusters, and a summary at the end. Child logs are kept in --log-dir.

The children's command lines are child_argv.py's, a cluster's stderr is read by cluster_logs.py, and
where the TensorBoard curves go is tensorboard_curves.py's; here is the run itself and its bookkeeping.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import secrets
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict

import structlog

from dilocox.common.config.run import RunConfig
from dilocox.common.config.run_flags import add_config_arguments, config_from_args
from dilocox.common.deploy import prometheus_config
from dilocox.common.deploy.certs import make_dev_certificates
from dilocox.common.deploy.topology import tls_flags
from dilocox.common.logs import add_log_format_argument, configure_logging
from dilocox.common.security import TlsFiles
from dilocox.sim import tensorboard_curves
from dilocox.sim.child_argv import cluster_argv, export_argv, shard_argv
from dilocox.sim.cluster_logs import ClusterLogReader
from dilocox.sim.global_eval import GlobalEvalWatch, round_line
from dilocox.worker.data.sources import CorpusError
from dilocox.worker.data.token_data import add_data_arguments, load_run_data
from dilocox.worker.data.tokenizer import TokenizerError, resolve_tokenizer

log = structlog.get_logger()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shards", type=int, default=2, help="aggregation shard processes (default 2)")
    parser.add_argument(
        "--clusters", type=int, default=2, help="cluster processes, each on its own data shard (default 2)"
    )
    add_data_arguments(parser)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per cluster process (default 1)")
    parser.add_argument("--log-dir", type=pathlib.Path, help="keep every process's log here (default: a temp dir)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="give up after this many seconds (default 1800)")
    parser.add_argument(
        "--round-deadline-s",
        type=float,
        default=120.0,
        help="shards close a round this long after its first push with the clusters that made it (default 120)",
    )
    parser.add_argument(
        "--grace-s",
        type=float,
        default=0.0,
        help="uneven sites: shards close a round once all clusters but one have delivered, plus at most this "
        'grace window (docs/deploy.md, "Uneven sites"; default 0: wait for every cluster)',
    )
    parser.add_argument(
        "--slow-cluster",
        type=float,
        default=1.0,
        metavar="F",
        help="uneven sites: the last cluster trains at 1/F of its speed (dilocox worker --simulate-slowdown; "
        "default 1)",
    )
    parser.add_argument("--summary-json", type=pathlib.Path, help="also write the final summary here as JSON")
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        metavar="P",
        help="serve Prometheus metrics on 127.0.0.1: shard i on P+i, cluster j on P+shards+j, and write "
        "<log-dir>/prometheus.yml scraping them with the shipped alert rules (default 0: off)",
    )
    parser.add_argument(
        "--no-tensorboard",
        action="store_true",
        help="do not write the clusters' per-round TensorBoard scalars (default: under <log-dir>/tensorboard "
        "when the tensorboard package is installed)",
    )
    add_log_format_argument(parser)
    parser.add_argument(
        "--tls", action="store_true", help="run with mTLS and a run token (dev certificates made in the log dir)"
    )
    add_config_arguments(parser)


class Simulation:
    def __init__(
        self,
        args: argparse.Namespace,
        config: RunConfig,
        log_dir: pathlib.Path,
        tensorboard_dir: pathlib.Path | None = None,
    ) -> None:
        self.args = args
        self.config = config
        self.log_dir = log_dir
        self.tensorboard_dir = tensorboard_dir  # every cluster writes its scalars under <dir>/<cluster>
        # With a grace window the shards close on all clusters but one (the one that may fall behind).
        self._min_clusters = max(1, args.clusters - 1) if args.grace_s > 0 else args.clusters
        self.server_security, self.worker_security = ["--insecure"], ["--insecure"]
        if args.tls:
            make_dev_certificates(log_dir / "certs")  # ca.pem, server.pem, client.pem and keys: tls_flags' names
            token = secrets.token_hex(16)
            self.server_security = [*tls_flags(str(log_dir / "certs"), "server"), "--token", token]
            self.worker_security = [*tls_flags(str(log_dir / "certs"), "client"), "--token", token]
        self.shards: list[subprocess.Popen] = []
        self.workers: dict[str, subprocess.Popen] = {}
        self.readers: dict[str, ClusterLogReader] = {}
        self._lock = threading.Lock()
        self._rounds: dict[int, dict[str, dict]] = defaultdict(dict)
        self._initial: dict[str, float] = {}
        self._final: dict[tuple[str, int], dict] = {}
        self._flushes: dict[tuple[str, int], dict] = {}  # the end-of-run flush of each rank's residuals
        self.round_lines: list[dict] = []
        self.watch: GlobalEvalWatch | None = None  # the global model's eval per version (sim/global_eval.py)
        self.final_global_eval: float | None = None
        self.replay_mismatches = (
            0  # a cluster's replica of the shards' weights differed (worker/exchange/replay_check.py)
        )

    # ------------------------------------------------------------------ processes
    def start_shards(self) -> list[str]:
        port_files = []
        for i in range(self.args.shards):
            port_file = self.log_dir / f"shard-{i}.port"
            port_file.unlink(missing_ok=True)  # a reused --log-dir: an earlier run's port is not this shard's
            port_files.append(port_file)
            cmd = shard_argv(self.args, self.config, i, port_file, self._min_clusters, self.server_security)
            with (self.log_dir / f"shard-{i}.log").open("w") as out:
                self.shards.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 60
        addresses = []
        for i, port_file in enumerate(port_files):
            while not port_file.exists():
                if self.shards[i].poll() is not None:
                    raise RuntimeError(
                        f"shard {i} exited with {self.shards[i].returncode}; see {self.log_dir}/shard-{i}.log"
                    )
                if time.monotonic() > deadline:
                    raise TimeoutError(f"shard {i} did not start within 60s; see {self.log_dir}/shard-{i}.log")
                time.sleep(0.05)
            addresses.append(f"127.0.0.1:{port_file.read_text().strip()}")
        log.info("sim_shards_up", shards=len(addresses), addresses=addresses)
        return addresses

    def prepare_tokenizer(self) -> None:
        """Train a `bpe:VOCAB` tokenizer once, here, before the clusters start: they find it in the
        cache instead of each training the same one."""
        if self.config.tokenizer.startswith("bpe:"):
            started = time.monotonic()
            tokenizer = resolve_tokenizer(self.config.tokenizer, self.args.data, self.args.text_field)
            log.info(
                "sim_tokenizer_ready",
                tokenizer=tokenizer.spec,
                vocab=tokenizer.vocab_size,
                seconds=round(time.monotonic() - started, 1),
            )

    def start_watch(self, addresses: list[str]) -> GlobalEvalWatch | None:
        """Evaluate the shards' model at every version, in this process (sim/global_eval.py)."""
        try:
            data = load_run_data(self.config.tokenizer, self.args.data, self.args.text_field)
        except (TokenizerError, CorpusError) as error:
            log.warning("global_eval_unavailable", reason=str(error))
            return None
        tls, token = None, None
        if self.args.tls:
            certs = self.log_dir / "certs"
            tls, token = (
                TlsFiles(cert=certs / "client.pem", key=certs / "client-key.pem", ca=certs / "ca.pem"),
                self.worker_security[-1],
            )
        return GlobalEvalWatch(
            addresses, self.config, data, self.config.final_version, self._on_global_eval, tls, token
        ).start()

    def export_model(self, addresses: list[str]) -> str | None:
        """The run's global model, read from the still-running shards into <log dir>/model."""
        out = self.log_dir / "model"
        command = export_argv(self.args, self.config, addresses, out, self.worker_security)
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            log.error("sim_export_failed", error=done.stderr.strip()[-2000:])
            return None
        log.info("sim_model_exported", path=str(out))
        return str(out)

    def write_prometheus_config(self) -> pathlib.Path | None:
        if not self.args.metrics_port:
            return None
        path = self.log_dir / "prometheus.yml"
        path.write_text(
            prometheus_config.render(
                prometheus_config.sim_targets(self.args.metrics_port, self.args.shards, self.args.clusters)
            )
        )
        log.info(
            "sim_prometheus",
            config=str(path),
            command=f"prometheus --config.file {shlex.quote(str(path))}",
            dashboard=str(prometheus_config.shipped(prometheus_config.DASHBOARD)),
        )
        return path

    def start_clusters(self, addresses: list[str]) -> None:
        for j in range(self.args.clusters):
            name = f"cluster-{j}"
            cmd = cluster_argv(self.args, self.config, j, name, addresses, self.worker_security, self.tensorboard_dir)
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, bufsize=1)
            self.workers[name] = proc
            reader = ClusterLogReader(name, proc, self.log_dir / f"{name}.log", self._on_event)
            reader.start()
            self.readers[name] = reader
        log.info("sim_clusters_started", clusters=len(self.workers))

    def stop_all(self) -> None:
        for proc in [*self.workers.values(), *self.shards]:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in [*self.workers.values(), *self.shards]:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    # ------------------------------------------------------------------ events
    def _on_event(self, cluster: str, event: dict) -> None:
        """Events come from every rank of every cluster; losses and tokens are per cluster (all its
        ranks report the same), bytes are per rank (each pushes its own share) and are summed."""
        kind = event.get("event")
        source = (cluster, event.get("rank", 0))
        with self._lock:
            if kind == "cluster_started":
                self._initial[cluster] = event["eval_loss"]
            elif kind == "cluster_done":
                self._final[source] = event
            elif kind == "residuals_flushed":
                self._flushes[source] = event
            elif kind == "replay_mismatch":
                self.replay_mismatches += 1
            elif kind == "round_done":
                per_round = self._rounds[event["round"]]
                per_round[source] = event
                everyone = len(per_round) == self.args.clusters * self.config.parallel.world_size
                printed = self.round_lines[-1]["round"] if self.round_lines else 0
                if everyone and (self.watch is None or self.watch.failed) and event["round"] > printed:
                    self._print_round(event["round"], per_round, global_eval=None)  # no global eval: the sites' mean

    def _on_global_eval(self, version: int, loss: float) -> None:
        """The watch evaluated the shards' version `version`: a line for it (and for any round it passed)."""
        with self._lock:
            # Rounds the shards closed faster than the watch read them: the sites' own evals, said so.
            for skipped in range(len(self.round_lines) + 1, min(version, self.config.rounds + 1)):
                self._print_round(skipped, self._rounds.get(skipped, {}), global_eval=None)
            if version > self.config.rounds:  # the end-of-run flush: the run's final global model
                self.final_global_eval = loss
            elif version > len(self.round_lines):
                self._print_round(version, self._rounds.get(version, {}), global_eval=loss)

    def _print_round(self, round_: int, per_rank: dict[tuple[str, int], dict], global_eval: float | None) -> None:
        """One `sim_round` line: with the watch, for every round the shards closed, its eval the global
        model's and `sites` the clusters that had reported it by then (a late one reports later); without
        it, once every cluster reported, the mean of their evals."""
        line = round_line(round_, per_rank, global_eval)
        self.round_lines.append(line)
        log.info("sim_round", **line)

    # ------------------------------------------------------------------ run
    def run(self) -> dict:
        started = time.monotonic()
        model_dir = None
        try:
            self.prepare_tokenizer()
            self.write_prometheus_config()
            addresses = self.start_shards()
            self.watch = self.start_watch(addresses)
            self.start_clusters(addresses)
            deadline = started + self.args.timeout
            failed = {}
            for name, proc in self.workers.items():
                try:
                    code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise TimeoutError(f"the simulation did not finish within {self.args.timeout:.0f}s") from None
                if code != 0:
                    reader = self.readers[name]
                    failed[name] = {"exit_code": code, "reason": reader.reason(), "log": str(reader.log_path)}
                    log.error("sim_cluster_failed", cluster=name, **failed[name])
            if self.watch is not None and not failed:  # the last versions' evals, while the shards still serve them
                self.watch.stop(timeout=max(1.0, min(60.0, deadline - time.monotonic())), drain=True)
            model_dir = None if failed else self.export_model(addresses)
        finally:
            if self.watch is not None:
                self.watch.stop(timeout=5.0)
            self.stop_all()
        wall = time.monotonic() - started
        finals = [
            e["final_eval_loss"]
            for (_, rank), e in self._final.items()
            if rank == 0 and e.get("final_eval_loss") is not None
        ]
        summary = {
            "ok": not failed and len(finals) == self.args.clusters,
            "failed_clusters": failed,
            "shards": self.args.shards,
            "clusters": self.args.clusters,
            "rounds": len(self.round_lines),  # the rounds the shards closed (or, without the watch, all reported)
            "initial_eval_loss": round(sum(self._initial.values()) / max(1, len(self._initial)), 4),
            "final_eval_loss": round(sum(finals) / len(finals), 4) if finals else None,
            "tokens": sum(
                e["tokens"] for per_round in self._rounds.values() for (_, rank), e in per_round.items() if rank == 0
            ),
            "bytes_up": sum(e.get("bytes_up", 0) for e in self._final.values()),
            "bytes_down": sum(e.get("bytes_down", 0) for e in self._final.values()),
            # of which the one-off end-of-run flush of the error-feedback residuals
            "flush_bytes_up": sum(e["bytes_up"] for e in self._flushes.values()),
            "flush_bytes_down": sum(e["bytes_down"] for e in self._flushes.values()),
            "idle_fraction": _idle_fraction(self._rounds),
            "global_eval_loss": round(self.final_global_eval, 4) if self.final_global_eval is not None else None,
            "delay": self.config.delay,
            "replay_mismatches": self.replay_mismatches,
            "wall_s": round(wall, 1),
            "log_dir": str(self.log_dir),
            "model_dir": model_dir,
            "tensorboard_dir": str(self.tensorboard_dir) if self.tensorboard_dir else None,
        }
        log.info("sim_summary", **summary)
        tensorboard_curves.log_tensorboard_command(self.tensorboard_dir)
        return summary


def _idle_fraction(rounds: dict[int, dict[tuple[str, int], dict]]) -> float:
    """The share of the rounds' time the sites' trainers waited on the network (each round its slowest
    rank's), over every round any site reported."""
    lines = [round_line(r, per_rank, None) for r, per_rank in rounds.items()]
    return round(sum(line["idle_s"] for line in lines) / max(1e-9, sum(line["seconds"] for line in lines)), 4)


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_format, stream=sys.stdout)
    try:
        config = config_from_args(args)
    except (ValueError, TypeError) as error:
        raise SystemExit(f"dilocox sim: bad configuration: {error}") from None
    if args.shards < 1 or args.clusters < 1:
        raise SystemExit("dilocox sim: --shards and --clusters must be at least 1")
    log_dir = args.log_dir or pathlib.Path(tempfile.mkdtemp(prefix="dilocox-sim-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log.info(
        "sim_starting",
        shards=args.shards,
        clusters=args.clusters,
        rounds=config.rounds,
        inner_steps=config.inner.steps,
        log_dir=str(log_dir),
        pid=os.getpid(),
    )
    tensorboard_dir = tensorboard_curves.tensorboard_dir(args, log_dir)
    tensorboard_curves.log_tensorboard_command(tensorboard_dir)  # to watch the curves while the run goes on
    try:
        summary = Simulation(args, config, log_dir, tensorboard_dir).run()
    except (TokenizerError, CorpusError) as error:
        raise SystemExit(f"dilocox sim: {error}") from None
    if args.summary_json:
        args.summary_json.write_text(json.dumps(summary, indent=2))
    return 0 if summary["ok"] else 1
