"""Uneven sites: time-boxed rounds, and a shard closing on a quorum plus a grace window.

Real shards over localhost gRPC; exact fp32 pushes, so what the shards hold can be replayed bit for bit
from what went over the wire (each client records every push a shard accepted)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import grpc
import pytest
import structlog
import torch
from prometheus_client import generate_latest

from dilocox.common.wire.aggregation import weighted_mean
from dilocox.common.wire.assignment import model_digest
from dilocox.common.wire.framing import EncodedSlice
from dilocox.common.wire.outer_optimizer import OuterNesterov
from dilocox.server.metrics import ShardMetrics
from dilocox.server.rounds.grace import GraceWindow
from dilocox.server.rounds.round_close import decide, first_round_waits
from dilocox.server.rounds.round_state import RoundAccumulator
from dilocox.server.shard import Shard
from dilocox.worker.exchange.adaptive_steps import RoundTimeBox
from dilocox.worker.exchange.aggregator_client import AggregatorClient, AggregatorError
from dilocox.worker.exchange.cluster import DilocoCluster, slice_tensors
from dilocox.worker.exchange.communicator import Communicator
from tests.test_delay import ToyTrainer, run_concurrently

RUN = "uneven-run"
LR, MOMENTUM = 0.7, 0.9
PARAMS = [("w", (16, 8)), ("b", (8,))]


class RecordingClient(AggregatorClient):
    """Records every push stream a shard accepted: (shard, round, weight, {key: fp32 tensor}), and every
    pseudo-gradient handed to `push` as computed (before any carried part is added)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.accepted: list[tuple[int, int, float, dict]] = []
        self.computed: list[tuple[int, float, dict]] = []
        self._record_lock = threading.Lock()

    def push(self, round_, weight, tensors, shards=None, reencode=True, codec=None, facts=(0, 0.0), formed=False):
        if round_ > 0 and reencode:  # uncompressed here: the outgoing buffer is Δ itself
            with self._record_lock:
                self.computed.append((round_, weight, {k: t.clone() for k, t in tensors.items()}))
        return super().push(round_, weight, tensors, shards, reencode, codec, facts, formed)

    def accepted_rounds(self) -> list[tuple[int, float, dict]]:
        """The accepted pushes of rounds ≥ 1 as (round, weight, tensors), a retried stream counted once."""
        seen, out = set(), []
        for _shard, round_, weight, parts in self.accepted:
            fresh = {k: t for k, t in parts.items() if round_ > 0 and (round_, k) not in seen}
            seen |= {(round_, k) for k in fresh}
            if fresh:
                out.append((round_, weight, fresh))
        return out

    def _send(self, shard, round_, weight, items, wait=True):
        sent = super()._send(shard, round_, weight, items, wait)
        with self._record_lock:
            self.accepted.append((shard, round_, weight, {item.key: item.decode().clone() for item in items}))
        return sent


def _weighted_sums(pushes: list[tuple[int, float, dict]]) -> dict:
    sums: dict = {}
    for _, weight, parts in pushes:
        for key, tensor in parts.items():
            sums[key] = sums.get(key, 0) + weight * tensor
    return sums


def replay(clients: list[RecordingClient], shard_index: int, rounds: int) -> dict:
    """The shard's weights after `rounds`, from the accepted pushes alone: θ0 from round 0, then per round
    the token-weighted mean of each cluster's part (a retried stream counted once) and the outer step."""
    theta: dict = {}
    by_round: dict[int, dict[str, tuple[float, dict]]] = {}
    for client in clients:
        for shard, round_, weight, tensors in client.accepted:
            if shard != shard_index:
                continue
            if round_ == 0:
                theta.update(tensors)
                continue
            _, parts = by_round.setdefault(round_, {}).setdefault(client.cluster, (weight, {}))
            for key, tensor in tensors.items():
                parts.setdefault(key, tensor)
    outer = OuterNesterov(LR, MOMENTUM)
    for round_ in range(1, rounds + 1):
        contributions = by_round.get(round_, {})
        for key in theta:
            items = [(c, w, (lambda t=parts[key]: t)) for c, (w, parts) in contributions.items() if key in parts]
            if items:
                theta[key] = outer.step(key, theta[key], weighted_mean(items))
    return theta


