"""What a pipeline schedule holds and idles, as torch's schedules run it.

* **In flight**: how many microbatches' activations each of a rank's stages keeps at once. GPipe holds all
  of them; torch's 1F1B warms up with pp − stage forwards and then runs the oldest backward before each
  next forward (pp − stage); the interleaved 1F1B is read off torch's own action list for the rank
  (`ScheduleInterleaved1F1B._calculate_single_rank_operations`: every F adds a microbatch to its stage,
  every B takes one away), the peak taken over the run weighted by each stage's blocks — a chunk of few
  blocks in flight costs less than one of many.
* **The bubble**: the share of a rank's step it idles, (pp − 1) / (v · m + pp − 1) for m microbatches and
  v stages a rank (Narayanan et al. 2021; v = 1: GPipe and 1F1B); the zero-bubble schedule's (Qi et al.
  2024), whose weight backwards fill most of it, counted on torch's own order for it.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace


def bubble_fraction(pp: int, microbatches: int, stages_per_rank: int = 1, schedule: str = "1f1b") -> float:
    """The share of each rank's slots idle in a step of `microbatches` (the step's, accumulated included).
    The zero-bubble schedule's is read off torch's own order for it: its idle slots among forwards, input
    backwards and weight backwards, each taken as one slot (the zero-bubble paper's cost model)."""
    if pp <= 1:
        return 0.0
    if schedule == "interleaved-zb":
        order = _zero_bubble_order(pp, microbatches, stages_per_rank)
        return max(sum(a is None for a in acts) / len(acts) for acts in order.values())
    return (pp - 1) / (stages_per_rank * microbatches + pp - 1)


@functools.lru_cache(maxsize=256)
def _zero_bubble_order(pp: int, microbatches: int, stages_per_rank: int) -> dict:
    """torch's ScheduleInterleavedZeroBubble order for every rank, idle slots included (None)."""
    from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble as zb

    rounds, per_round = interleaved_rounds(pp, microbatches)
    plan = SimpleNamespace(
        n_local_stages=stages_per_rank,
        microbatches_per_round=per_round,
        pp_group_size=pp,
        _n_microbatches=microbatches,
        number_of_rounds=rounds,
    )
    plan.pipeline_order = {rank: zb._calculate_single_rank_operations(plan, rank) for rank in range(pp)}
    return zb._add_bubbles_to_actions(plan, stages_per_rank * pp)


def interleaved_rounds(pp: int, microbatches: int) -> tuple[int, int]:
    """(rounds, microbatches per round) of torch's interleaved 1F1B, which needs the second to divide m."""
    rounds = max(1, microbatches // pp)
    return rounds, microbatches // rounds


def in_flight_layers(schedule: str, rank_stage: int, pp: int, microbatches: int, chunk_layers: tuple[int, ...]) -> int:
    """The most blocks' activations (one microbatch each) rank `rank_stage` holds at any moment of a step."""
    if pp <= 1:
        return chunk_layers[0]
    if schedule == "gpipe":
        return microbatches * sum(chunk_layers)
    if schedule == "1f1b":
        return min(pp - rank_stage, microbatches) * sum(chunk_layers)
    return _interleaved_peak(schedule, rank_stage, pp, microbatches, chunk_layers)


def last_stage_in_flight(schedule: str, pp: int, microbatches: int, stages_per_rank: int) -> int:
    """How many microbatches' logits the model's last stage holds at once."""
    if pp <= 1 or schedule == "1f1b":
        return 1
    if schedule == "gpipe":
        return microbatches
    counts = _interleaved_counts(schedule, pp - 1, pp, microbatches, stages_per_rank)
    last = pp * stages_per_rank - 1
    return max(c.get(last, 0) for c in counts)


@functools.lru_cache(maxsize=1024)
def _interleaved_counts(
    schedule: str, rank_stage: int, pp: int, microbatches: int, stages_per_rank: int
) -> tuple[dict[int, int], ...]:
    """The microbatches in flight per stage after each of the rank's actions, from torch's own schedule: a
    forward (F) adds one, a full backward (B) frees it — in the zero-bubble schedule its weight half (W),
    as the input half (I) leaves what the weights' gradient needs."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B

    if schedule == "interleaved-zb":
        actions = _zero_bubble_order(pp, microbatches, stages_per_rank)[rank_stage]
    else:
        _, per_round = interleaved_rounds(pp, microbatches)
        plan = SimpleNamespace(
            n_local_stages=stages_per_rank,
            microbatches_per_round=per_round,
            pp_group_size=pp,
            _n_microbatches=microbatches,
        )
        actions = ScheduleInterleaved1F1B._calculate_single_rank_operations(plan, rank_stage)
    counts: dict[int, int] = {}
    timeline = []
    for action in actions:
        if action is None:
            continue
        kind = getattr(action.computation_type, "value", action.computation_type)  # "F", "B", "I", "W"
        counts[action.stage_index] = counts.get(action.stage_index, 0) + {"F": 1, "B": -1, "W": -1}.get(kind, 0)
        timeline.append(dict(counts))
    return tuple(timeline)


def _interleaved_peak(schedule: str, rank_stage: int, pp: int, microbatches: int, chunk_layers: tuple[int, ...]) -> int:
    v = len(chunk_layers)
    layers_of = {rank_stage + k * pp: chunk_layers[k] for k in range(v)}
    timeline = _interleaved_counts(schedule, rank_stage, pp, microbatches, v)
    return max((sum(n * layers_of[s] for s, n in c.items()) for c in timeline), default=0)
