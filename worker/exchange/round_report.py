"""What one cluster reports of each round: the `round_done` log line, metrics and progress read it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RoundReport:
    round: int
    train_loss: float
    eval_loss: float
    tokens: int
    bytes_up: int
    bytes_down: int
    compute_s: float
    comm_s: float  # push + pull of the exchange folded in at this boundary
    idle_s: float  # seconds the trainer blocked on the network at this boundary
    seconds: float  # wall time of the round, boundary included
    overlap: float  # share of comm_s hidden behind compute: 1 − idle/comm (1.0 when nothing was awaited)
    # ‖e‖ of this rank's error-feedback residuals after the round (what compression still holds back;
    # bounded when error feedback works); 0 without error feedback. With the delay it may lag a round.
    residual_norm: float = 0.0
    inner_steps: int = 0  # H this round trained
    # A shard closed the round this boundary collected without our part (quorum + grace): that part, with
    # its tokens, went with this round's push instead.
    late: bool = False
    # Mean rank of this rank's low-rank tensors in its latest compressed push (0.0 without a low-rank codec);
    # like residual_norm, with the delay it may lag a round.
    compress_rank: float = 0.0
    # Inner steps of this round trained before the previous round's merged model was taken in: H with the
    # plain one-step delay (at this boundary), fewer where `overlap_steps` merged it mid-round, 0 where
    # nothing was in flight (the first round, a synchronous one).
    merged_at_step: int = 0
    # What the site's loss watch made of the round (worker/exchange/loss_watch.py): "spike", "rising",
    # "nonfinite" or "" — its eval over the best eval before it (nan: not evaluated, or nothing to compare
    # yet), and the rounds in a row its eval has been over RISE_RATIO × the best.
    loss_alarm: str = ""
    eval_to_best: float = float("nan")
    loss_rising_rounds: int = 0