def test_time_boxed_sites_of_unequal_speed_deliver_every_round_and_the_shards_equal_a_replay(tmp_path):
    """`dilocox server` processes that wait for both sites; two time-boxed sites, one 4× slower per step:
    both make every round with their own H and tokens, the shards say so, and their weights are a replay
    of the token-weighted steps they accepted."""
    rounds, budget_s = 5, 0.24
    procs, addresses = _start_shards(tmp_path, 2, "--min-clusters", "2", "--round-deadline-s", "0")
    try:
        fast, slow = _sites_to_their_end(
            addresses, rounds, 8, lambda: RoundTimeBox(8, budget_s, min_steps=1, max_steps=64)
        )
        clusters = [fast, slow]
        assert [r.round for r in fast.reports] == [r.round for r in slow.reports] == list(range(1, rounds + 1))
        assert not any(r.late for c in clusters for r in c.reports)
        # H follows each site's speed (from the first round on: it measures 3 steps, then sets that round's H).
        assert all(f.inner_steps > s.inner_steps for f, s in zip(fast.reports, slow.reports)), (
            [r.inner_steps for r in fast.reports],
            [r.inner_steps for r in slow.reports],
        )
        assert all(f.tokens > s.tokens for f, s in zip(fast.reports, slow.reports))
        weights, statuses = _observe(addresses, fast.trainer, rounds)
        for index, status in enumerate(statuses):
            # What each site made and said of its last round (tokens, H) is in every shard's status.
            said = {site.cluster: site for site in status.sites}
            for name, cluster in (("fast", fast), ("slow", slow)):
                assert (said[name].member, said[name].rounds_made, said[name].rounds_late) == (True, rounds, 0)
                assert (said[name].last_tokens, said[name].inner_steps) == (
                    cluster.reports[-1].tokens,
                    cluster.reports[-1].inner_steps,
                )
            expected = replay([c.client for c in clusters], index, rounds)
            for key in [k for k in weights if k in expected]:
                assert torch.equal(weights[key], expected[key]), key
            assert any(k in expected for k in weights)
    finally:
        _stop(procs)


def _sites_to_their_end(addresses: list[str], rounds: int, inner_steps: int, controller=None) -> list[DilocoCluster]:
    """A fast site and one 4× slower per step ("fast", "slow"), recording what the shards accepted, run
    to their end against `addresses`; `controller()` makes each one's steps controller."""
    clusters = []
    for seed, (name, step_s) in enumerate((("fast", 0.01), ("slow", 0.04))):
        client = RecordingClient(addresses, RUN, name, connect_timeout=30, rpc_timeout=30, shard_wait_s=30)
        clusters.append(
            DilocoCluster(
                ToyTrainer(seed, step_s=step_s),
                client,
                rounds,
                inner_steps=inner_steps,
                delay=1,
                num_clusters=2,
                steps_controller=controller() if controller else None,
            )
        )
    run_concurrently(clusters)  # closes their clients
    return clusters


def _observe(addresses: list[str], trainer, version: int):
    """The shards' weights at `version` in full (a new client's pull), and every shard's status."""
    observer = AggregatorClient(addresses, RUN, "observer", connect_timeout=30, rpc_timeout=30, shard_wait_s=30)
    try:
        observer.join([(name, tuple(p.shape)) for name, p in trainer.named_parameters()])
        got, weights, _ = observer.pull(min_version=version)
        assert got == version
        return weights, observer.status_each()
    finally:
        observer.close()


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.wait(timeout=30)


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in PARAMS}


def _started(addresses: list[str], names: tuple[str, ...]) -> list[RecordingClient]:
    """Clients joined to the run, the first having pushed θ0 (round 0), all holding version 0."""
    clients = [RecordingClient(addresses, RUN, name, shard_wait_s=0) for name in names]
    for client in clients:
        client.join(PARAMS)
    clients[0].push(0, 1.0, slice_tensors(clients[0].assignment, _tensors(0)))
    for client in clients:
        client.pull(min_version=0)
    return clients


