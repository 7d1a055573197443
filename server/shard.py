"""One aggregation shard's state and rules, as a plain thread-safe Python class.

The gRPC servicer is a thin adapter over `Shard`; everything a test wants to check about rounds,
membership and the outer update can be driven here directly, without sockets.

Lifecycle of the weights: the first cluster to join is the *initialiser* and pushes its freshly
initialised parameters as round 0 (so shards need no model code and serve any architecture); that
makes version 0. Round t ≥ 1 collects the clusters' pseudo-gradients; when every active cluster has
delivered every slice this shard owns (and at least `min_clusters` have), the shard averages them by
tokens, applies the outer Nesterov step and publishes version t. Published weights are immutable
tensors, so a pull streaming version t is never torn by the close of round t+1.

`Shard` holds the state, membership and status; its halves are mixins over that state and lock: the push
side (a push checked and committed into the open round, server/serving/shard_pushes.py), the pull side
(server/serving/shard_pulls.py) and the close (server/rounds/shard_close.py).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence

import structlog
import torch

from dilocox.common.wire.assignment import ParamSlice, SliceMap, assign_slices, model_digest, slices_of_shard
from dilocox.common.wire.errors import InvalidFrame, ModelMismatch, NotReady, WrongRun
from dilocox.common.wire.framing import SliceKey
from dilocox.common.wire.outer_optimizer import OuterNesterov
from dilocox.common.wire.staleness import DEFAULT_MAX_WEIGHT_MULTIPLE
from dilocox.server.checks.robust_mean import AggregateConfig
from dilocox.server.checks.update_check import UpdateCheck, UpdateCheckConfig
from dilocox.server.rounds.grace import GraceWindow
from dilocox.server.rounds.recent_rounds import RecentRounds
from dilocox.server.rounds.round_close import SiteRecord
from dilocox.server.rounds.round_state import RoundAccumulator
from dilocox.server.rounds.shard_close import RoundClosing
from dilocox.server.serving.shard_pulls import PullServing
from dilocox.server.serving.shard_pushes import PushCommitting
from dilocox.server.shard_records import JoinResult, RoundStats, SealedRound, Snapshot
from dilocox.server.state.provenance_chain import RoundsChain
from dilocox.server.state.run_record import RecordedRun, admit_tokenizer, extended_run_config

log = structlog.get_logger("dilocox.shard")
CHECKPOINT_UNSAVED = {
    "checkpoint_failures": 0,
    "checkpoint_failing_rounds": 0,
    "checkpoint_error": "",
}  # no --checkpoint-dir
# Versions whose contributions a shard keeps for sites that come back behind (a restart): `--keep-rounds`.
DEFAULT_KEEP_ROUNDS = 4


class Shard(RoundClosing, PushCommitting, PullServing):
    def __init__(
        self,
        shard_index: int,
        num_shards: int,
        run_id: str,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        min_clusters: int = 1,
        round_deadline_s: float | None = None,
        grace: GraceWindow | None = None,
        expect_clusters: int | None = None,
        keep_rounds: int = DEFAULT_KEEP_ROUNDS,
        update_check: UpdateCheckConfig | None = None,
        operator_token: str | None = None,
        max_weight_multiple: float = DEFAULT_MAX_WEIGHT_MULTIPLE,
        aggregate: AggregateConfig | None = None,
    ) -> None:
        """`round_deadline_s`: once a round's first contribution is in, close it after this long with the
        clusters that completed (at least `min_clusters`); the others are marked inactive.
        `grace`: close on a quorum instead — `min_clusters` complete, then the grace window — keeping
        late members (server/rounds/round_close.py); the deadline then only marks silent members gone.
        `expect_clusters` (default `min_clusters`): the run's first round does not close before this many
        clusters have joined (`round_close.first_round_waits`).
        `keep_rounds`: the contributions of this many of the newest versions are kept, so a site up to that
        many versions behind (a restart from its checkpoint, a late site) replays them instead of pulling the
        weights and momentum in full; they cost their compressed bytes in memory.
        `update_check`: how each site's update is looked at before the merge (server/checks/update_check.py;
        default: warn). `operator_token`: what an operator's readmission must carry (none: refused).
        `max_weight_multiple`: a site's weight in a round's mean is at most this many times the median of the
        other sites' said tokens (tokens are a claim; common/wire/staleness.py; 0: as said). `aggregate`: the
        round's mean, or its clipped mean (server/checks/robust_mean.py)."""
        if not 0 <= shard_index < num_shards:
            raise ValueError(f"shard_index {shard_index} outside [0, {num_shards})")
        if min_clusters < 1:
            raise ValueError(f"min_clusters must be ≥ 1, got {min_clusters}")
        self.shard_index = shard_index
        self.num_shards = num_shards
        self.run_id = run_id
        self.min_clusters = min_clusters
        self.expect_clusters = min_clusters if expect_clusters is None else expect_clusters
        if self.expect_clusters < min_clusters:
            raise ValueError(f"expect_clusters ({self.expect_clusters}) must be ≥ min_clusters ({min_clusters})")
        if round_deadline_s is not None and round_deadline_s <= 0:
            raise ValueError(f"round deadline must be positive, got {round_deadline_s}")
        self.round_deadline_s = round_deadline_s
        if max_weight_multiple != 0 and not max_weight_multiple >= 1:
            raise ValueError(f"--max-weight-multiple must be ≥ 1 (or 0: off), got {max_weight_multiple}")
        self.max_weight_multiple = max_weight_multiple
        self.aggregate = aggregate or AggregateConfig()
        self.grace = grace
        self.optimizer = OuterNesterov(outer_lr, outer_momentum)
        check = update_check or UpdateCheckConfig()
        self.update_check = UpdateCheck(check) if check.mode != "off" else None
        self.operator_token = operator_token
        self._cond = threading.Condition()
        # Fixed by the first join:
        self.digest: str | None = None
        self.tokenizer_digest = ""  # the run's tokenizer ("byte" or "sha256:…"), recorded at the first join
        self.tokenizer_json = ""
        self.param_specs: list[tuple[str, tuple[int, ...]]] = []
        self.assignment: list[ParamSlice] = []
        self.owned: dict[SliceKey, ParamSlice] = {}
        self.slice_map = SliceMap.of([])  # the run's slices by position: what bundles name them by
        self.run_config_json = ""
        # Membership and rounds:
        self.members: dict[str, float] = {}  # cluster -> time of (re)join
        self.last_seen: dict[str, float] = {}  # cluster -> monotonic time of its last join or accepted push
        self.sites: dict[str, SiteRecord] = {}  # cluster -> its rounds as this shard saw them
        self.initialiser: str | None = None
        self._init_staging: dict[SliceKey, torch.Tensor] = {}
        self.snapshot: Snapshot | None = None
        self.recent = RecentRounds(keep_rounds)  # the contributions of the versions before `snapshot`
        self.accumulator: RoundAccumulator | None = None
        self._round_closing: SealedRound | None = None  # a round sealed and being stepped outside the lock
        self.bytes_in = 0
        self.bytes_out = 0
        self.dropped_bytes = 0  # partial contributions discarded when a deadline closed a round without them
        self.rounds_overruled = (
            0  # rounds the update check flagged more of than it may act on (server/checks/update_check.py)
        )
        self.last_round: RoundStats | None = None  # set just before the round's version is published
        # Called (under the shard's lock) with every newly published version, e.g. to checkpoint it.
        self.on_publish: Callable[[Snapshot], None] | None = None
        self.checkpoint_health = (
            None  # server/state/checkpoint.py's CheckpointHealth, where a checkpointer saves this shard
        )
        self.closing = False  # set by close(): held pulls return at once
        # Called (from any thread) whenever waiting pulls should look again: a publish, a join, a close.
        # The grpc.aio server parks its pulls on these instead of a thread each (server/serving/aio_servicer.py).
        self.version_listeners: list[Callable[[], None]] = []
        self.known: set[str] = set()  # every cluster that ever joined (members drop the inactive ones)
        self._recorded: RecordedRun | None = None  # the recorded run configuration, parsed
        # Clusters that have pulled the run's final version; once every member has, `on_finished` runs
        # (`dilocox server` stops itself then, unless --keep-serving).
        self.pulled_final: dict[str, set[str]] = {}  # cluster -> names of owned slices it pulled at the final version
        self.on_finished: Callable[[], None] | None = None
        self.replay_mismatches: dict[str, int] = {}  # cluster -> replays that differed, as it last reported
        self.held_by: dict[
            str, int
        ] = {}  # cluster -> the newest version it pulled from this shard (since this process started)
        self._digest_lock = threading.Lock()  # one computation of a version's digests, however many pull
        self._readers: dict[int, int] = {}  # id(snapshot) -> pulls streaming it (the close then copies)
        self.chain = RoundsChain(
            run_id, shard_index, num_shards
        )  # one record per published version (server/state/provenance_chain.py)

    # ------------------------------------------------------------------ membership
    def join(
        self,
        run_id: str,
        cluster: str,
        digest: str,
        params: Sequence[tuple[str, Sequence[int]]],
        run_config_json: str = "",
        tokenizer_digest: str = "",
        tokenizer_json: str = "",
    ) -> JoinResult:
        self._check_run(run_id)
        if not cluster:
            raise InvalidFrame("cluster name must not be empty")
        if model_digest(params) != digest:
            raise ModelMismatch("model digest does not match the parameter list sent with it")
        with self._cond:
            if self.digest is None:
                self.digest = digest
                self.param_specs = [(name, tuple(int(d) for d in shape)) for name, shape in params]
                self.use_assignment(self.param_specs)
                self.run_config_json = run_config_json or json.dumps({})
            elif digest != self.digest:
                raise ModelMismatch(
                    f"model digest {digest[:12]}… does not match this run's {self.digest[:12]}…: "
                    "the cluster's model has different parameter names or shapes"
                )
            recorded = (self.tokenizer_digest, self.tokenizer_json)
            self.tokenizer_digest, self.tokenizer_json = admit_tokenizer(
                recorded, cluster, tokenizer_digest, tokenizer_json
            )
            if not recorded[0] and self.tokenizer_digest:
                log.info(
                    "run_tokenizer_recorded",
                    shard=self.shard_index,
                    cluster=cluster,
                    tokenizer=self.tokenizer_digest[:19],
                )
            rejoin = cluster in self.members or cluster in self.known
            self.members[cluster] = time.time()
            self.last_seen[cluster] = time.monotonic()
            self.known.add(cluster)
            if self.snapshot is None and self.initialiser is None:
                self.initialiser = cluster
            needs_init = self.snapshot is None and self.initialiser == cluster
            version = self.snapshot.version if self.snapshot else -1
            log.info(
                "cluster_joined",
                shard=self.shard_index,
                cluster=cluster,
                rejoin=rejoin,
                version=version,
                initialiser=needs_init,
            )
            self._notify_waiters()
            return JoinResult(
                cluster, version, needs_init, list(self.assignment), self.run_config_json, rejoin, self.tokenizer_digest
            )

    def describe(self, run_id: str) -> JoinResult:
        """What a read-only observer (`dilocox export`) needs: the slice map, the run's config and the
        version held. Registers nothing: no round ever waits for an observer."""
        self._check_run(run_id)
        with self._cond:
            if self.digest is None:
                raise NotReady(
                    f"shard {self.shard_index} holds no model yet: no cluster has joined run {self.run_id!r}"
                )
            return JoinResult(
                "",
                self.version,
                False,
                list(self.assignment),
                self.run_config_json,
                False,
                self.tokenizer_digest,
                self.tokenizer_json,
            )

    def use_assignment(self, params: Sequence[tuple[str, tuple[int, ...]]]) -> None:
        """Split the run's parameters into slices (deterministic: every shard and cluster gets the same
        map) and derive what this shard owns and the slices' positions."""
        self.assignment = assign_slices(params, self.num_shards)
        self.owned = {s.key: s for s in slices_of_shard(self.assignment, self.shard_index)}
        self.slice_map = SliceMap.of(self.assignment)

    # ------------------------------------------------------------------ versions
    @property
    def version(self) -> int:
        return self.snapshot.version if self.snapshot else -1

    @property
    def open_round(self) -> int:
        return self.version + 1

    def _publish(self, snapshot: Snapshot) -> None:
        self.recent.published(self.snapshot, snapshot)
        self.snapshot = snapshot
        if self.on_publish is not None:
            try:
                self.on_publish(snapshot)
            except Exception as error:  # noqa: BLE001 - a hook (checkpoint, metrics) never fails the round it reports
                log.error(
                    "on_publish_failed",
                    shard=self.shard_index,
                    version=snapshot.version,
                    error=repr(error),
                    effect="the version is published and served all the same",
                )

    def _notify_waiters(self) -> None:
        """Wake every waiting pull (call under the lock): the condition's, and the listeners'."""
        self._cond.notify_all()
        for listener in self.version_listeners:
            listener()

    # ------------------------------------------------------------------ pulls: server/serving/shard_pulls.py
    def close(self) -> None:
        """Stopping: every held pull is answered now (UNAVAILABLE, which clients retry) instead of at the
        end of its wait, so SIGTERM does not keep the process alive for a pull's 30 s."""
        with self._cond:
            self.closing = True
            self._notify_waiters()

    # ------------------------------------------------------------------ status
    @property
    def num_elements(self) -> int:
        return sum(s.numel for s in self.owned.values())

    @property
    def recorded(self) -> RecordedRun:
        """The recorded run configuration's figures, parsed once per configuration (server/state/run_record.py)."""
        if self._recorded is None or self._recorded.source != self.run_config_json:
            self._recorded = RecordedRun.of(self.run_config_json)
        return self._recorded

    @property
    def final_version(self) -> int | None:
        """The run's last version, from the run configuration its first cluster sent; None if unknown."""
        return self.recorded.final_version

    @property
    def stale_rule(self) -> str:
        """How the run weighs late work (its sites' --stale-weighting), from the recorded run configuration."""
        return self.recorded.stale_rule

    def extend_rounds(self, rounds: int) -> None:
        """Raise the run's rounds (and so its final version) to `rounds`: `dilocox server --resume --rounds N`.
        Everything else of the run stays: weights, outer momentum, membership. Refuses to shorten a run."""
        with self._cond:
            final_before = self.final_version
            try:
                self.run_config_json, before = extended_run_config(self.run_config_json, rounds)
            except ValueError as error:
                raise ValueError(f"shard {self.shard_index}: {error}") from None
            log.info(
                "run_extended",
                shard=self.shard_index,
                rounds_before=before,
                rounds=rounds,
                final_version_before=final_before,
                final_version=self.final_version,
                version=self.version,
            )

    def status(self) -> dict:
        with self._cond:
            acc = self.accumulator if self.accumulator and self.accumulator.round == self.open_round else None
            final = self.final_version
            return {
                "run_id": self.run_id,
                "shard_index": self.shard_index,
                "num_shards": self.num_shards,
                "version": self.version,
                "open_round": self.open_round,
                "clusters": sorted(self.members),
                "contributed": sorted(acc.complete_clusters(set(self.owned))) if acc else [],
                "num_elements": self.num_elements,
                "bytes_in": self.bytes_in,
                "bytes_out": self.bytes_out,
                "initialised": self.snapshot is not None,
                "min_clusters": self.min_clusters,
                "state": "uninitialised"
                if self.snapshot is None
                else (
                    "finished"
                    if final is not None and self.version >= final
                    else ("collecting" if acc and acc.contributions else "waiting")
                ),
                "last_round_seconds": self.last_round.latency_s if self.last_round else 0.0,
                "last_round_closed_at": self.last_round.closed_at if self.last_round else 0.0,
                "final_version": -1 if final is None else final,
                "replay_mismatches": sum(self.replay_mismatches.values()),
                "sites": [self._site_state(cluster) for cluster in sorted(self.known)],
                **(self.checkpoint_health.as_status() if self.checkpoint_health is not None else CHECKPOINT_UNSAVED),
            }

    def _site_state(self, cluster: str) -> dict:
        return {
            "cluster": cluster,
            "member": cluster in self.members,
            **(self.sites.get(cluster) or SiteRecord()).as_status(),
        }

    def add_bytes_out(self, n: int) -> None:
        with self._cond:
            self.bytes_out += n

    # ------------------------------------------------------------------ checks
    def _check_run(self, run_id: str) -> None:
        if run_id != self.run_id:
            raise WrongRun(f"this shard serves run {self.run_id!r}, not {run_id!r}")
