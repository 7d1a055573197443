"""The shard's round logic and outer update, driven directly (no gRPC)."""

from __future__ import annotations

import threading

import pytest
import torch

from dilocox.common.wire.assignment import model_digest
from dilocox.common.wire.errors import (
    InvalidFrame,
    ModelMismatch,
    NotJoined,
    NotReady,
    RoundNotOpen,
    ShapeMismatch,
    UnknownSlice,
    WrongRun,
)
from dilocox.common.wire.framing import EncodedSlice
from dilocox.common.wire.outer_optimizer import OuterNesterov
from dilocox.server.shard import Shard

PARAMS = [("emb", (12, 5)), ("w", (7, 3)), ("b", (7,)), ("scale", ())]
RUN = "run-test"


def make_shard(num_shards: int = 1, index: int = 0, min_clusters: int = 1) -> Shard:
    return Shard(index, num_shards, RUN, outer_lr=0.7, outer_momentum=0.9, min_clusters=min_clusters)


def full_tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) for name, shape in PARAMS}


def slices_for(shard: Shard, full: dict[str, torch.Tensor]):
    return [(key, s.view(full[s.name]).clone()) for key, s in shard.owned.items()]


def snapshot_state(shard: Shard):
    snap = shard.snapshot
    tensors = {k: v.clone() for k, v in snap.tensors.items()} if snap else None
    momentum = {k: v.clone() for k, v in shard.optimizer.buffers.items()}
    acc = shard.accumulator
    acc_sums = (
        {f"{k}/{c}": v.slice.decode().clone() for k, per in acc.contributions.items() for c, v in per.items()}
        if acc
        else None
    )
    return shard.version, tensors, momentum, acc_sums, dict(shard.members)


def assert_same_state(a, b):
    assert a[0] == b[0]
    for x, y in ((a[1], b[1]), (a[2], b[2]), (a[3], b[3])):
        if x is None or y is None:
            assert x is y
            continue
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(x[k], y[k]), k
    assert a[4] == b[4]


def init(shard: Shard, clusters: list[str], theta0: dict[str, torch.Tensor]) -> None:
    for c in clusters:
        shard.join(RUN, c, model_digest(PARAMS), PARAMS)
    shard.commit_push(clusters[0], 0, 1.0, slices_for(shard, theta0))