def test_a_site_that_misses_the_grace_window_stays_and_its_part_is_applied_next_round_exactly_once(shard_set):
    shards = shard_set(2, RUN, min_clusters=1, outer_lr=LR, outer_momentum=MOMENTUM, grace_s=(0.2, 0.2))
    a, late = _started(shards.addresses, ("a", "late"))
    try:
        deltas = {(name, r): _tensors(10 * r + i) for r in (1, 2, 3) for i, name in enumerate(("a", "late"))}
        tokens = {"a": 30.0, "late": 10.0}

        def push(client, round_):
            return client.push(
                round_, tokens[client.cluster], slice_tensors(client.assignment, deltas[client.cluster, round_])
            )

        # Round 1: both in time: it closes at once, with both.
        push(a, 1)
        push(late, 1)
        shards.wait_version(1)
        for shard in shards.shards:
            assert shard.last_round.clusters == ("a", "late") and shard.last_round.late == ()
        for client in (a, late):
            client.pull(min_version=1)

        # Round 2: `late` misses the grace window. The shards close without it and keep it in the run; its
        # push is refused, and the same exchange then pulls the round's result (it is still a member).
        push(a, 2)
        shards.wait_version(2)
        for shard in shards.shards:
            assert shard.last_round.clusters == ("a",) and shard.last_round.late == ("late",)
            assert "late" in shard.members and shard.sites["late"].rounds_late == 1
        communicator = Communicator(late)
        communicator.submit(2, tokens["late"], slice_tensors(late.assignment, deltas["late", 2]))
        exchange, _ = communicator.collect(timeout=30)
        communicator.close()
        assert exchange.late and exchange.version == 2
        assert late.carry.elements == sum(numel for _, shape in PARAMS for numel in [torch.Size(shape).numel()])
        a.pull(min_version=2)

        # Round 3: its push brings round 2's part along, weighted by round 2's tokens (here the same 10).
        push(a, 3)
        push(late, 3)
        for client in (a, late):
            client.pull(min_version=3)
        for shard in shards.shards:
            assert shard.last_round.clusters == ("a", "late")
            assert dict(shard.last_round.tokens) == {"a": 30.0, "late": 10.0}
            assert shard.sites["late"].rounds_made == 2 and shard.sites["late"].rounds_late == 1
            exposition = generate_latest(ShardMetrics(shard).registry).decode()
            assert 'dilocox_site_rounds_late_total{cluster="late"} 1.0' in exposition
            assert 'dilocox_site_rounds_made_total{cluster="late"} 2.0' in exposition

        # Exactly once, weighed by its age: the token-weighted progress the shards accepted from `late`
        # (Σ w·Δ, the means' numerators) is what it computed, round 2's part discounted by 1/(1 + 1) — it
        # entered round 3, one round late (common/wire/staleness.py).
        computed = [(r, w * (0.5 if r == 2 else 1.0), t) for r, w, t in late.computed]
        assert _weighted_sums(late.accepted_rounds()).keys() == _weighted_sums(computed).keys()
        for key, total in _weighted_sums(late.accepted_rounds()).items():
            torch.testing.assert_close(total, _weighted_sums(computed)[key], rtol=0, atol=1e-5)

        # And the shards' weights (and both replicas) are a replay of the accepted pushes.
        for index, shard in enumerate(shards.shards):
            expected = replay([a, late], index, 3)
            for key, tensor in shard.snapshot.tensors.items():
                assert torch.equal(tensor, expected[key]), key
                assert torch.equal(a.held[key], tensor) and torch.equal(late.held[key], tensor)
    finally:
        a.close()
        late.close()


