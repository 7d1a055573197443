"""The pull half of `AggregatorClient`: a round's result fetched from every shard in parallel, and the
client's replica of the global model brought up to it — by replaying the shard's outer step on the
round's forwarded contributions, or from the full weights and momentum once (a joiner, a laggard, a
replay that did not match the shard's digest).

Mixed into `AggregatorClient` (worker/exchange/aggregator_client.py), whose state it uses (`assignment`,
`held`, `held_versions`, `outer`, `replay_check`, `pull_kinds`, `replica_lock`, `_own`, `_pool`, `_stubs`,
`_call`, …) and whose push half re-pushes to a shard that restarted (`_repush_after_outage`); kept apart
so that the client's connection and join, its pushes and its pulls each stay readable.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import grpc
import structlog
import torch

from dilocox.common.wire import codecs
from dilocox.common.wire.framing import SliceKey, is_own_summary, is_state_digest
from dilocox.common.wire.slice_assembly import Assembled, assemble_units
from dilocox.proto import dilocox_pb2 as pb
from dilocox.worker.exchange.replay import StaleReplica, apply_pull, own_contributions, replayed_version
from dilocox.worker.exchange.replay_check import ReplayMismatch
from dilocox.worker.exchange.shard_wait import AggregatorError

log = structlog.get_logger()


class AggregatorPull:
    """Mixed into `AggregatorClient`: `pull`, `catch_up_replica` and `newest_version`."""

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
