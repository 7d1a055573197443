"""How a shard takes a push (the half of `Shard` that fills the open round): the check of a push's header
before any chunk is read, the vetting of each announced slice, and the commit of a decoded push into the
round's accumulator — all of it or nothing — or, for round 0, into the initial weights. A retried push
whose round already closed with it is answered as duplicates. Mixed into `Shard` as `PullServing` and
`RoundClosing` are, using its state and lock (`_cond`, `owned`, `accumulator`, `snapshot`, `members`, …)
defined in `Shard.__init__`; its own module so that the core keeps to state, membership and status."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import structlog
import torch

from dilocox.common.wire import codecs
from dilocox.common.wire.assignment import ParamSlice
from dilocox.common.wire.errors import InvalidFrame, NotJoined, RoundNotOpen, RunOver, ShapeMismatch, UnknownSlice
from dilocox.common.wire.framing import EncodedSlice, SliceKey
from dilocox.server.rounds.round_close import SiteRecord
from dilocox.server.rounds.round_state import RoundAccumulator
from dilocox.server.shard_records import PushResult, Snapshot
from dilocox.server.state.provenance_chain import digest_payloads, init_record, version_digests

log = structlog.get_logger("dilocox.shard")


class PushCommitting:
    """Mixed into `Shard`: the push side of its core."""

    def check_push(self, run_id: str, cluster: str, round_: int, weight: float, staleness: int = 0) -> None:
        """Refuse a push before any chunk is read: wrong run, unknown cluster, round not open, or a weight or
        staleness other than the cluster's earlier pushes to this round said (its other ranks' parts)."""
        self._check_run(run_id)
        with self._cond:
            if self._included_in_published(cluster, round_):
                return  # a retry of a push the round was closed with: answered as duplicates
            if cluster not in self.members:
                raise NotJoined(f"cluster {cluster!r} has not joined shard {self.shard_index}")
            self._check_round(cluster, round_)
            if round_ > 0 and self.accumulator is not None:
                self.accumulator.check_weight(cluster, weight, staleness)

    def owned_slice(self, key: SliceKey, shape: tuple[int, ...]) -> ParamSlice:
        """The owned slice `key`; refuses a slice this shard does not own or one with the wrong shape."""
        owned = self.owned.get(key)
        if owned is None:
            raise UnknownSlice(f"shard {self.shard_index} does not own {key}; check the parameter assignment")
        if tuple(shape) != owned.slice_shape:
            raise ShapeMismatch(f"{key}: expected shape {list(owned.slice_shape)}, got {list(shape)}")
        return owned

    def vet_slice(self, key: SliceKey, codec: str, shape: tuple[int, ...]) -> int:
        """Check a slice announced by a stream's first chunk; return the payload byte limit for its codec."""
        return codecs.max_payload_bytes(codec, self.owned_slice(key, shape).slice_shape)

    def commit_push(
        self,
        cluster: str,
        round_: int,
        weight: float,
        slices: Iterable[EncodedSlice | tuple[SliceKey, torch.Tensor]],
        bytes_in: int = 0,
        inner_steps: int = 0,
        idle_s: float = 0.0,
        staleness: int = 0,
    ) -> PushResult:
        """Apply a fully decoded and vetted push atomically: all of it, or (on an error) nothing.

        `slices` are the encoded slices as they travelled (or plain (key, tensor) pairs, taken as exact
        fp32); each must decode to a finite tensor of the owned shape. `inner_steps`, `idle_s`: what the
        site says of the round (kept for `dilocox status`). `staleness`: how many rounds older than `round_`
        the work is (a late site catching up; its weight is capped at the close, server/rounds/round_state.py).
        """
        encoded = [s if isinstance(s, EncodedSlice) else EncodedSlice.exact(*s) for s in slices]
        for item in encoded:
            self.owned_slice(item.key, item.shape)
        if len({item.key for item in encoded}) != len(encoded):
            raise InvalidFrame("the same slice appears twice in one push")
        if round_ > 0:
            digest_payloads(encoded)  # for the rounds chain's record, here rather than under the lock at the close
        with self._cond:
            if self._included_in_published(cluster, round_, [item.key for item in encoded]):
                return PushResult(round_, 0, len(encoded), False)
            self._check_round(cluster, round_)
            self.bytes_in += bytes_in
            if round_ == 0:
                return self._commit_init(cluster, encoded)
            acc = self._open_accumulator()
            acc.check_weight(cluster, weight, staleness)
            fresh = [item for item in encoded if not acc.is_duplicate(cluster, item.key)]
            for item in fresh:
                acc.add(cluster, weight, item, staleness, held=self.held_by.get(cluster))
            self.last_seen[cluster] = time.monotonic()
            self.sites.setdefault(cluster, SiteRecord()).said(inner_steps, idle_s)
            acc.bytes_in += bytes_in
            log.info(
                "push_accepted",
                shard=self.shard_index,
                cluster=cluster,
                round=round_,
                slices=len(fresh),
                duplicates=len(encoded) - len(fresh),
                bytes_in=bytes_in,
                **({"staleness": staleness} if staleness else {}),
            )
        closed = self._close_if_due()  # the reply waits for the publish, as a pull of this round would
        return PushResult(round_, len(fresh), len(encoded) - len(fresh), closed)

    def _commit_init(self, cluster: str, slices: list[EncodedSlice]) -> PushResult:
        if self.initialiser != cluster:
            raise RoundNotOpen(f"round 0 (initial weights) belongs to {self.initialiser!r}, not {cluster!r}")
        fresh = [item for item in slices if item.key not in self._init_staging]
        for item in fresh:
            # A view of the pushed fp32 bytes (the buffer is the shard's alone from here): no second copy.
            self._init_staging[item.key] = item.decode().to(torch.float32)
        closed = False
        if set(self._init_staging) >= set(self.owned):
            tensors = dict(self._init_staging)
            digests = version_digests(tensors, {})
            self.chain.append(init_record(cluster, digests, (self.optimizer.lr, self.optimizer.momentum)))
            self._publish(Snapshot(0, tensors, digests=dict(digests.per_slice)))
            self._init_staging = {}
            closed = True
            log.info("initialised", shard=self.shard_index, by=cluster, elements=self.num_elements)
            self._notify_waiters()
        return PushResult(0, len(fresh), len(slices) - len(fresh), closed)

    def _included_in_published(self, cluster: str, round_: int, keys: Sequence[SliceKey] | None = None) -> bool:
        """Whether the version just published holds this cluster's contribution for round `round_` (for
        every one of `keys`, if given). A push whose reply was lost is retried after the round closed;
        it must be told "duplicate", not "round closed", because a cluster keeps a refused contribution
        to deliver it next round, and would then deliver it twice."""
        snapshot, closing = self.snapshot, self._round_closing
        if closing is not None and closing.acc.round == round_:
            contributions = closing.acc.contributions  # sealed: what the version being stepped is made of
        elif round_ >= 1 and snapshot is not None and snapshot.version == round_:
            contributions = snapshot.contributions
        else:
            return False
        if keys is None:
            return any(cluster in per_key for per_key in contributions.values())
        return bool(keys) and all(cluster in contributions.get(key, {}) for key in keys)

    def _open_accumulator(self) -> RoundAccumulator:
        if self.accumulator is None or self.accumulator.round != self.open_round:
            self.accumulator = RoundAccumulator(self.open_round)
        return self.accumulator

    def _check_round(self, cluster: str, round_: int) -> None:
        if round_ == 0:
            if self.snapshot is not None:
                raise RoundNotOpen(f"round 0 (initial weights) is closed; the open round is {self.open_round}")
            return
        if self.snapshot is None:
            raise RoundNotOpen(
                f"shard {self.shard_index} is waiting for its initial weights (round 0), got a push for round {round_}"
            )
        final = self.final_version
        if final is not None and round_ > final:
            raise RunOver(
                f"run {self.run_id!r} ends at version {final}: round {round_} is past it. To train longer, restart "
                'every shard with --resume --rounds N first (docs/deploy.md, "Train longer")'
            )
        if self._round_closing is not None and round_ == self._round_closing.acc.round:
            raise RoundNotOpen(
                f"round {round_} is closed (its version is being computed); the open round is {round_ + 1}"
            )
        if round_ != self.open_round:
            when = "closed" if round_ < self.open_round else "not open yet"
            raise RoundNotOpen(f"round {round_} is {when}; the open round is {self.open_round}")
