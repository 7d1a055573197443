"""A cluster's (or one rank's) connection to every shard of the aggregation service.

Pushes and pulls go to all shards at once, one stream per shard on its own thread (gRPC releases the
GIL), so a round's traffic is as parallel as the shard count. Bytes are counted at the gRPC message
layer: `ByteSize()` of every message sent and received, which is what crosses the wire before HTTP/2
framing.

This module holds the connection (channels, the shard wait, `close`), the join and the replica's part in
checkpoints; the push half is worker/exchange/aggregator_push.py and the pull half
worker/exchange/aggregator_pull.py, mixed into `AggregatorClient`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import torch

from dilocox.common.config.run import WireConfig
from dilocox.common.config.waits import PULL_WAIT_S, RPC_TIMEOUT_S, SHARD_WAIT_S
from dilocox.common.security import TlsFiles, open_channel
from dilocox.common.wire.assignment import ParamSlice, SliceMap, model_digest
from dilocox.common.wire.compression import TensorCompressor
from dilocox.common.wire.framing import EncodedSlice, SliceKey
from dilocox.common.wire.outer_optimizer import OuterNesterov
from dilocox.common.wire.staleness import check_rule as check_stale_rule
from dilocox.proto import dilocox_pb2 as pb
from dilocox.proto import dilocox_pb2_grpc as pb_grpc
from dilocox.worker.exchange.aggregator_pull import AggregatorPull
from dilocox.worker.exchange.aggregator_push import AggregatorPush
from dilocox.worker.exchange.carry import UndeliveredCarry
from dilocox.worker.exchange.packed_state import pack
from dilocox.worker.exchange.replay_check import ReplayCheck
from dilocox.worker.exchange.replica_state import Installed, install_replica, replica_entries, unpack_replica
from dilocox.worker.exchange.shard_wait import (
    RECONNECT_OPTIONS,
    WAITED_FOR,
    AggregatorError,
    call_waiting,
    said_while_unreached,
    why_unreachable,
)
from dilocox.worker.exchange.threads import exchange_thread_budget, use_exchange_threads


@dataclass
class JoinInfo:
    num_shards: int
    assignment: list[ParamSlice]
    versions: list[int]
    needs_init: list[int]
    run_config_json: str
    outer_lr: float
    outer_momentum: float
    rejoin: bool = False  # this cluster had joined the run before


@dataclass
class Traffic:
    bytes_up: int = 0
    bytes_down: int = 0
    per_shard_up: dict[int, int] = field(default_factory=dict)
    dropped_rounds: int = 0  # local rounds trained and then discarded (the cluster rejoined instead)
    dropped_tokens: int = 0


class AggregatorClient(AggregatorPush, AggregatorPull):
    def __init__(
        self,
        addresses: Sequence[str],
        run_id: str,
        cluster: str,
        wire: WireConfig | None = None,
        connect_timeout: float = 60.0,
        rpc_timeout: float = RPC_TIMEOUT_S,
        compressor: TensorCompressor | None = None,
        shard_wait_s: float = SHARD_WAIT_S,
        pull_wait_s: float = PULL_WAIT_S,
        tls: TlsFiles | None = None,
        token: str | None = None,
        tokenizer: tuple[str, str] = ("", ""),
        stale_weighting: str = "inverse",
    ) -> None:
        """`tokenizer`: (digest, tokenizer.json) of this cluster's tokenizer, recorded and checked by the
        shards at the join ("byte" and "" for bytes; ("", "") sends none, e.g. a bare test client).
        `stale_weighting`: how work pushed later than the round it was trained for weighs
        (common/wire/staleness.py): a carried part's scale, a caught-up push's weight. `shard_wait_s`: how long
        a call waits out an unreachable shard; `pull_wait_s`: how long the site's communicator waits for a
        round's result (common/config/waits.py)."""
        if not addresses:
            raise ValueError("at least one shard address is needed")
        self.addresses = list(addresses)
        self.run_id = run_id
        self.cluster = cluster
        self.wire = wire or WireConfig()
        self.connect_timeout = connect_timeout
        self.rpc_timeout = rpc_timeout
        # Monotonic time past which no call waits out an outage (None: each waits `shard_wait_s`): the
        # communicator sets it for the length of one exchange, so one rank's exchange stays inside the
        # site's agreement timeout (common/config/waits.py).
        self.outage_deadline: float | None = None
        self._closed = False
        self.shard_wait_s = shard_wait_s
        self.pull_wait_s = pull_wait_s
        self.tokenizer = tokenizer
        options = [
            ("grpc.max_receive_message_length", self.wire.max_message_bytes),
            ("grpc.max_send_message_length", self.wire.max_message_bytes),
            *RECONNECT_OPTIONS,
            *self.wire.keepalive_options(),
        ]
        self._channels = [open_channel(a, options, tls, token) for a in self.addresses]
        self._channel_of = dict(zip(self.addresses, self._channels))
        self._stubs_by_address = [pb_grpc.AggregatorStub(c) for c in self._channels]
        self._stubs: dict[int, tuple[str, pb_grpc.AggregatorStub]] = {}  # shard index -> (address, stub)
        # The push and pull threads (one per shard) compress, replay and digest: they share the exchange's
        # thread budget, apart from the training thread's count (worker/exchange/threads.py).
        workers = max(2, len(self.addresses))
        self.exchange_threads = exchange_thread_budget(self.wire.exchange_threads)
        self._pool = ThreadPoolExecutor(
            max_workers=workers,
            thread_name_prefix="agg-client",
            initializer=use_exchange_threads,
            initargs=(max(1, self.exchange_threads // len(self.addresses)),),
        )
        self.traffic = Traffic()
        self.assignment: list[ParamSlice] = []
        self.slice_map = SliceMap.of([])
        self.compressor = compressor  # uplink pseudo-gradients (rounds ≥ 1); None: lossless fp32
        # The global weights as this cluster holds them, with a replica of the outer optimiser: a shard
        # that sees we hold version v−1 forwards round v's contributions and we replay its step.
        self.held: dict[SliceKey, torch.Tensor] = {}
        self.held_versions: dict[int, int] = {}  # shard -> version of its slices in `held`
        self.outer: OuterNesterov | None = None
        # Our last pushed slices as they travelled: replayed (decoded again) when the shard forwards the
        # round. Only the payload is kept — a compressed one is a few KB where the decoded slice would
        # hold 4 bytes per parameter until the next pull.
        self._own: dict[SliceKey, EncodedSlice] = {}
        self._last_push: tuple[int, float, dict[int, list[SliceKey]]] | None = None  # round, weight, keys by shard
        self._restored: tuple[dict, list[str]] | None = None  # a checkpoint's replica, installed at the join
        self.replica_lock = threading.Lock()  # held while a pull folds into the replica, and while it is saved
        self.resumed: Installed | None = None  # what that replica gave (worker/exchange/replica_state.py)
        # shard -> how its last pull came: ("rounds", n replayed) | ("current", 0) | ("full", 0), and why if full
        self.pull_kinds: dict[int, tuple[str, int, str]] = {}
        self.replay_check = ReplayCheck(self.wire.replay_check, cluster)
        self.stale_weighting = check_stale_rule(stale_weighting)
        self.carry = UndeliveredCarry(stale_weighting)  # what a shard closed its round without, for the next push
        self._push_generation = 0  # counts encoded pushes: a re-push of the same bytes is the same one
        # (inner steps, idle s, staleness) the last push told the shards
        self._push_facts: tuple[int, float, int] = (0, 0.0, 0)

    @property
    def own_payload_bytes(self) -> int:
        """Bytes of our last push kept to replay its round (compressed payloads, or fp32 slices)."""
        return sum(len(item.payload) for item in list(self._own.values()))

    def close(self) -> None:
        """Close the channels, which ends any call still in flight (an exchange abandoned at a stop) at once
        rather than at its server-side wait, then let the pool's threads finish."""
        self._closed = True
        for channel in self._channels:
            channel.close()
        self._pool.shutdown(wait=True)

    def __enter__(self) -> AggregatorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ join
    def join(self, params: Sequence[tuple[str, Sequence[int]]], run_config_json: str = "") -> JoinInfo:
        """Join every shard (waiting up to `connect_timeout` for them to come up)."""
        request = pb.JoinRequest(
            run_id=self.run_id,
            cluster=self.cluster,
            model_digest=model_digest(params),
            params=[pb.ParamSpec(name=n, shape=list(s)) for n, s in params],
            run_config_json=run_config_json,
            tokenizer_digest=self.tokenizer[0],
            tokenizer_json=self.tokenizer[1],
        )

        def join_one(i: int) -> pb.JoinReply:
            try:
                # A first join fails fast on a wrong address (connect_timeout); a rejoin (after a missed
                # deadline, or during a shard's restart) waits as long as any other call does.
                # --shard-wait-s bounds the first connection too (a shorter wait than connect_timeout).
                first = min(self.connect_timeout, self.shard_wait_s) if self.shard_wait_s > 0 else self.connect_timeout
                timeout = self.shard_wait_s if self._stubs else first
                call = lambda: self._call(  # noqa: E731
                    self.addresses[i],
                    lambda: self._stubs_by_address[i].Join(request, timeout=max(timeout, 1.0), wait_for_ready=True),
                    call="join",
                )
                if self._stubs:  # a rejoin: the outage path says what it waits for
                    return call()
                with said_while_unreached(self.cluster, self.addresses[i], max(timeout, 1.0)):
                    return call()
            except AggregatorError as error:
                deadline = error.code == grpc.StatusCode.DEADLINE_EXCEEDED
                explained = why_unreachable(self._stubs_by_address[i], error) if deadline else error
                if explained is error:
                    raise
                raise explained from error

        replies = list(self._pool.map(join_one, range(len(self.addresses))))
        num_shards = {r.num_shards for r in replies}
        indices = sorted(r.shard_index for r in replies)
        if len(num_shards) != 1 or indices != list(range(len(self.addresses))) or num_shards != {len(self.addresses)}:
            raise ValueError(
                f"the addresses {self.addresses} are not one complete shard set: "
                f"shard indices {indices}, shard counts {sorted(num_shards)}"
            )
        for reply, address, stub in zip(replies, self.addresses, self._stubs_by_address):
            self._stubs[reply.shard_index] = (address, stub)
        first = replies[0]
        previous, self.outer = self.outer, OuterNesterov(first.outer_lr, first.outer_momentum)
        if previous is not None:  # a rejoin: the momentum goes with the replica's weights (the digest checks both)
            self.outer.buffers = previous.buffers
        self.assignment = [
            ParamSlice(s.name, tuple(s.shape), s.row_start, s.row_stop, s.shard) for s in first.assignment
        ]
        self.slice_map = SliceMap.of(self.assignment)
        if self._restored is not None:
            restored, names = self._restored
            self._restored = None
            self.resumed = install_replica(
                restored, self.assignment, names, self.held, self.outer.buffers, self.held_versions
            )
        by_index = sorted(replies, key=lambda r: r.shard_index)
        return JoinInfo(
            num_shards=first.num_shards,
            assignment=self.assignment,
            versions=[r.version for r in by_index],
            needs_init=[r.shard_index for r in by_index if r.needs_init],
            run_config_json=first.run_config_json,
            outer_lr=first.outer_lr,
            outer_momentum=first.outer_momentum,
            rejoin=any(r.rejoin for r in replies),
        )

    # ------------------------------------------------------------------ the replica in checkpoints
    def replica_entries(self, names: Sequence[str]) -> dict[str, dict]:
        """Our replica of `names`, the live tensors by name (hold `replica_lock` while they are read)."""
        momentum = self.outer.buffers if self.outer is not None else {}
        return replica_entries(self.held, momentum, self.held_versions, self.assignment, names)

    def replica_state(self, names: Sequence[str]) -> dict[str, bytes]:
        """Our replica of `names` (weights, outer momentum, each shard's version), packed per name for a
        checkpoint: a copy, each shard's slices whole at one version (a pull folding in meanwhile waits)."""
        with self.replica_lock:
            return {name: pack(slices) for name, slices in self.replica_entries(names).items()}

    def restore_replica(self, packed: Mapping[str, bytes], names: Sequence[str]) -> int:
        """Keep the replica a checkpoint saved for `names`, to install at the join (where the slices are
        known); the first pull then asks only for the rounds since. Returns the slices found."""
        return self.restore_replica_slices(unpack_replica(packed, names), names)

    def restore_replica_slices(self, slices: dict[SliceKey, dict], names: Sequence[str]) -> int:
        """As `restore_replica`, from slices already read (a site checkpoint's replica files)."""
        self._restored = (slices, list(names))
        return len(slices)

    # ------------------------------------------------------------------ status
    def status_each(self, timeout: float = 10.0) -> list[pb.StatusReply | AggregatorError]:
        """Status of every address, in order; a shard that fails answers with its AggregatorError."""
        replies: list[pb.StatusReply | AggregatorError] = []
        for address, stub in zip(self.addresses, self._stubs_by_address):
            try:
                replies.append(
                    self._call(address, lambda: stub.Status(pb.StatusRequest(), timeout=timeout), call="status")  # noqa: B023
                )
            except AggregatorError as error:
                replies.append(error)
        return replies

    def _call(
        self,
        address: str,
        fn,
        on_reconnect=None,
        call: str = "call",
        wait_s: float | None = None,
        deadline_is_outage: bool = False,
    ):
        """Run one idempotent call, waiting out an unreachable shard for `wait_s` (default `shard_wait_s`;
        0: one try) — see `shard_wait.call_waiting`."""
        wait_s = self.shard_wait_s if wait_s is None else wait_s
        if self.outage_deadline is not None:  # inside an exchange: never past its end (Communicator._exchange)
            wait_s = min(wait_s, max(0.0, self.outage_deadline - time.monotonic()))
        waited = WAITED_FOR + (grpc.StatusCode.DEADLINE_EXCEEDED,) if deadline_is_outage else WAITED_FOR
        return call_waiting(
            fn, address, self._channel_of[address], wait_s, on_reconnect, call, waited, closed=lambda: self._closed
        )
