"""The paper's regime in `bench wan`: r from a stated model and link, and joining a split AllReduce run."""

from __future__ import annotations

import pytest

from dilocox.bench.wan_modes import ALL_MODES, CurvePoint, Mode, ModeResult
from dilocox.bench.wan_ratio import join_split, paper_regime
from dilocox.common.config.run import RunConfig


def test_ratio_from_a_model_on_a_link():
    regime = paper_regime("dense-107b", sites=2, link_gbit=1.0, step_s=None, gradient_bytes=4)
    assert 106e9 < regime.params < 108e9
    # a ring over 2 sites moves the whole fp32 model through each link per step: 4 bytes × N
    assert regime.allreduce_bytes_per_site == 4 * regime.params
    assert regime.ratio == pytest.approx(4 * regime.params * 8 / 1e9 / 10.0)
    opt = paper_regime("opt-1.3b", sites=2, link_gbit=1.0, step_s=0.05, gradient_bytes=2)
    assert opt.ratio == pytest.approx(2 * opt.params * 8 / 1e9 / 0.05)
    with pytest.raises(SystemExit, match="unknown --paper-model"):
        paper_regime("gpt-5", 2, 1.0, 1.0, 4)
    with pytest.raises(SystemExit, match="--gradient-bytes"):
        paper_regime("opt-1.3b", 2, 1.0, 1.0, 3)


def _result(comm_s: float, compute_s: float, steps: int, curve: list[CurvePoint], train_s: float) -> ModeResult:
    return ModeResult(
        mode="allreduce",
        label="",
        tokens=curve[-1].tokens,
        train_s=train_s,
        initial_eval_loss=curve[0].eval_loss,
        final_eval_loss=curve[-1].eval_loss,
        curve=curve,
        idle_fraction=0.0,
        compute_s=compute_s,
        comm_s=comm_s,
        bytes_sent_per_site=100.0 * steps,
        bytes_received_per_site=100.0 * steps,
        bytes_source="counters",
        app_bytes_sent_per_site=0.0,
        extra={"steps": steps},
    )


def test_join_keeps_the_unshaped_losses_and_takes_the_shaped_collectives():
    unshaped = _result(
        comm_s=1.0,
        compute_s=8.0,
        steps=100,
        curve=[CurvePoint(0, 0.0, 5.0), CurvePoint(500, 5.0, 3.0), CurvePoint(1000, 10.0, 2.0)],
        train_s=10.0,
    )
    shaped = _result(comm_s=4 * 2.0, compute_s=4 * 0.08, steps=4, curve=[CurvePoint(40, 9.0, 4.9)], train_s=9.0)
    joined = join_split(ALL_MODES["allreduce"], shaped, unshaped, shaped_steps=4)
    assert [p.eval_loss for p in joined.curve] == [5.0, 3.0, 2.0] and joined.final_eval_loss == 2.0
    # 10 tokens per step; each point gains (2.0 − 0.01) s per step taken so far
    assert [p.seconds for p in joined.curve] == pytest.approx([0.0, 5.0 + 50 * 1.99, 10.0 + 100 * 1.99])
    assert joined.train_s == pytest.approx(10.0 + 100 * 1.99) and joined.comm_s == pytest.approx(200.0)
    assert joined.bytes_sent_per_site == pytest.approx(100.0 * 100)
    assert joined.extra["split"]["shaped_comm_s_per_step"] == 2.0


def test_ablation_modes_take_one_part_out_of_dilocox():
    base = RunConfig()
    assert (
        ALL_MODES["no-delay"].config(base).delay == 0 and ALL_MODES["no-delay"].config(base).compress == base.compress
    )
    assert ALL_MODES["no-compression"].config(base).compress.codec == "fp32"
    assert ALL_MODES["no-ef"].config(base).compress.error_feedback is False
    assert ALL_MODES["fixed"].config(base).compress.adaptive_rank is False
    assert ALL_MODES["adaptive-h"].config(base).inner.adaptive_steps is True
    for name in ("no-delay", "no-compression", "no-ef", "fixed", "adaptive-h"):
        assert isinstance(ALL_MODES[name], Mode) and ALL_MODES[name].runner == "diloco"
