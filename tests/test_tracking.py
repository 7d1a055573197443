"""Run tracking (worker/tracking.py): per-round scalars as TensorBoard events, read back as TensorBoard reads them.

The end-to-end check on a real `dilocox sim` lives in tests/test_sim.py, on a sim that module runs anyway.
"""

from __future__ import annotations

import math
import pathlib
import sys
import types

import pytest
import structlog
import structlog.testing

from dilocox.common import cli
from dilocox.worker import tracking
from dilocox.worker.exchange.round_report import RoundReport
from dilocox.worker.tracking import RunTracker, TensorBoardSink, WandbSink, round_scalars

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

TAGS = {
    "loss/train",
    "loss/eval",
    "tokens/round",
    "tokens/per_s",
    "bytes/up",
    "bytes/down",
    "time/round_s",
    "time/compute_s",
    "time/comm_s",
    "time/idle_s",
    "exchange/overlap",
    "exchange/rank",
    "exchange/inner_steps",
    "exchange/residual_norm",
    "exchange/late",
}


def report(round_: int, eval_loss: float | None = None) -> RoundReport:
    eval_loss = 3.1 - 0.5 * round_ if eval_loss is None else eval_loss
    return RoundReport(
        round=round_,
        train_loss=3.0 - 0.5 * round_,
        eval_loss=eval_loss,
        tokens=4096,
        bytes_up=1000 + round_,
        bytes_down=2000 + round_,
        compute_s=1.5,
        comm_s=0.4,
        idle_s=0.1 * round_,
        seconds=2.0,
        overlap=0.75,
        residual_norm=0.01 * round_,
        inner_steps=20,
        late=round_ == 2,
        compress_rank=4.0 + round_,
    )


