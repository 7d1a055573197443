"""A version's contributions as a file holds them, and back: one layout for the shard's checkpoint
(server/state/checkpoint.py) and the rounds it keeps on disk for sites that come back behind
(server/state/rounds_on_disk.py), so that what a checkpoint restores and what a restarted site replays are
read the same way."""

from __future__ import annotations

from dilocox.common.wire.checkpoint_format import key_tuple, loaded_payload, saved_payload, slice_key
from dilocox.common.wire.framing import EncodedSlice
from dilocox.server.rounds.round_state import Contribution

Contributions = dict  # SliceKey -> {cluster: Contribution}, as a round's accumulator and a Snapshot hold them


def contributions_state(contributions: Contributions) -> dict:
    """Plain, picklable: (weight, codec, dtype, shape, payload as a uint8 tensor, clip scale) per slice and cluster."""
    return {
        key_tuple(k): {
            c: (x.weight, x.slice.codec, x.slice.dtype, x.slice.shape, saved_payload(x.slice.payload), x.scale)
            for c, x in per.items()
        }
        for k, per in contributions.items()
    }


def contributions_from_state(state: dict) -> Contributions:
    """The contributions back; entries from before the update check's clip carry no scale (1: unclipped)."""
    return {
        slice_key(k): {
            c: Contribution(
                c, w, EncodedSlice(slice_key(k), codec, dtype, tuple(shape), loaded_payload(payload)), *rest
            )
            for c, (w, codec, dtype, shape, payload, *rest) in per.items()
        }
        for k, per in state.items()
    }