def test_outer_nesterov_matches_torch_sgd_over_rounds():
    torch.manual_seed(0)
    param = torch.randn(10, 4)
    ref = torch.nn.Parameter(param.clone())
    opt = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    ours = OuterNesterov(0.7, 0.9)
    current = param.clone()
    for _ in range(6):
        grad = torch.randn(10, 4)
        ref.grad = grad.clone()
        opt.step()
        current = ours.step("p", current, grad)
        # The same formula; ours rounds after every operation (no fused multiply-add, so that every
        # machine rounds alike), torch's SGD may fuse: a few fp32 ulps apart at most.
        torch.testing.assert_close(current, ref.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("num_shards", [1, 3])
def test_shard_update_equals_sgd_nesterov_of_token_weighted_mean(num_shards):
    """Acceptance 2 (core): 3 clusters, unequal token weights, 5 rounds, every shard of the set."""
    clusters = ["a", "b", "c"]
    weights = {"a": 1000.0, "b": 3000.0, "c": 500.0}
    theta0 = full_tensors(1)
    shards = [make_shard(num_shards, i, min_clusters=3) for i in range(num_shards)]
    for shard in shards:
        init(shard, clusters, theta0)

    ref_params = {n: torch.nn.Parameter(t.clone()) for n, t in theta0.items()}
    opt = torch.optim.SGD(list(ref_params.values()), lr=0.7, momentum=0.9, nesterov=True)
    for round_ in range(1, 6):
        deltas = {c: full_tensors(100 * round_ + i) for i, c in enumerate(clusters)}
        total = sum(weights.values())
        for name, p in ref_params.items():
            p.grad = sum(weights[c] * deltas[c][name] for c in clusters) / total
        opt.step()
        for shard in shards:
            for c in clusters:
                result = shard.commit_push(c, round_, weights[c], slices_for(shard, deltas[c]))
            assert result.round_closed and shard.version == round_
        for shard in shards:
            for key, tensor in shard.snapshot.tensors.items():
                expected = shard.owned[key].view(ref_params[key.name].detach())
                torch.testing.assert_close(tensor, expected, rtol=1e-6, atol=1e-6)


def test_round_waits_for_every_member_and_min_clusters():
    shard = make_shard(min_clusters=2)
    init(shard, ["a"], full_tensors(0))
    delta = full_tensors(5)
    assert not shard.commit_push("a", 1, 10.0, slices_for(shard, delta)).round_closed  # below min_clusters
    shard.join(RUN, "b", model_digest(PARAMS), PARAMS)
    assert shard.status()["contributed"] == ["a"]
    assert shard.commit_push("b", 1, 10.0, slices_for(shard, delta)).round_closed
    assert shard.version == 1 and shard.open_round == 2


def test_partial_pushes_from_several_streams_complete_a_cluster():
    """A pipeline-parallel cluster sends its slices from several ranks; the round closes once all are in."""
    shard = make_shard()
    init(shard, ["a"], full_tensors(0))
    slices = slices_for(shard, full_tensors(3))
    assert not shard.commit_push("a", 1, 7.0, slices[:2]).round_closed
    assert shard.commit_push("a", 1, 7.0, slices[2:]).round_closed


def test_retried_push_is_not_double_counted():
    theta0, delta = full_tensors(0), full_tensors(9)
    once, twice = make_shard(min_clusters=2), make_shard(min_clusters=2)
    for shard in (once, twice):
        init(shard, ["a", "b"], theta0)
    once.commit_push("a", 1, 5.0, slices_for(once, delta))
    twice.commit_push("a", 1, 5.0, slices_for(twice, delta))
    retry = twice.commit_push("a", 1, 5.0, slices_for(twice, delta))
    assert retry.accepted == 0 and retry.duplicate == len(twice.owned)
    for shard in (once, twice):
        shard.commit_push("b", 1, 5.0, slices_for(shard, full_tensors(10)))
    for key in once.owned:
        assert torch.equal(once.snapshot.tensors[key], twice.snapshot.tensors[key])


def test_refusals_leave_state_unchanged():
    shard = make_shard(min_clusters=2)
    init(shard, ["a", "b"], full_tensors(0))
    shard.commit_push("a", 1, 5.0, slices_for(shard, full_tensors(1)))
    before = snapshot_state(shard)
    good = slices_for(shard, full_tensors(2))
    key0, t0 = good[0]

    cases = [
        (ModelMismatch, "does not match", lambda: shard.join(RUN, "z", model_digest([("x", (1,))]), [("x", (1,))])),
        (WrongRun, "not 'other'", lambda: shard.check_push("other", "b", 1, 5.0)),
        (NotJoined, "has not joined", lambda: shard.check_push(RUN, "stranger", 1, 5.0)),
        (RoundNotOpen, "round 3 is not open yet", lambda: shard.commit_push("b", 3, 5.0, good)),
        (RoundNotOpen, r"round 0 \(initial weights\) is closed", lambda: shard.commit_push("b", 0, 5.0, good)),
        (UnknownSlice, "does not own", lambda: shard.commit_push("b", 1, 5.0, [(key0.__class__("nope", 0, 1), t0)])),
        (ShapeMismatch, "expected shape", lambda: shard.commit_push("b", 1, 5.0, [(key0, torch.zeros(99))])),
        (InvalidFrame, "positive finite", lambda: shard.commit_push("b", 1, -1.0, good)),
        (InvalidFrame, "twice", lambda: shard.commit_push("b", 1, 5.0, good + good[:1])),
        (InvalidFrame, "already pushed round 1 with weight 5.0", lambda: shard.commit_push("a", 1, 6.0, good)),
    ]
    for error_type, message, call in cases:
        with pytest.raises(error_type, match=message):
            call()
        assert_same_state(before, snapshot_state(shard))
    assert len({e.status for e in (ModelMismatch, RoundNotOpen, UnknownSlice)}) == 3


def test_pull_waits_for_the_round_and_times_out_cleanly():
    shard = make_shard()
    init(shard, ["a"], full_tensors(0))
    with pytest.raises(NotReady, match="holds version 0, not 1"):
        shard.wait_for_version(RUN, "a", 1, timeout=0.05)
    got = []
    waiter = threading.Thread(target=lambda: got.append(shard.wait_for_version(RUN, "a", 1, timeout=10)))
    waiter.start()
    shard.commit_push("a", 1, 1.0, slices_for(shard, full_tensors(4)))
    waiter.join(timeout=10)
    assert got and got[0].version == 1


def test_late_push_for_closed_round_is_refused():
    shard = make_shard()
    init(shard, ["a", "b"], full_tensors(0))
    shard.min_clusters = 1
    shard.members.pop("b")  # b missed the round: it closes with a alone
    shard.commit_push("a", 1, 1.0, slices_for(shard, full_tensors(4)))
    shard.members["b"] = 0.0
    with pytest.raises(RoundNotOpen, match="round 1 is closed; the open round is 2"):
        shard.commit_push("b", 1, 1.0, slices_for(shard, full_tensors(4)))


def test_a_retried_push_the_round_closed_with_is_a_duplicate_not_refused():
    """Its reply was lost: "refused" would make the cluster carry it into the next round, twice delivered."""
    shard = make_shard()
    init(shard, ["a"], full_tensors(0))
    shard.commit_push("a", 1, 1.0, slices_for(shard, full_tensors(4)))
    published = shard.snapshot
    shard.check_push(RUN, "a", 1, 1.0)
    again = shard.commit_push("a", 1, 1.0, slices_for(shard, full_tensors(4)))
    assert (again.accepted, again.duplicate, again.round_closed) == (0, len(shard.owned), False)
    assert shard.snapshot is published and shard.version == 1


def test_deadline_closes_the_round_with_complete_clusters_and_drops_the_rest():
    """A cluster that misses the deadline is marked inactive; its partial push is not mixed in."""
    shard = Shard(0, 1, RUN, outer_lr=0.7, outer_momentum=0.9, min_clusters=2, round_deadline_s=5.0)
    init(shard, ["a", "b", "c"], full_tensors(0))
    theta0 = {k: v.clone() for k, v in shard.snapshot.tensors.items()}
    da, db, dc = full_tensors(1), full_tensors(2), full_tensors(3)
    shard.commit_push("a", 1, 10.0, slices_for(shard, da))
    shard.commit_push("b", 1, 30.0, slices_for(shard, db))
    shard.commit_push("c", 1, 20.0, slices_for(shard, dc)[:1])  # c dies mid-push
    started = shard.accumulator.first_push_at
    assert not shard.tick(now=started + 4.9) and shard.version == 0  # before the deadline: keep waiting
    assert shard.tick(now=started + 5.0) and shard.version == 1
    assert shard.status()["clusters"] == ["a", "b"]
    assert shard.dropped_bytes == len(
        EncodedSlice.exact(*slices_for(shard, dc)[0]).payload
    )  # c's partial push, counted

    reference = OuterNesterov(0.7, 0.9)
    for key, s in shard.owned.items():
        grad = (10.0 * s.view(da[s.name]) + 30.0 * s.view(db[s.name])) / 40.0
        torch.testing.assert_close(
            shard.snapshot.tensors[key], reference.step(key, theta0[key], grad), rtol=1e-6, atol=1e-7
        )

    with pytest.raises(NotJoined):  # c's late push is refused, never mixed into round 2
        shard.check_push(RUN, "c", 1, 20.0)
    shard.join(RUN, "c", model_digest(PARAMS), PARAMS)  # c comes back and takes part from round 2
    shard.commit_push("a", 2, 10.0, slices_for(shard, da))
    shard.commit_push("b", 2, 10.0, slices_for(shard, db))
    assert shard.version == 1  # round 2 waits for the rejoined c
    assert shard.commit_push("c", 2, 10.0, slices_for(shard, dc)).round_closed


def test_deadline_never_closes_below_min_clusters():
    shard = Shard(0, 1, RUN, min_clusters=2, round_deadline_s=0.01)
    init(shard, ["a", "b"], full_tensors(0))
    shard.commit_push("a", 1, 1.0, slices_for(shard, full_tensors(1)))
    assert not shard.tick(now=shard.accumulator.first_push_at + 100)
    assert shard.version == 0 and shard.status()["clusters"] == ["a", "b"]


def test_a_published_version_never_changes_while_a_pull_holds_it():
    """Snapshots share the optimiser's tensors instead of copying them each round. While a pull holds a
    version (it streams it) the close builds new tensors; with no pull holding it, the close updates the
    weights and momentum in place, so a shard needs one copy of them instead of two. Same numbers."""
    shard, twin = make_shard(), make_shard()
    for s in (shard, twin):
        init(s, ["a"], full_tensors(0))
        s.commit_push("a", 1, 1.0, slices_for(s, full_tensors(1)))
    held = shard.wait_for_version(RUN, "a", 1, timeout=1, hold=True)
    kept = {k: (held.tensors[k].clone(), held.momentum[k].clone()) for k in held.momentum}
    shard.commit_push("a", 2, 1.0, slices_for(shard, full_tensors(2)))
    assert shard.version == 2 and kept
    assert all(torch.equal(held.tensors[k], t) and torch.equal(held.momentum[k], m) for k, (t, m) in kept.items())
    shard.release(held)
    v2 = shard.snapshot
    shard.commit_push("a", 3, 1.0, slices_for(shard, full_tensors(3)))  # nobody holds version 2: in place
    assert all(shard.snapshot.tensors[k] is v2.tensors[k] for k in v2.momentum)
    twin.commit_push("a", 2, 1.0, slices_for(twin, full_tensors(2)))
    twin.commit_push("a", 3, 1.0, slices_for(twin, full_tensors(3)))
    for k in shard.snapshot.tensors:  # both forms round alike
        assert torch.equal(shard.snapshot.tensors[k], twin.snapshot.tensors[k])
        if k in shard.snapshot.momentum:
            assert torch.equal(shard.snapshot.momentum[k], twin.snapshot.momentum[k])


def test_a_round_is_stepped_outside_the_lock_and_nothing_sees_it_half_done(tmp_path):
    """The close decides and seals the round under the lock, steps it outside (at model size that takes
    seconds) and publishes under the lock. While it steps: status and joins are answered, the round is
    closed to pushes (a retry of an included push is a duplicate), the version being updated in place is
    handed to no pull and written by no checkpoint; the published bits are those of a shard that closed
    the same round with nobody else around."""
    from dilocox.server.state.checkpoint import Checkpointer

    shard = Shard(0, 1, RUN, 0.7, 0.9, min_clusters=1, round_deadline_s=5.0)
    init(shard, ["a", "b"], full_tensors(0))
    started, go = threading.Event(), threading.Event()
    real_step = shard._step_round

    def slow_step(closing):  # the step parks until the test has looked around
        started.set()
        assert go.wait(30)
        return real_step(closing)

    shard._step_round = slow_step
    shard.commit_push("a", 1, 2.0, slices_for(shard, full_tensors(1)))
    first = shard.accumulator.first_push_at
    closer = threading.Thread(target=shard.tick, kwargs={"now": first + 5.0})  # deadline: closes with a alone
    closer.start()
    assert started.wait(30)
    try:
        assert shard.status()["version"] == 0  # answered: the lock is free while the round is stepped
        assert shard.commit_push("a", 1, 2.0, slices_for(shard, full_tensors(1))).duplicate == len(shard.owned)
        shard.check_push(RUN, "a", 1, 2.0)  # a's retry is let through, to be answered as duplicates
        shard.join(RUN, "c", model_digest(PARAMS), PARAMS)  # a join is answered too
        with pytest.raises(RoundNotOpen, match="closed"):
            shard.check_push(RUN, "c", 1, 2.0)  # nothing new enters the round being stepped
        with pytest.raises(NotReady):  # version 0 is being updated in place: no pull gets it half done
            shard.wait_for_version(RUN, "c", 0, timeout=0.2, hold=True)
        saved = threading.Thread(target=Checkpointer(shard, tmp_path).save_now)
        saved.start()
        saved.join(0.3)
        assert saved.is_alive()  # the checkpoint waits for the publish
    finally:
        go.set()
    closer.join(30)
    saved.join(30)
    assert shard.version == 1 and shard.last_round.clusters == ("a",)
    from dilocox.server.state import checkpoint

    assert checkpoint.load(checkpoint.checkpoint_path(tmp_path, 0))["snapshot"]["version"] == 1
    held = shard.wait_for_version(RUN, "c", 0, timeout=1, hold=True)
    assert held.version == 1
    shard.release(held)
    twin = Shard(0, 1, RUN, 0.7, 0.9, min_clusters=1, round_deadline_s=5.0)
    init(twin, ["a", "b"], full_tensors(0))
    twin.commit_push("a", 1, 2.0, slices_for(twin, full_tensors(1)))
    assert twin.tick(now=twin.accumulator.first_push_at + 5.0)
    for key in shard.snapshot.tensors:
        assert torch.equal(shard.snapshot.tensors[key], twin.snapshot.tensors[key])
        assert torch.equal(shard.snapshot.momentum[key], twin.snapshot.momentum[key])


def test_a_sites_second_rank_pushing_caught_up_work_is_checked_with_its_own_staleness():
    """A late site's ranks push their parts of the open round with the same staleness: the
    check before the chunks are read takes the header's staleness, so the second rank's part is let in
    (it was refused as "staleness 2, now 0", and the site exited: found by tests/test_late_site_ranks.py);
    a part saying another staleness than the first is still refused."""
    from dilocox.common.wire.errors import InvalidFrame

    shard = make_shard()
    init(shard, ["a", "b"], full_tensors(0))
    slices = slices_for(shard, full_tensors(1))
    shard.commit_push("a", 1, 10.0, slices[:1], staleness=2)  # rank 0's part
    shard.check_push(RUN, "a", 1, 10.0, 2)  # rank 1's header: the same weight and staleness
    shard.commit_push("a", 1, 10.0, slices[1:], staleness=2)
    with pytest.raises(InvalidFrame, match="staleness 2, now 0"):
        shard.check_push(RUN, "a", 1, 10.0, 0)