def read_scalars(logdir: pathlib.Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} of every event file under `logdir`, as TensorBoard loads them."""
    events = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_every_scalar_has_one_point_per_round_with_its_value(tmp_path):
    tracker = RunTracker([TensorBoardSink(tmp_path / "cluster-0")])
    reports = [report(r) for r in (1, 2, 3)]
    for r in reports:
        tracker.observe_round(r, 24, r.round)
        # flushed every round: a run killed now still leaves this round on disk
        assert len(read_scalars(tmp_path / "cluster-0")["loss/train"]) == r.round
    tracker.close()
    scalars = read_scalars(tmp_path / "cluster-0")
    assert set(scalars) == TAGS
    for r in reports:
        expected = round_scalars(r, 24)
        for tag in TAGS:
            assert [v for step, v in scalars[tag] if step == r.round] == pytest.approx([expected[tag]], rel=1e-6), tag
    assert all(len(points) == 3 for points in scalars.values())
    assert scalars["tokens/per_s"][0][1] == pytest.approx(4096 / 2.0)
    assert scalars["exchange/inner_steps"][0][1] == 24  # H as trained, from the hook, not the report's copy
    assert [v for _, v in scalars["exchange/late"]] == [0.0, 1.0, 0.0]
    assert [v for _, v in scalars["exchange/rank"]] == [5.0, 6.0, 7.0]


def test_a_round_without_evaluation_leaves_no_eval_point():
    scalars = round_scalars(report(1, eval_loss=math.nan), 20)
    assert "loss/eval" not in scalars and set(scalars) == TAGS - {"loss/eval"}
    assert round_scalars(report(1), 20)["tokens/per_s"] == 2048.0
    assert round_scalars(RoundReport(1, 2.0, 2.0, 10, 0, 0, 0.0, 0.0, 0.0, 0.0, 1.0), 1)["tokens/per_s"] == 0.0


def test_a_failing_sink_is_dropped_and_training_goes_on():
    class Broken:
        def write(self, scalars, step):  # noqa: ANN001
            raise OSError("No space left on device")

        def close(self) -> None:
            pass

    written = []

    class Kept:
        def write(self, scalars, step):  # noqa: ANN001
            written.append(step)

        def close(self) -> None:
            pass

    tracker = RunTracker([Broken(), Kept()])
    tracker(report(1), 20, 1)  # the `on_round` signature: callable as the hook
    tracker(report(2), 20, 2)
    assert written == [1, 2] and [type(s).__name__ for s in tracker.sinks] == ["Kept"]
    tracker.close()


def test_wandb_gets_the_same_scalars_per_round(monkeypatch):
    """The W&B path against a stand-in module (the real wandb is no test dependency): one run per cluster,
    offline by default, one `log` per round at step = round, `finish` at the end."""
    calls = []

    class Run:
        def log(self, scalars, step):  # noqa: ANN001
            calls.append(("log", step, scalars))

        def finish(self) -> None:
            calls.append(("finish",))

    def init(**kwargs):  # noqa: ANN003
        calls.append(("init", kwargs))
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    args = parse_worker(["--wandb-project", "dilocox-test"])
    assert args.wandb_mode == "offline"
    tracker = tracking.tracker_from_args(args, "cluster-1")
    assert isinstance(tracker.sinks[0], WandbSink)
    tracker(report(1), 20, 1)
    tracker.close()
    assert calls[0] == ("init", {"project": "dilocox-test", "name": "cluster-1", "mode": "offline"})
    assert calls[1] == ("log", 1, round_scalars(report(1), 20)) and calls[2] == ("finish",)


def parse_worker(flags: list[str], environ: dict[str, str] | None = None):
    argv = ["worker", "--servers", "127.0.0.1:1", "--insecure", *flags]
    return cli.build_parser(argv, environ or {}).parse_args(argv)


def test_tensorboard_dir_from_the_environment_and_one_subfolder_per_cluster(tmp_path):
    args = parse_worker([], {"DILOCOX_TENSORBOARD_DIR": str(tmp_path / "tb")})
    assert args.tensorboard_dir == tmp_path / "tb" and args.wandb_project is None
    tracker = tracking.tracker_from_args(args, "site-a")
    tracker(report(1), 20, 1)
    tracker.close()
    assert set(read_scalars(tmp_path / "tb" / "site-a")) == TAGS
    assert tracking.tracker_from_args(parse_worker([]), "site-a") is None


@pytest.fixture
def logging_restored():
    """`dilocox worker` run in-process points structlog at this test's captured stderr: put it back after."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


def test_missing_packages_stop_the_worker_with_the_install_command(tmp_path, monkeypatch, logging_restored):
    monkeypatch.setattr(tracking, "tensorboard_available", lambda: False)
    with pytest.raises(SystemExit) as info:  # before any model, data or connection
        cli.main(["worker", "--servers", "127.0.0.1:1", "--insecure", "--tensorboard-dir", str(tmp_path)])
    assert str(info.value.code) == (
        "dilocox worker: --tensorboard-dir needs the tensorboard package: pip install 'dilocox[tracking]'"
    )
    monkeypatch.setattr(tracking.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit, match="--wandb-project needs the wandb package: pip install wandb"):
        tracking.check_tracking_args(parse_worker(["--wandb-project", "p"]))


def test_sim_without_tensorboard_says_so_once_and_runs_without(tmp_path, monkeypatch):
    from dilocox.sim import tensorboard_curves

    monkeypatch.setattr(tensorboard_curves, "tensorboard_available", lambda: False)
    argv = ["sim", "--log-dir", str(tmp_path)]
    args = cli.build_parser(argv, {}).parse_args(argv)
    with structlog.testing.capture_logs() as logs:
        assert tensorboard_curves.tensorboard_dir(args, tmp_path) is None
    assert [e["event"] for e in logs] == ["sim_tensorboard_off"] and "dilocox[tracking]" in logs[0]["fix"]
    monkeypatch.setattr(tensorboard_curves, "tensorboard_available", lambda: True)
    assert tensorboard_curves.tensorboard_dir(args, tmp_path) == tmp_path / "tensorboard"
    args.no_tensorboard = True
    assert tensorboard_curves.tensorboard_dir(args, tmp_path) is None