def test_a_round_one_shard_closed_without_the_site_reports_the_bytes_the_other_shard_took(shard_set):
    """A late exchange whose push only some shards refused: the round's report counts what the others
    took (their answer to a retry of an included part is duplicates, whose bytes went over the wire too),
    not 0 as if nothing had been sent."""
    shards = shard_set(2, RUN, min_clusters=1, outer_lr=LR, outer_momentum=MOMENTUM, grace_s=(0.2, 0.2))
    a, late = _started(shards.addresses, ("a", "late"))
    try:
        deltas = {name: _tensors(20 + i) for i, name in enumerate(("a", "late"))}
        late.push(1, 10.0, slice_tensors(late.assignment, deltas["late"]), shards=[0])  # shard 0 only, in time
        a.push(1, 30.0, slice_tensors(a.assignment, deltas["a"]))
        shards.wait_version(1)
        assert [s.last_round.clusters for s in shards.shards] == [("a", "late"), ("a",)]
        communicator = Communicator(late)
        communicator.submit(1, 10.0, slice_tensors(late.assignment, deltas["late"]))
        exchange, _ = communicator.collect(timeout=30)
        communicator.close()
        assert exchange.late and exchange.version == 1
        took = late.traffic.per_shard_up[0]
        assert exchange.bytes_up > 0 and late.traffic.per_shard_up.get(1, 0) == 0 and took >= exchange.bytes_up
    finally:
        a.close()
        late.close()


def test_a_refusal_that_is_not_a_closed_round_still_makes_the_site_rejoin(shard_set):
    """Dropped from the run (a deadline, no grace): the refused push's pull is refused too, and the
    exchange fails as before — the site rejoins; nothing is taken for a late round."""
    shards = shard_set(1, RUN, round_deadline_s=0.2)
    a, dropped = _started(shards.addresses, ("a", "dropped"))
    try:
        a.push(1, 1.0, slice_tensors(a.assignment, _tensors(1)))
        shards.wait_version(1)
        assert "dropped" not in shards.shards[0].members
        communicator = Communicator(dropped, repush_after_s=1.0)
        communicator.submit(1, 1.0, slice_tensors(dropped.assignment, _tensors(2)))
        with pytest.raises(AggregatorError) as refused:
            communicator.collect(timeout=30)
        communicator.close()
        assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        a.close()
        dropped.close()


# ---------------------------------------------------------------------- the rules, without sockets


def _accumulator(round_: int, delivered: dict[str, list[str]]) -> RoundAccumulator:
    acc = RoundAccumulator(round_)
    for cluster, keys in delivered.items():
        for key in keys:
            acc.add(cluster, 1.0, EncodedSlice.exact(key, torch.zeros(2)))
    return acc


def test_who_is_complete_is_counted_as_slices_arrive_not_walked_at_every_push():
    """The close's question at every push, from the counts `add` keeps (a walk over slices × sites grew as
    sites² × slices a round): a slice sent again counts once, and the clusters a close drops are forgotten."""
    owned = {"k0", "k1", "k2"}
    acc = _accumulator(2, {"a": ["k0", "k2"], "b": ["k0", "k1", "k2"]})
    acc.add("a", 1.0, EncodedSlice.exact("k0", torch.ones(2)))  # a's k0 again: still two of three
    assert acc.complete_clusters(owned) == {"b"} and acc.partial_clusters({"b"}) == {"a"}
    acc.add("a", 1.0, EncodedSlice.exact("k1", torch.zeros(2)))
    assert acc.complete_clusters(owned) == {"a", "b"}
    acc.keep_only({"b"})
    assert acc.complete_clusters(owned) == {"b"} and acc.partial_clusters({"b"}) == set()


