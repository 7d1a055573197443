"""Shared fixtures: real gRPC shard servers on free localhost ports, stopped after each test; the forkserver the
tests' gloo ranks start from (tests/gloo_ranks.py); and the run's teardown check: no process the tests started
outlives the run (tests/leftovers.py)."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.multiprocessing as mp

from dilocox.common.config.run import WireConfig
from dilocox.server.rounds.grace import GraceWindow
from dilocox.server.serving.grpc_server import start_server
from dilocox.server.shard import DEFAULT_KEEP_ROUNDS, Shard
from tests.gloo_ranks import PRELOAD
from tests.leftovers import MARK, left_behind, mark_this_run


def pytest_configure(config: pytest.Config) -> None:
    mark_this_run()  # before xdist starts its workers: they and everything they start inherit it
    # One torch thread per process, unless the caller chose: the suite runs 2 xdist workers on 2 cores beside the
    # shards, workers and ranks they start, and OpenMP teams of 2 threads each spin on cores the others need
    # (tiny-op loops ran 2x slower beside load, and up to 100x under heavy load). The variable reaches the xdist
    # workers and every process they start; this process imported torch already, so it is set here too. A test
    # that sets its own count (an explicit --threads, torch.set_num_threads) keeps it.
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
    mp.set_forkserver_preload(PRELOAD)  # only names; nothing starts before a test asks for rank_forkserver


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if hasattr(session.config, "workerinput"):  # an xdist worker: the controller checks once every worker is done
        return
    left = left_behind(os.environ[MARK])
    if left:
        lines = "\n".join(f"  pid {pid}: {command[:300]}" for pid, command in sorted(left.items()))
        session.config.get_terminal_writer().line(f"\nprocesses the tests left behind (killed now):\n{lines}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def rank_forkserver():
    """The forkserver the tests' gloo ranks are forked from, started once for this process (an xdist worker)
    with torch and the site imported (tests/gloo_ranks.py). A session fixture, so it starts from the run's own
    environment, before any test's monkeypatch; stopped at the end so that no process of it outlives the run."""
    from multiprocessing import forkserver

    forkserver.ensure_running()
    yield
    forkserver._forkserver._stop()  # noqa: SLF001 (the stdlib's own way to stop it; it has no public one)


class ShardSet:
    """N in-process shards, each a real grpc.Server bound to 127.0.0.1:<free port>."""

    def __init__(
        self,
        num_shards: int,
        run_id: str,
        min_clusters: int = 1,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        wire: WireConfig | None = None,
        round_deadline_s: float | None = None,
        added_latency_s: float | list[float] = 0.0,
        grace_s: tuple[float, float] | None = None,
        keep_rounds: int = DEFAULT_KEEP_ROUNDS,
        expect_clusters: int | None = None,
        update_check=None,  # noqa: ANN001
        aggregate=None,
        **serve,
    ) -> None:  # noqa: ANN001
        """`grace_s`: (min, max) of a quorum + grace window (server/rounds/grace.py), one window per shard; `serve`:
        more of `start_server`'s settings (e.g. `pull_cache_bytes`)."""
        self.shards = [
            Shard(
                i,
                num_shards,
                run_id,
                outer_lr,
                outer_momentum,
                min_clusters,
                round_deadline_s,
                GraceWindow(*grace_s) if grace_s else None,
                expect_clusters=expect_clusters,
                keep_rounds=keep_rounds,
                update_check=update_check,
                aggregate=aggregate,
            )
            for i in range(num_shards)
        ]
        self.servers = []
        self.addresses = []
        latencies = added_latency_s if isinstance(added_latency_s, (list, tuple)) else [added_latency_s] * num_shards
        for shard, latency in zip(self.shards, latencies):  # a list: each shard's own (one slower than the other)
            server, port = start_server(shard, "127.0.0.1", 0, wire, added_latency_s=latency, **serve)
            self.servers.append(server)
            self.addresses.append(f"127.0.0.1:{port}")

    def wait_version(self, version: int, timeout: float = 30) -> None:
        """Wait until every shard has published `version` (a deadline or a grace window closes on its own)."""
        deadline = time.monotonic() + timeout
        for shard in self.shards:
            while shard.version < version:
                assert time.monotonic() < deadline, f"shard {shard.shard_index} stuck at version {shard.version}"
                time.sleep(0.01)

    def stop(self) -> None:
        for server in self.servers:
            server.stop(grace=None).wait(timeout=10)


@pytest.fixture
def shard_set():
    made: list[ShardSet] = []

    def make(num_shards: int = 2, run_id: str = "run-test", **kwargs) -> ShardSet:
        s = ShardSet(num_shards, run_id, **kwargs)
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop()


@pytest.fixture
def slurm(tmp_path_factory):
    """A real slurm-wlm controller and node daemon on this machine (tests/local_slurm.py), stopped after the
    test; the test is skipped where slurm-wlm cannot be installed or started."""
    from tests.local_slurm import LocalSlurm, SlurmUnavailable

    try:
        cluster = LocalSlurm(tmp_path_factory.mktemp("slurm")).start()
    except SlurmUnavailable as error:
        pytest.skip(f"Slurm: {error}")
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """The run's CA (as `dilocox certs` makes it) with a signer's certificate, and another CA with one: the
    export-signing tests' keys."""
    from tests.pki import two_authorities

    return two_authorities(tmp_path_factory.mktemp("pki"), "signer", "exporter", usage="signer")
