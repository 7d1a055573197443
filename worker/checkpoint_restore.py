"""Reading a site checkpoint back: `--resume` picks the newest committed checkpoint whose manifest checks
out (damaged newer ones moved aside), refuses one whose AdamW moments are kept another way, and loads it —
DCP resharding to this layout, the compressor state following its parameters, the replica of the global
model from every rank's file; and `read_progress`, one folder's position without its weights.

Mixed into `SiteCheckpoint` (worker/checkpoint.py, where what a checkpoint holds and how it is written and
committed is described), whose state it uses (`root`, `rank`, `replica`, `group`, `path_of`, `rounds`,
`_wait_sealed`); kept apart so that saving and restoring each stay readable. The layout both directions
share (`OPTIM_OPTIONS`, `ROUND_DIR`) is defined here, the module the save side imports.
"""

from __future__ import annotations

import os
import pathlib
import re
import time

import structlog
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from dilocox.common.wire.compression import TensorCompressor
from dilocox.worker.checkpoint_manifest import COMMITTED, REPLICA_FILE_PREFIX, verify
from dilocox.worker.exchange.packed_state import restore_compressor_state, unpack
from dilocox.worker.exchange.replica_state import read_replica
from dilocox.worker.train.light_adamw import optimizer_state_of

log = structlog.get_logger()

# AdamW's state keyed by parameter name (`optim.state.<name>.exp_avg`, `optim.param_groups.<name>.lr`)
# rather than by group index: the stages of a pipeline have different parameters in "group 0", and under
# one key DCP would keep only one stage's (torchtitan flattens for the same reason).
OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
ROUND_DIR = re.compile(r"^round-(\d+)$")