def test_quorum_and_grace_decide_who_is_in_late_or_dropped():
    owned = {"k0", "k1"}
    members = {"a": 0.0, "b": 0.0, "c": 0.0}
    grace = GraceWindow(1.0, 1.0)
    acc = _accumulator(3, {"a": ["k0", "k1"], "c": ["k0"]})  # a complete, c part-way, b nothing
    assert decide(acc, members, owned, 2, now=10.0, grace=grace) is None  # no quorum of 2
    assert decide(acc, members, owned, 1, now=10.0, grace=grace) is None  # quorum: the window starts
    assert acc.quorum_at == 10.0
    assert decide(acc, members, owned, 1, now=10.9, grace=grace) is None
    assert decide(acc, members, owned, 1, now=11.5, grace=grace) is None  # c's delivery is under way: it gets longer
    decision = decide(acc, members, owned, 1, now=12.0, grace=grace)
    assert decision.include == {"a"} and decision.late == ("b",) and decision.dropped == ("c",)
    # With a deadline, a member silent for that long is gone rather than late.
    acc = _accumulator(4, {"a": ["k0", "k1"]})
    decision = decide(
        acc, members, owned, 1, now=20.0, deadline_s=5.0, grace=GraceWindow(0.0, 0.0), last_seen={"b": 19.0, "c": 2.0}
    )
    assert decision.late == ("b",) and decision.dropped == ("c",)
    # Every member in: closed at once, whatever the window.
    acc = _accumulator(5, {m: ["k0", "k1"] for m in members})
    assert decide(acc, members, owned, 1, now=0.0, grace=GraceWindow(9.0, 9.0)).include == set(members)


def test_a_quorum_run_s_first_round_waits_for_every_expected_site_to_join():
    """With --min-clusters 1 of 2 sites, the site that starts first must not close round 1 before the
    other has joined (that one would then be refused as a late joiner: CI saw it when a process started
    slowly); with a deadline, round 1 gives up on a site that never comes."""
    params = [("w", (4,))]
    shard = Shard(0, 1, RUN, LR, MOMENTUM, min_clusters=1, grace=GraceWindow(0.5, 0.5), expect_clusters=2)
    shard.join(RUN, "a", model_digest(params), params)
    shard.commit_push("a", 0, 1.0, [(key, s.view(torch.zeros(4)).clone()) for key, s in shard.owned.items()])
    shard.commit_push("a", 1, 1.0, [(key, s.view(torch.ones(4)).clone()) for key, s in shard.owned.items()])
    first = shard.accumulator.first_push_at
    assert not shard.tick(now=first + 60.0) and shard.version == 0  # b has not joined: round 1 stays open
    shard.join(RUN, "b", model_digest(params), params)
    assert not shard.tick(now=first + 61.0)  # now the quorum's grace window starts
    assert shard.tick(now=first + 61.5) and shard.version == 1 and shard.last_round.late == ("b",)
    assert not first_round_waits(2, 1, 2, first, first + 1e6, None)  # only round 1 waits for joins
    assert first_round_waits(1, 1, 2, first, first + 9.9, 10.0) and not first_round_waits(
        1, 1, 2, first, first + 10.0, 10.0
    )
    with pytest.raises(ValueError):
        Shard(0, 1, RUN, min_clusters=2, expect_clusters=1)


def test_the_grace_window_follows_recent_arrival_spreads_within_its_bounds():
    window = GraceWindow(0.5, 8.0, factor=2.0, history=3)
    assert window.seconds() == 8.0  # nothing seen yet: the upper bound
    window.observe(1.0)
    assert window.seconds() == 2.0
    window.observe(0.1)
    assert window.seconds() == 2.0  # the widest recent spread counts
    for _ in range(3):
        window.observe(0.1)
    assert window.seconds() == 0.5  # the lower bound
    for expected in (1.0, 2.0, 4.0, 8.0, 8.0):  # sites missing the window: it doubles back up to the bound
        window.observe(window.seconds())
        assert window.seconds() == expected
    with pytest.raises(ValueError):
        GraceWindow(2.0, 1.0)


def test_time_box_sets_h_from_the_measured_step_time_within_bounds():
    box = RoundTimeBox(10, seconds=2.0, min_steps=2, max_steps=50)
    assert box.steps == 10
    assert box.update(1, compute_s=1.0) == 20  # 0.1 s a step: 20 steps fill 2 s
    assert box.update(2, compute_s=20 * 0.5) == 4  # slowed to 0.5 s a step
    assert box.update(3, compute_s=4 * 4.0) == 2  # the lower bound
    assert box.update(4, compute_s=2 * 0.001) == 50  # the upper bound
    assert box.update(5, compute_s=0.0) == 50  # nothing measured: unchanged


