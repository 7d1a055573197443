"""The push half of `AggregatorClient`: a round's slices encoded once and streamed to their owning shards
in parallel, a re-push to a shard that restarted, and what a shard closed its round without carried into
the next push.

Mixed into `AggregatorClient` (worker/exchange/aggregator_client.py), whose state it uses (`assignment`,
`slice_map`, `compressor`, `carry`, `traffic`, `_own`, `_pool`, `_stubs`, `_call`, …); kept apart so that
the client's connection and join, its pushes and its pulls each stay readable.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import grpc
import structlog
import torch

from dilocox.common.wire.framing import EncodedSlice, SliceKey, frame_slices
from dilocox.proto import dilocox_pb2 as pb
from dilocox.worker.exchange.shard_wait import AggregatorError

log = structlog.get_logger()


class AggregatorPush:
    """Mixed into `AggregatorClient`: `push`, `carry_undelivered` and the streams they send."""

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
