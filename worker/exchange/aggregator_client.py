"""A cluster's (or one rank's) connection to every shard of the aggregation service.

Pushes and pulls go to all shards at once, one stream per shard on its own thread (gRPC releases the
GIL), so a round's traffic is as parallel as the shard count. Bytes are counted at the gRPC message
layer: `ByteSize()` of every message sent and received, which is what crosses the wire before HTTP/2
framing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import structlog
import torch

from dilocox.common.config.run import WireConfig
from dilocox.common.config.waits import PULL_WAIT_S, RPC_TIMEOUT_S, SHARD_WAIT_S
from dilocox.common.security import TlsFiles, open_channel
from dilocox.common.wire import codecs
from dilocox.common.wire.assignment import ParamSlice, SliceMap, model_digest
from dilocox.common.wire.compression import TensorCompressor
from dilocox.common.wire.framing import EncodedSlice, SliceKey, frame_slices, is_own_summary, is_state_digest
from dilocox.common.wire.outer_optimizer import OuterNesterov
from dilocox.common.wire.slice_assembly import Assembled, assemble_units
from dilocox.common.wire.staleness import check_rule as check_stale_rule
from dilocox.proto import dilocox_pb2 as pb
from dilocox.proto import dilocox_pb2_grpc as pb_grpc
from dilocox.worker.exchange.carry import UndeliveredCarry
from dilocox.worker.exchange.packed_state import pack
from dilocox.worker.exchange.replay import StaleReplica, apply_pull, own_contributions, replayed_version
from dilocox.worker.exchange.replay_check import ReplayCheck, ReplayMismatch
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

log = structlog.get_logger()


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


class AggregatorClient:
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

    # ------------------------------------------------------------------ push
    def push(
        self,
        round_: int,
        weight: float,
        tensors: Mapping[SliceKey, torch.Tensor],
        shards: Iterable[int] | None = None,
        reencode: bool = True,
        codec: str | None = None,
        facts: tuple[int, float, int] = (0, 0.0, 0),
        formed: bool = False,
    ) -> int:
        """Send slices (keyed by SliceKey) to their owning shards in parallel; returns bytes sent.

        `reencode=False` resends the bytes of this round's last push (a re-push after a shard restart)
        instead of compressing again, which would advance the compressor's state a second time.
        `codec`: a dense codec for this push instead of the compressor's own (the end-of-run flush).
        `facts`: (inner steps, idle seconds, staleness) of the round, told to the shards: the first two for
        `dilocox status`, the staleness (rounds the work is older than `round_`) caps its weight.
        `formed`: each tensor is Δ + e, formed in the compressor's residual buffer (`hold_residual`), which
        compression leaves holding the new residual; a carried part is added into it there."""
        owner = {s.key: s.shard for s in self.assignment}
        by_shard: dict[int, list[SliceKey]] = {}
        for key in tensors:
            by_shard.setdefault(owner[key], []).append(key)
        targets = sorted(set(shards) if shards is not None else by_shard)
        if round_ > 0:
            if reencode:
                self._push_generation += 1
                tensors = self.carry.add_to(tensors, weight, round_, in_place=formed)
                self._push_facts = (int(facts[0]), float(facts[1]), int(facts[2]) if len(facts) > 2 else 0)
            self._last_push = (round_, weight, by_shard)

        def push_one(shard: int) -> int:
            # Encoded once, so a retried stream resends the very same bytes (the shard ignores duplicates).
            items = [
                self._own[key]
                if not reencode and key in self._own
                else self._encode(round_, key, tensors[key], codec, formed)
                for key in by_shard.get(shard, [])
            ]
            return self._send(shard, round_, weight, items)

        running = {shard: self._pool.submit(push_one, shard) for shard in targets}
        sent_per_shard, refused = {}, {}
        for shard, future in running.items():
            try:
                sent_per_shard[shard] = future.result()
            except AggregatorError as error:
                refused[shard] = error
        for shard, sent in sent_per_shard.items():
            self.traffic.per_shard_up[shard] = self.traffic.per_shard_up.get(shard, 0) + sent
        total = sum(sent_per_shard.values())
        self.traffic.bytes_up += total
        if refused:
            closed = [s for s, e in refused.items() if e.code == grpc.StatusCode.FAILED_PRECONDITION]
            if round_ > 0:
                self.carry_undelivered(round_, [key for s in closed for key in by_shard.get(s, [])], weight)
            error = next(iter(refused.values()))
            error.bytes_sent = total  # what the other shards took: counted in the traffic, and in the round's report
            raise error
        return total

    def carry_undelivered(self, round_: int, keys: Iterable[SliceKey], weight: float) -> None:
        """A shard closed round `round_` without these slices of ours, pushed with `weight`: deliver them
        with the next push, weighted by their own tokens (see `carry.UndeliveredCarry`)."""
        before = self.carry.elements
        kept = self.carry.keep(
            self._push_generation,
            {key: self._own[key].decode() for key in keys if key in self._own},
            weight,
            round_ - self._push_facts[2],
        )  # the round the work was trained for
        if kept:
            log.warning(
                "pseudo_gradient_carried",
                cluster=self.cluster,
                round=round_,
                slices=len(kept),
                elements=self.carry.elements - before,
                tokens=weight,
                reason="a shard closed the round without them: they go with the next round",
            )

    def _send(self, shard: int, round_: int, weight: float, items: list[EncodedSlice], wait: bool = True) -> int:
        """One push stream to one shard; `wait=False`: one try, no waiting for an unreachable shard."""
        address, stub = self._stubs[shard]
        chunks = [
            pb.PushMessage(chunk=chunk)
            for chunk in frame_slices(items, self.slice_map.index, self.wire.chunk_bytes, self.wire.zstd_level)
        ]
        header = pb.PushHeader(
            run_id=self.run_id,
            cluster=self.cluster,
            round=round_,
            weight=weight,
            chunks=len(chunks),
            inner_steps=self._push_facts[0] if round_ > 0 else 0,
            idle_s=self._push_facts[1] if round_ > 0 else 0.0,
            staleness=self._push_facts[2] if round_ > 0 else 0,
        )
        messages = [pb.PushMessage(header=header), *chunks]
        push = lambda: stub.Push(iter(messages), timeout=self.rpc_timeout)  # noqa: E731
        # A push is idempotent (a retry is answered as duplicates): its own deadline running out (a reply
        # lost on a half-open connection) is waited out like an outage.
        self._call(address, push, call="push", wait_s=None if wait else 0.0, deadline_is_outage=True)
        return sum(m.ByteSize() for m in messages)

    def _repush_after_outage(self, shard: int, round_: int) -> None:
        """A shard we lost the connection to may have restarted from its checkpoint, without the open
        round's pushes: send it our part of round `round_` again (the same bytes; a shard that kept
        them ignores duplicates) before asking for that round's result, rather than waiting out a pull."""
        if self._last_push is None or self._last_push[0] != round_:
            return
        _, weight, by_shard = self._last_push
        items = [self._own[key] for key in by_shard.get(shard, []) if key in self._own]
        if not items:
            return
        try:
            sent = self._send(shard, round_, weight, items, wait=False)
            self.traffic.bytes_up += sent
            log.info("repushed_after_outage", shard=shard, round=round_, bytes_up=sent)
        except AggregatorError as error:  # closed meanwhile (it had our push), or down again: the pull decides
            log.info(
                "repush_after_outage_refused", shard=shard, round=round_, code=error.code.name, details=error.details
            )

    def _encode(
        self, round_: int, key: SliceKey, tensor: torch.Tensor, codec: str | None = None, formed: bool = False
    ) -> EncodedSlice:
        if round_ == 0:  # initial weights always travel exactly
            return EncodedSlice.exact(key, tensor)
        if self.compressor is None:
            item = EncodedSlice.exact(key, tensor)
        else:
            compress = self.compressor.compress_formed if formed else self.compressor.compress
            encoded = compress(key, tensor, codec)
            item = EncodedSlice(key, encoded.codec, encoded.dtype, tuple(tensor.shape), bytearray(encoded.payload))
        self._own[key] = item  # to replay the round's step when the shard forwards it
        return item

    # ------------------------------------------------------------------ pull
    @property
    def newest_version(self) -> int:
        """The newest version any shard has given us (-1: none yet); `pull` returns the oldest."""
        return max(self.held_versions.values(), default=-1)

    def catch_up_replica(self, names: Sequence[str] = (), to: int | None = None) -> int:
        """Pull the shards our replica holds an older version of than another shard gave us (or than `to`:
        what another rank of the site holds), up to that version (a late site can get the run's final
        version from one shard and an older one from another); returns the version the replica is at."""
        newest = max(self.newest_version, -1 if to is None else to)
        behind = [shard for shard, version in self.held_versions.items() if version < newest]
        if behind:
            log.info("replica_catching_up", shards=behind, version=newest)
            self.pull(newest, names, shards=behind)
        return newest

    def pull(
        self,
        min_version: int,
        names: Sequence[str] = (),
        wait_seconds: float = 600.0,
        shards: Sequence[int] | None = None,
    ) -> tuple[int, dict[SliceKey, torch.Tensor], int]:
        """Fetch the global weights (≥ min_version) from every shard (or `shards`); returns (version,
        slices, bytes).

        Tells each shard which version it holds: a shard answers a cluster one version behind with the
        round's contributions (the other clusters' compressed pseudo-gradients, a digest for our own),
        and this client replays the shard's outer step on its copy — bit-identical, in every cluster.
        Anyone else (a joiner, a laggard) gets the full weights and outer momentum, once.
        """
        wanted = set(names)
        serving = {s.shard for s in self.assignment if not wanted or s.name in wanted}
        shards = sorted(serving if shards is None else serving & set(shards))

        def pull_one(shard: int) -> int:
            address, stub = self._stubs[shard]
            expected = {s.key: s for s in self.assignment if s.shard == shard}
            received = 0

            def attempt(have: int) -> None:
                nonlocal received
                summaries: list[pb.TensorChunk] = []  # the requester's own slices, as one chunk
                digests: list[pb.TensorChunk] = []  # the shard's state digest, to check our replay with
                request = pb.PullRequest(
                    run_id=self.run_id,
                    cluster=self.cluster,
                    min_version=min_version,
                    wait_seconds=wait_seconds,
                    names=list(names),
                    have_version=have,
                    check_replay=self.replay_check.enabled,
                    replay_digest=self.replay_check.digest,
                    replay_mismatches=self.replay_check.mismatches,
                    no_own_copies=not self._own,
                )

                def chunks() -> Iterator[pb.TensorChunk]:
                    nonlocal received
                    for chunk in stub.Pull(request, timeout=wait_seconds + self.rpc_timeout):
                        received += chunk.ByteSize()
                        if is_own_summary(chunk):
                            summaries.append(chunk)
                        elif is_state_digest(chunk):
                            digests.append(chunk)
                        else:
                            yield chunk

                def vet(key: SliceKey, chunk: pb.TensorChunk) -> int:
                    if chunk.own:
                        raise ValueError(f"shard {shard} sent {key} as our own slice: own parts come as one summary")
                    if key not in expected or tuple(chunk.shape) != expected[key].slice_shape:
                        raise ValueError(
                            f"shard {shard} sent {key} with shape {list(chunk.shape)}, which it does not own"
                        )
                    if chunk.is_delta and (
                        chunk.base_version < have or chunk.base_version != chunk.version - 1 or key not in self.held
                    ):
                        raise ValueError(
                            f"shard {shard} sent round {chunk.version} for version {chunk.base_version}; we hold {have}"
                        )
                    return codecs.max_payload_bytes(chunk.codec, expected[key].slice_shape)

                def fetch() -> list[Assembled]:
                    summaries.clear()  # a retried call starts the stream over
                    digests.clear()
                    # Vetted as they arrive, decoded when the replay reaches their slice: kept decoded, the
                    # forwarded rounds of every shard would be (M - 1) dense copies of the model at once.
                    return list(assemble_units(chunks(), vet, self.slice_map.entries))

                units = self._call(
                    address, fetch, on_reconnect=lambda: self._repush_after_outage(shard, min_version), call="pull"
                )
                own_keys = sorted(k for k in expected if not wanted or k.name in wanted)
                replayed = replayed_version(shard, have, units, summaries, own_keys, self.held)
                self.pull_kinds[shard] = (
                    ("full", 0, why_full)
                    if replayed is None
                    else (("current", 0, "") if replayed == have else ("rounds", replayed - have, ""))
                )
                digest = self.replay_check.expected(shard, digests, replayed)  # before applying
                own = own_contributions(self.cluster, self._own, self.held, shard, summaries, own_keys, have)
                assert self.outer is not None, "join first"
                with self.replica_lock:  # a state_dict() meanwhile sees this shard's slices before or after, whole
                    self.held_versions[shard] = apply_pull(
                        self.held, self.outer, units, own, self.held_versions.get(shard, -1)
                    )
                if digest is not None:
                    self.replay_check.verify(
                        shard, self.held_versions[shard], own_keys, self.held, self.outer.buffers, digest
                    )

            have = self.held_versions.get(shard, -1)
            why_full = (
                "no replica held"
                if have < 0
                else "the shard no longer keeps every round since (its --keep-rounds in memory, --keep-rounds-s on "
                "disk)"
            )
            try:
                attempt(have)
            except ReplayMismatch:
                why_full = "the replay did not match the shard's state digest"
                attempt(-1)  # the shard's weights and momentum in full, before the next round
                self.replay_check.resynced(shard, self.held)
            except StaleReplica as error:
                why_full = str(error)
                log.warning("replica_resync", shard=shard, reason=why_full)
                attempt(-1)  # the full weights and momentum, once
            except AggregatorError as error:
                # Dropped at the close of the round we wait for (a deadline, with part of a pipeline's
                # shares in): the push we made was accepted, then discarded. Deliver it next round.
                last = self._last_push
                if error.code == grpc.StatusCode.FAILED_PRECONDITION and last is not None and last[0] == min_version:
                    self.carry_undelivered(min_version, last[2].get(shard, []), last[1])
                raise
            return received

        total = sum(self._pool.map(pull_one, shards))
        self.traffic.bytes_down += total
        versions = [self.held_versions.get(shard, -1) for shard in shards]
        if len(set(versions)) > 1:
            log.info("pull_versions_differ", versions=versions)
        wanted_keys = [s.key for s in self.assignment if not wanted or s.name in wanted]
        return min(versions), {k: self.held[k] for k in wanted_keys if k in self.held}, total

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