def test_time_box_ends_the_round_by_the_clock_and_its_ranks_agree_at_check_points():
    """The clock ends a time-boxed round, not an H estimated beforehand."""
    one = RoundTimeBox(1000, seconds=60.0, min_steps=1, max_steps=5000, single_process=True)
    one.begin_round(1, time.monotonic())
    assert not any(one.ends_after(n, lambda v: v) for n in range(1, 50))  # far from its box: no end at the estimate
    assert one.steps_to_check(49) == 1  # one process asks the clock after every step
    one.deadline = time.monotonic() - 1  # its time is up (a stall, a slower machine)
    assert one.ends_after(50, lambda v: v)
    # A site of several ranks: the smallest proposal wins, 0 (some rank's box is over) ends the round.
    site = RoundTimeBox(10, seconds=16.0, min_steps=4, max_steps=1000, single_process=False)
    site.begin_round(2, 100.0)
    assert site.next_stride(0, 100.0) == 1  # nothing measured yet: check after one step
    assert site.next_stride(10, 101.0) == 10  # 0.1 s a step, a check every box/16 = 1 s
    assert site.next_stride(155, 115.5) == 5  # near the deadline: check at it
    assert site.next_stride(160, 116.0) == 0  # the box is over
    live = RoundTimeBox(10, seconds=16.0, min_steps=4, max_steps=1000, single_process=False)
    live.begin_round(2, time.monotonic())
    proposals = []
    assert not live.ends_after(1, lambda v: proposals.append(v) or 3)  # the others want to check 3 steps on
    assert live.check_at == 4 and live.steps_to_check(1) == 3 and len(proposals) == 1 and proposals[0] >= 1
    assert not live.ends_after(2, lambda v: pytest.fail("no check between check points"))
    # Time is up at a check before min_steps: the round trains on to min_steps, then ends without asking again.
    late = RoundTimeBox(10, seconds=16.0, min_steps=4, max_steps=1000, single_process=False)
    late.begin_round(3, 100.0)
    assert not late.ends_after(1, lambda v: 0) and late.time_up and late.steps_to_check(1) == 3
    assert late.ends_after(4, lambda v: pytest.fail("time is already up"))
    # max_steps ends a round whatever the clock says.
    capped = RoundTimeBox(10, seconds=1e6, min_steps=1, max_steps=3, single_process=True)
    capped.begin_round(1, time.monotonic())
    assert [capped.ends_after(n, lambda v: v) for n in (1, 2, 3)] == [False, False, True]


