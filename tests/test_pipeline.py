"""Pipeline stages and the reshard plan of a site (pure: shapes only). A whole pp × dp site runs in
tests/test_site.py, tests/test_sim.py and tests/test_checkpoint.py."""

from __future__ import annotations

import math

import pytest
import torch

from dilocox.common.config.run import ModelConfig
from dilocox.worker.models.gpt import GPT
from dilocox.worker.site.mesh import SiteShape
from dilocox.worker.site.reshard import StageResharder, held_rows
from dilocox.worker.train.pipeline_stage import GPTStage, stage_layers


def test_stages_hold_only_their_parameters():
    """Stages partition the model's parameters, with the full names."""
    config = ModelConfig(n_layer=5, n_embd=32)
    torch.manual_seed(0)
    model = GPT(config)
    full = dict(model.named_parameters())
    for pp in (2, 3, 6):
        stages = [GPTStage(model, s, pp) for s in range(pp)]
        names = [set(dict(st.named_parameters())) for st in stages]
        assert set().union(*names) == set(full)
        assert sum(len(n) for n in names) == len(full)  # disjoint
        for st in stages:
            held = sum(p.numel() for p in st.parameters())
            assert held < model.num_params()
    assert [list(stage_layers(5, s, 2)) for s in range(2)] == [[0, 1], [2, 3, 4]]
    with pytest.raises(ValueError, match="leaves a stage empty"):
        stage_layers(2, 0, 4)


@pytest.mark.parametrize("pp, dp, replicate", [(1, 1, 1), (2, 2, 1), (1, 3, 1), (1, 4, 2), (2, 2, 2), (1, 4, 4)])
def test_reshard_plan_moves_every_row_once_to_its_owner_and_back_to_every_holder(pp, dp, replicate):
    """The plan between FSDP's row chunks and whole parameters on their owners: each parameter is owned
    by one replica, gathered from exactly one holder of each row chunk (one sharing the owner's
    replicate coordinate), and scattered to every replica holding those rows."""
    shape = SiteShape(pp, dp, replicate)
    shapes = {f"p{i}": ((i * 37) % 101 + 1, 3 + i % 4) for i in range(17)} | {"bias": (5,), "scalar": ()}
    plans = [StageResharder(shapes, shape, d, sharded=dp > 1, batch_elements=200) for d in range(dp)]
    assert all(plan.owner == plans[0].owner and plan.batches == plans[0].batches for plan in plans)
    owned = [n for plan in plans for n in plan.owned]
    assert sorted(owned) == sorted(shapes) and len(owned) == len(set(owned))
    loads = [sum(math.prod(shapes[n]) for n in plan.owned) for plan in plans]
    assert max(loads) - min(loads) <= max(math.prod(s) for s in shapes.values())
    rows = lambda n: shapes[n][0] if shapes[n] else 1  # noqa: E731
    gathered = [p for batch in plans[0].gather_pieces for p in batch]
    scattered = [p for batch in plans[0].scatter_pieces for p in batch]
    # No all_to_all moves more than the limit into or out of a rank: parameters above it are cut by rows.
    for batch in plans[0].gather_pieces + plans[0].scatter_pieces:
        for d in range(dp):
            numel = lambda p: (p.stop - p.start) * plans[0].row_numel[p.name]  # noqa: E731
            assert (
                sum(numel(p) for p in batch if p.src == d) <= 200 and sum(numel(p) for p in batch if p.dst == d) <= 200
            )
    assert any(len({p.name for p in batch}) == 1 and len(batch) < len(gathered) for batch in plans[0].gather_pieces)

    def merged(pieces: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
        """Row ranges cut by the batch limit, joined again where they continue from the same replica."""
        out: list[tuple[int, int, int]] = []
        for start, stop, who in sorted(pieces):
            if out and out[-1][1] == start and out[-1][2] == who:
                out[-1] = (out[-1][0], stop, who)
            else:
                out.append((start, stop, who))
        return out

    for name in shapes:
        owner = plans[0].owner[name]
        pieces = merged([(p.start, p.stop, p.src) for p in gathered if p.name == name])
        assert all(p.dst == owner for p in gathered if p.name == name)
        assert [(a, b) for a, b, _ in pieces] == sorted(
            {
                plans[0].rows_of(name, d)
                for d in range(dp)
                if plans[0].rows_of(name, d)[1] > plans[0].rows_of(name, d)[0]
            }
        )
        assert pieces[0][0] == 0 and pieces[-1][1] == rows(name)
        for start, stop, src in pieces:
            assert plans[0].rows_of(name, src) == (start, stop)  # the source holds exactly those rows
            assert shape.replicate_coordinate(src) == shape.replicate_coordinate(owner)
        for d in range(dp):
            held = plans[0].rows_of(name, d)
            got = [
                (a, b) for a, b, _ in merged([(p.start, p.stop, d) for p in scattered if p.name == name and p.dst == d])
            ]
            assert got == ([held] if held[1] > held[0] else [])
    assert held_rows(5, 0, 2) == (0, 3) and held_rows(5, 1, 2) == (3, 5) and held_rows(1, 1, 2) == (1, 1)
