"""gRPC adapter over `Shard`: parse messages, call the core, map `DilocoxError.status` onto the call.

Nothing here decides anything about rounds or weights; a refused request is refused by the core, and
this layer only turns the exception into a precise status code and message. Its methods are blocking
and run on worker threads; `server/serving/aio_servicer.py` serves them on grpc.aio (and parks a pull's wait
for its version on the event loop before `stream` sends it).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator

import grpc
import structlog

from dilocox.common.config.run import WireConfig
from dilocox.common.wire.errors import DilocoxError, InvalidFrame
from dilocox.common.wire.framing import EncodedSlice, frame_slices, own_contribution_digest
from dilocox.common.wire.slice_assembly import assemble_units
from dilocox.proto import dilocox_pb2 as pb
from dilocox.server.serving.pull_framing import PullFramings
from dilocox.server.shard import Shard
from dilocox.server.shard_records import Snapshot

log = structlog.get_logger()


def refuse(context: grpc.ServicerContext, error: DilocoxError) -> None:
    log.warning("request_refused", status=error.status, reason=str(error))
    context.abort(grpc.StatusCode[error.status], str(error))


def _refuse_pull_fields(chunk: pb.TensorChunk) -> None:
    """Pull-only fields have no meaning in a push, and `own` would skip decoding the payload: a NaN slice
    would then be stored unchecked and poison the round when it closes."""
    used = [f for f in ("own", "is_delta", "momentum", "contributor") if getattr(chunk, f)]
    if used:
        raise InvalidFrame(f"{chunk.name}: pushed chunks must not set pull-only fields {used}")


class AggregatorServicer:
    """The blocking half of the shard's gRPC methods (Join, Push, Status, and a pull's `stream`)."""

    def __init__(self, shard: Shard, wire: WireConfig | None = None, framings: PullFramings | None = None) -> None:
        self.shard = shard
        self.wire = wire or WireConfig()
        self.framings = framings if framings is not None else PullFramings()

    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinReply:
        try:
            if request.observer:
                result = self.shard.describe(request.run_id)
            else:
                params = [(p.name, tuple(p.shape)) for p in request.params]
                result = self.shard.join(
                    request.run_id,
                    request.cluster,
                    request.model_digest,
                    params,
                    request.run_config_json,
                    request.tokenizer_digest,
                    request.tokenizer_json,
                )
        except DilocoxError as error:
            refuse(context, error)
        return pb.JoinReply(
            cluster=result.cluster,
            shard_index=self.shard.shard_index,
            num_shards=self.shard.num_shards,
            version=result.version,
            needs_init=result.needs_init,
            assignment=[
                pb.SliceSpec(
                    name=s.name, shape=list(s.shape), row_start=s.row_start, row_stop=s.row_stop, shard=s.shard
                )
                for s in result.assignment
            ],
            run_config_json=result.run_config_json,
            outer_lr=self.shard.optimizer.lr,
            outer_momentum=self.shard.optimizer.momentum,
            rejoin=result.rejoin,
            tokenizer_digest=result.tokenizer_digest,
            tokenizer_json=result.tokenizer_json,
        )

    def Push(self, request_iterator: Iterator[pb.PushMessage], context: grpc.ServicerContext) -> pb.PushReply:
        received = 0
        try:
            first = next(request_iterator, None)
            if first is None or first.WhichOneof("body") != "header":
                raise InvalidFrame("a push stream must start with a PushHeader")
            header = first.header
            received += first.ByteSize()
            self.shard.check_push(header.run_id, header.cluster, header.round, header.weight, header.staleness)

            if header.chunks < 1:
                raise InvalidFrame(
                    "a push must carry at least one slice after its PushHeader, and its header must say how "
                    f"many chunk messages follow (chunks ≥ 1, got {header.chunks})"
                )
            count = 0

            def chunks() -> Iterator[pb.TensorChunk]:
                nonlocal received, count
                for message in request_iterator:
                    if message.WhichOneof("body") != "chunk":
                        raise InvalidFrame("only TensorChunks may follow the PushHeader")
                    count += 1
                    if count > header.chunks:
                        raise InvalidFrame(
                            f"the push sent more chunk messages than the {header.chunks} its header declared"
                        )
                    _refuse_pull_fields(message.chunk)
                    received += message.ByteSize()
                    yield message.chunk

            def vet(key, chunk: pb.TensorChunk) -> int:
                return self.shard.vet_slice(key, chunk.codec, tuple(chunk.shape))

            pushed = [
                EncodedSlice(
                    u.key, u.meta.codec, u.meta.dtype, tuple(u.meta.shape), u.payload, vetted=True
                )  # the assembler's buffer, handed over
                for u in assemble_units(chunks(), vet, self.shard.slice_map.entries)
            ]
            if count < header.chunks:  # nothing of a cut stream is applied
                raise InvalidFrame(
                    f"the push stream ended after {count} of the {header.chunks} chunk messages its header "
                    "declared (cut: a message over the size limit, or the connection lost)"
                )
            if not pushed:
                raise InvalidFrame("a push must carry at least one slice after its PushHeader")
            result = self.shard.commit_push(
                header.cluster,
                header.round,
                header.weight,
                pushed,
                bytes_in=received,
                inner_steps=header.inner_steps,
                idle_s=header.idle_s,
                staleness=header.staleness,
            )
        except DilocoxError as error:
            refuse(context, error)
        return pb.PushReply(
            round=result.round,
            slices_accepted=result.accepted,
            slices_duplicate=result.duplicate,
            round_closed=result.round_closed,
            bytes_received=received,
        )

    def stream(self, snapshot: Snapshot, request: pb.PullRequest) -> Iterator[bytes]:
        """A pull's chunks of `snapshot` (held by the caller until the stream ends), each a serialized
        TensorChunk as sent (server/serving/pull_framing.py): the round's contributions to replay, or the weights and
        momentum in full, or the weights alone for an observer. Run on a worker thread chunk by chunk
        (server/serving/aio_servicer.py parks the wait for the version)."""
        if not request.observer:
            self.shard.note_replay_mismatches(request.cluster, request.replay_mismatches)
        names = set(request.names)
        keys = [k for k in snapshot.tensors if not names or k.name in names]
        slices = self.framings.slice_set(keys)
        if request.observer:  # the weights alone: an export needs no momentum and replays nothing
            chunks = self.framings.framed(
                ("weights", "", slices),
                snapshot.version,
                _framed_bound(_dense_bytes(snapshot, keys, False)),
                lambda: self._full_chunks(snapshot, keys, with_momentum=False),
            )
        elif (
            rounds := self._rounds_to_forward(snapshot, keys, request, full := _dense_bytes(snapshot, keys, True))
        ) is not None:
            chunks = self._contribution_chunks(snapshot, keys, rounds, request, slices)
        else:
            chunks = self.framings.framed(
                ("full", "", slices), snapshot.version, _framed_bound(full), lambda: self._full_chunks(snapshot, keys)
            )
        sent = 0
        for chunk in chunks:
            sent += len(chunk)
            yield chunk
        self.shard.add_bytes_out(sent)
        if not request.observer:  # this much of this version is now at the cluster
            self.shard.note_pulled(request.cluster, snapshot.version, names)

    def _rounds_to_forward(
        self, snapshot: Snapshot, keys: list, request: pb.PullRequest, full: int
    ) -> list[tuple[int, dict]] | None:
        """The rounds to send instead of the weights (the cluster replays the steps), or None for a full
        pull: every version after the one the cluster holds, when this shard still keeps them all
        (server/rounds/recent_rounds.py), each has contributions to replay, and together they are smaller than the
        weights plus momentum (`full` bytes). A cluster at the version already gets no round at all (a restart that
        missed nothing: its checkpoint's replica is checked by the state digest alone)."""
        if request.have_version == snapshot.version and snapshot.version > 0:
            return []
        rounds = self.shard.recent.since(request.have_version, snapshot)
        if not rounds or not all(any(contributions.get(k) for k in keys) for _, contributions in rounds):
            return None  # e.g. a version restored without its contributions: send the weights
        summarised = self._own_summarised(snapshot, request)
        forwarded = sum(
            len(c.slice.payload)
            for version, contributions in rounds
            for k in keys
            for c in contributions.get(k, {}).values()
            if not (version in summarised and c.cluster == request.cluster)
        )
        return rounds if forwarded <= full else None

    @staticmethod
    def _own_summarised(snapshot: Snapshot, request: pb.PullRequest) -> set[int]:
        """The versions whose requester's part goes as a digest summary: the newest, to a cluster one version
        behind that kept its pushed payloads."""
        one_behind = request.have_version == snapshot.version - 1
        return {snapshot.version} if one_behind and not request.no_own_copies else set()

    def _contribution_chunks(
        self,
        snapshot: Snapshot,
        keys: list,
        rounds: list[tuple[int, dict]],
        request: pb.PullRequest,
        slices: int | None,
    ) -> Iterator[bytes]:
        """Round by round, oldest first, the contributions cluster by cluster (small slices bundled: a
        cluster's weight is the same on all its slices); where the requester holds its own slices' bytes
        (`_own_summarised`), its part as one nameless summary chunk: their combined digest and count; and,
        if asked (`check_replay`), the state digest of `keys` last (each slice hashed by
        `replay_digest`), for the cluster to check its replay against."""
        wire, index, requester = self.wire, self.shard.slice_map.index, request.cluster
        summarised = self._own_summarised(snapshot, request)
        for version, contributions_of in rounds:
            by_cluster: dict[str, list] = {}
            for key in keys:
                for cluster, contribution in contributions_of.get(key, {}).items():
                    by_cluster.setdefault(cluster, []).append(contribution)
            mine = by_cluster.pop(requester, []) if version in summarised else []
            for cluster, contributions in sorted(
                by_cluster.items()
            ):  # the same chunks for every requester: framed once
                frame = functools.partial(
                    frame_slices,
                    [c.slice for c in contributions],
                    index,
                    wire.chunk_bytes,
                    wire.zstd_level,
                    version=version,
                    is_delta=True,
                    base_version=version - 1,
                    contributor=cluster,
                    weight=contributions[0].weight,
                    **_clipped(contributions[0].scale),
                )
                payload = sum(len(c.slice.payload) for c in contributions)
                yield from self.framings.framed(
                    ("contributions", version, cluster, slices), snapshot.version, _framed_bound(payload), frame
                )
            if mine:
                own = {c.slice.key: c.slice.sha256 for c in mine}
                yield pb.TensorChunk(
                    version=version,
                    is_delta=True,
                    base_version=version - 1,
                    contributor=requester,
                    weight=mine[0].weight,
                    own=True,
                    own_slices=len(own),
                    payload_sha256=own_contribution_digest(own),
                    **_clipped(mine[0].scale),
                ).SerializeToString()
        if request.check_replay:
            digest = self.shard.state_digest(snapshot, keys, request.replay_digest)
            yield pb.TensorChunk(version=snapshot.version, state_digest=True, payload_sha256=digest).SerializeToString()

    def _full_chunks(self, snapshot: Snapshot, keys: list, with_momentum: bool = True) -> Iterator[pb.TensorChunk]:
        """The weights, then (unless not `with_momentum`: an observer's pull) the outer momentum, of `keys`
        (small slices bundled)."""
        wire, index = self.wire, self.shard.slice_map.index
        weights = (EncodedSlice.exact(key, snapshot.tensors[key]) for key in keys)
        yield from frame_slices(weights, index, wire.chunk_bytes, wire.zstd_level, version=snapshot.version)
        if not with_momentum:
            return
        momentum = (EncodedSlice.exact(key, snapshot.momentum[key]) for key in keys if key in snapshot.momentum)
        yield from frame_slices(
            momentum, index, wire.chunk_bytes, wire.zstd_level, version=snapshot.version, momentum=True
        )

    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusReply:
        return pb.StatusReply(**self.shard.status())

    def Provenance(self, request: pb.ProvenanceRequest, context: grpc.ServicerContext) -> pb.ProvenanceReply:
        """A page of the shard's rounds chain (server/state/provenance_chain.py), for `dilocox export`."""
        try:
            records, total, head = self.shard.provenance(request.run_id, request.start, request.max_bytes)
        except DilocoxError as error:
            refuse(context, error)
        return pb.ProvenanceReply(
            shard_index=self.shard.shard_index,
            num_shards=self.shard.num_shards,
            genesis=self.shard.chain.genesis,
            head=head,
            total_records=total,
            start=request.start,
            records_json=json.dumps(records),
        )

    def Readmit(self, request: pb.ReadmitRequest, context: grpc.ServicerContext) -> pb.ReadmitReply:
        """An operator releases a quarantined site (`Shard.readmit`)."""
        try:
            was = self.shard.readmit(request.run_id, request.cluster, request.operator_token)
        except DilocoxError as error:
            refuse(context, error)
        return pb.ReadmitReply(shard_index=self.shard.shard_index, was_quarantined=was)


def _dense_bytes(snapshot: Snapshot, keys: list, momentum: bool) -> int:
    """The fp32 bytes of `keys`' weights (and their outer momentum, where `momentum`) at `snapshot`."""
    return sum(4 * snapshot.tensors[k].numel() * (2 if momentum and k in snapshot.momentum else 1) for k in keys)


def _framed_bound(payload_bytes: int) -> int:
    """At most what `payload_bytes` become framed: zstd adds a few bytes per 128 KB block to what it cannot
    compress, each chunk a header and its metadata."""
    return payload_bytes + payload_bytes // 64 + 4096


def _clipped(scale: float) -> dict:
    """The chunk field of a clipped update (proto `scale`); none for an unclipped one (1: the old bytes)."""
    return {"scale": scale} if scale != 1.0 else {}