def _start_shards(tmp_path, count: int, *flags: str) -> tuple[list[subprocess.Popen], list[str]]:
    procs, addresses = [], []
    for index in range(count):
        port_file = tmp_path / f"shard{index}.port"
        argv = [
            sys.executable,
            "-m",
            "dilocox.common.cli",
            "server",
            "--num-shards",
            str(count),
            "--shard-index",
            str(index),
            "--port",
            "0",
            "--port-file",
            str(port_file),
            "--run-id",
            RUN,
            "--outer-lr",
            str(LR),
            "--outer-momentum",
            str(MOMENTUM),
            "--keep-serving",
            "--insecure",
            "--log-format",
            "json",
            *flags,
        ]
        procs.append(
            subprocess.Popen(
                argv,
                stdout=subprocess.DEVNULL,
                stderr=(tmp_path / f"shard{index}.log").open("w"),
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
        )
        deadline = time.monotonic() + 60
        while not port_file.exists():
            assert procs[-1].poll() is None and time.monotonic() < deadline, (
                tmp_path / f"shard{index}.log"
            ).read_text()
            time.sleep(0.05)
        addresses.append(f"127.0.0.1:{port_file.read_text()}")
    return procs, addresses


def test_shard_processes_on_a_quorum_keep_a_4x_slower_fixed_h_site_in_and_equal_a_replay(tmp_path):
    """`dilocox server --min-clusters 1 --grace-s …` processes, two sites at fixed H, one 4× slower: the
    fast site never waits for it, the slow one is late or pushes to the open round, is never dropped,
    and the shards' weights are a replay of what they accepted."""
    rounds = 6
    procs, addresses = _start_shards(tmp_path, 2, "--min-clusters", "1", "--grace-s", "0.1", "--round-deadline-s", "0")
    try:
        fast, slow = _sites_to_their_end(addresses, rounds, 6)
        assert [r.round for r in fast.reports] == list(range(1, rounds + 1))
        assert slow.reports and all(a.round < b.round for a, b in zip(slow.reports, slow.reports[1:]))
        assert len(slow.reports) < rounds or any(
            r.late for r in slow.reports
        )  # it could not keep up, and did not stop the run
        assert fast.client.traffic.dropped_rounds == 0
        # The slow site may still be training when the shards publish the last version: that one round can go
        # nowhere (`late_work_not_delivered`). Nothing else of it is dropped.
        assert slow.client.traffic.dropped_rounds <= 1
        weights, statuses = _observe(addresses, fast.trainer, rounds)
        assert all(site.member for status in statuses for site in status.sites)  # nobody was dropped
        for index in range(2):
            expected = replay([fast.client, slow.client], index, rounds)
            for key in [k for k in weights if k in expected]:
                assert torch.equal(weights[key], expected[key]), key
    finally:
        _stop(procs)


@pytest.mark.xfail(
    strict=True,
    reason="known: a site slower than the grace window every round pushes to rounds closed by "
    "then; pushing to the shards' open round fixed it but a stalled site's run ended worse in 2 of 3 runs "
    "(global eval 1.066x, 1.136x the unstalled run's, against 0.966x, 0.985x before): docs/decisions.md",
)
def test_an_always_slower_site_pushes_to_the_round_the_shards_have_open_and_is_merged(shard_set):
    """A site slower than the quorum + grace every round once pushed each round's work to the round after
    the version it held — closed rounds ago by then — so its work was carried from refusal to refusal and
    never merged (a 3× slower site of three: 0 of 8 rounds, `dilocox status` ROUNDS MADE 0). Behind, it
    now asks the shards which round is open and pushes there, weighed by its age."""
    shards = shard_set(
        1, "always-slower", min_clusters=1, outer_lr=LR, outer_momentum=MOMENTUM, grace_s=(0.1, 0.1), expect_clusters=2
    )
    shard = shards.shards[0]
    trainer = ToyTrainer(1)
    slow = DilocoCluster(
        trainer,
        AggregatorClient(shards.addresses, "always-slower", "slow", connect_timeout=10, rpc_timeout=30),
        rounds=10,
        inner_steps=1,
        delay=1,
    )
    fast = AggregatorClient(shards.addresses, "always-slower", "fast", connect_timeout=10, rpc_timeout=30)
    try:
        slow.start()
        fast.join([(n, tuple(p.shape)) for n, p in trainer.named_parameters()])
        fast.pull(min_version=0)

        def fast_round(r: int) -> None:
            fast.push(
                r,
                32.0,
                slice_tensors(fast.assignment, {n: 0.01 * torch.ones(p.shape) for n, p in trainer.named_parameters()}),
            )
            shards.wait_version(r)
            fast.pull(min_version=r)

        for r in range(1, 5):  # the slow site trains its round 1 meanwhile
            fast_round(r)
        trainer.train_steps(1)
        slow.close_round(1, 0.0, 32, 0.0)  # round 1 closed long ago: refused, carried; the result pulled is version 4
        for r in (5, 6):  # ... and its round 2
            fast_round(r)
        trainer.train_steps(1)
        with structlog.testing.capture_logs() as logs:
            slow.close_round(2, 0.0, 32, 0.0)  # held 4, the shards' open round 7: its work (and round 1's) goes there
        caught_up = next(e for e in logs if e["event"] == "round_caught_up")
        assert caught_up["pushed"] == 7 and caught_up["staleness"] == 5, caught_up
        fast_round(7)
        assert shard.last_round.clusters == ("fast", "slow") and shard.sites["slow"].rounds_made == 1
        assert shard.sites["slow"].rounds_late >= 5
    finally:
        slow.communicator.close(timeout=5)
        slow.client.close()
        fast.close()