class CheckpointRestore:
    """Mixed into `SiteCheckpoint`: `restore` and the choice of the checkpoint it loads."""

    def _newest_intact(self) -> tuple[str, int | str | None]:
        """Rank 0: ("ok", round) of the newest committed checkpoint whose manifest checks out, damaged newer
        ones moved aside with a warning; ("damaged", reasons) when none is intact (nothing moved);
        ("missing", None) when none is committed."""
        committed = [r for r in self.rounds() if (self.path_of(r) / COMMITTED).exists()]
        refused: list[tuple[int, str]] = []
        for round_ in reversed(committed):
            checked, problem = verify(self.path_of(round_), round_)
            if problem is None:
                break
            refused.append((round_, problem))
        else:
            if not refused:
                return "missing", None
            return "damaged", "; ".join(f"{self.path_of(r).name}: {p}" for r, p in refused)
        if not checked:
            log.warning(
                "worker_checkpoint_unverified",
                round=round_,
                path=str(self.path_of(round_)),
                reason=f"its {COMMITTED} predates the manifest: nothing to check it against",
            )
        for bad, problem in refused:
            folder = self.path_of(bad)
            aside = folder.with_name(f"{folder.name}.refused-{time.strftime('%Y%m%d-%H%M%S')}")
            os.replace(folder, aside)
            log.warning(
                "worker_checkpoint_fallback",
                refused=str(folder),
                reason=problem,
                moved_to=str(aside),
                used=round_,
                path=str(self.path_of(round_)),
                note="an older round, as if stopped earlier: the shards say which round to train",
            )
        return "ok", round_

    def _check_optimizer_state(self, path: pathlib.Path, saved: set[str], wanted: str) -> None:
        """Refuse, before DCP fails on missing keys, a checkpoint whose AdamW moments are kept another way
        (checkpoints from before `--optimizer-state` kept fp32 ones)."""
        kept = {"progress": {"optimizer_state": "fp32"}}
        if "progress.optimizer_state" in saved:
            dcp.load(kept, checkpoint_id=str(path), process_group=self.group, no_dist=self.group is None)
        if kept["progress"]["optimizer_state"] != wanted:
            raise ValueError(
                f"{path} keeps AdamW's moments as {kept['progress']['optimizer_state']}, and this site is configured "
                f"for {wanted}: resume with --optimizer-state {kept['progress']['optimizer_state']} (a run's "
                "optimizer state is not converted in place)"
            )

    def restore(self, trainer, compressor: TensorCompressor | None, names: list[str], client=None) -> int:  # noqa: ANN001
        """Load the newest committed checkpoint into `trainer` and `compressor` (this rank's `names`), and
        the replica of the global model into `client` (installed at its join); returns its round.
        Collective in a site: rank 0 checks the manifests and tells the others."""
        self._wait_sealed()  # a commit of this process still being hashed
        chosen = None
        if self.rank == 0:
            try:
                chosen = self._newest_intact()
            except OSError as error:  # the other ranks wait on the answer: give them one
                chosen = ("damaged", f"cannot check or move the checkpoints: {error}")
        if self.group is not None:
            box = [chosen]
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
            chosen = box[0]
        kind, round_ = chosen
        if kind == "missing":
            legacy = (
                sorted(self.root.parent.glob(f"worker-{self.root.name}-rank*.pt")) if self.root.parent.is_dir() else []
            )
            hint = (
                f"; {legacy[0].name} was written by an older dilocox and cannot be resumed: start without --resume"
                if legacy
                else ""
            )
            raise FileNotFoundError(f"no committed worker checkpoint under {self.root}{hint}")
        if kind == "damaged":
            raise ValueError(f"no intact committed worker checkpoint under {self.root}: {round_}")
        path = self.path_of(round_)
        saved = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
        module, optimizer = trainer.trained_module, trainer.optimizer
        self._check_optimizer_state(path, saved, optimizer_state_of(optimizer))
        data_key = f"replica{self.replica}"
        state = {
            "model": get_model_state_dict(module),
            "optim": get_optimizer_state_dict(module, optimizer, options=OPTIM_OPTIONS),
            "progress": {"step": 0, "tokens_seen": 0, **({"eval_best": 0.0} if "progress.eval_best" in saved else {})},
            "data": {data_key: b""} if f"data.{data_key}" in saved else {},
            "exchange": {name: b"" for name in names if f"exchange.{name}" in saved},
        }
        dcp.load(state, checkpoint_id=str(path), process_group=self.group, no_dist=self.group is None)
        set_model_state_dict(module, state["model"])
        set_optimizer_state_dict(module, optimizer, state["optim"], options=OPTIM_OPTIONS)
        trainer.step = int(state["progress"]["step"])
        trainer.tokens_seen = int(state["progress"]["tokens_seen"])
        if "eval_best" in state["progress"]:  # the loss watch's best before the restart (worker/exchange/loss_watch.py)
            trainer.eval_best = float(state["progress"]["eval_best"])
        reason = "the checkpoint has no sampler for this replica (another --dp)"
        if state["data"]:
            try:
                trainer.sampler.load_state_dict(unpack(state["data"][data_key]))
                reason = ""
            except ValueError as error:  # another split of the data (another --dp or --num-clusters)
                reason = str(error)
        if reason:
            log.warning(
                "data_position_reset", round=round_, replica=self.replica, reason=f"{reason}: its data starts over"
            )
        missing = [n for n in names if n not in state["exchange"]]
        if compressor is not None:
            restore_compressor_state(compressor, state["exchange"], names)
            if missing:
                log.warning("compressor_state_missing", round=round_, parameters=len(missing), example=missing[0])
        replica_slices = 0
        if client is not None:  # the files of every rank: another layout's owner of a name may have written it
            replica_slices = client.restore_replica_slices(
                read_replica(sorted(path.glob(f"{REPLICA_FILE_PREFIX}*.pt")), names), names
            )
        log.info(
            "worker_checkpoint_restored",
            round=round_,
            path=str(path),
            step=trainer.step,
            replica_slices=replica_slices,
            eval_best=getattr(trainer, "eval_best", None),
        )
        return round_


def read_progress(path: str | os.PathLike) -> dict:
    """The round, inner step, tokens and every replica's data position of one checkpoint folder, without
    loading weights (one process, no process group)."""
    path = pathlib.Path(path)
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    replicas = sorted(key.split(".", 1)[1] for key in saved if key.startswith("data."))
    state = {"progress": {"step": 0, "tokens_seen": 0}, "data": {r: b"" for r in replicas}}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    match = ROUND_DIR.match(path.name)
    return {
        "round": int(match.group(1)) if match else None,
        "committed": (path / COMMITTED).exists(),
        **state["progress"],
        "data": {r: unpack(v) for r, v in state["data"].items()},
    }
