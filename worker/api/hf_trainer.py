"""`dilocox.DiLoCoXCallback`: a Hugging Face `Trainer` run as one DiLoCoX site.

The `Trainer` keeps everything it does (its optimizer and schedule, gradient accumulation, mixed
precision, logging); the callback joins the run when training begins and calls `DiLoCoX.step` after
every optimizer step, so every H steps the model syncs with the other sites. It stops the `Trainer` once
the run's last round is in (the model then holds the run's final global weights). Give the `Trainer` at
least rounds × H steps (`max_steps`); fewer, and the site stops short, with a warning.

Tokens per step, which weigh the site's pseudo-gradient: the `Trainer`'s own count when
`include_num_input_tokens_seen` is on (every token of every process), else a fixed `tokens_per_step`.
The `Trainer` hands its callbacks no loss, so the rounds' reports carry none (nan); its own logs have it.
"""

from __future__ import annotations

import structlog
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from dilocox.site import DiLoCoX

log = structlog.get_logger()


class DiLoCoXCallback(TrainerCallback):
    def __init__(self, site: DiLoCoX, tokens_per_step: int | None = None) -> None:
        """`site`: the DiLoCoX site made from the `Trainer`'s model. `tokens_per_step`: the tokens one
        optimizer step trains on this site, where the `Trainer` does not count them."""
        self.site = site
        self.tokens_per_step = tokens_per_step
        self._tokens_seen = 0

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs) -> None:
        counted = getattr(args, "include_num_input_tokens_seen", "no") not in ("no", False, None)
        if not counted and not self.tokens_per_step:
            raise ValueError(
                "DiLoCoXCallback needs the tokens of each step: set "
                "TrainingArguments(include_num_input_tokens_seen='all') "
                "or give tokens_per_step"
            )
        self._tokens_seen = state.num_input_tokens_seen
        self.site.start()  # join; the model now holds the run's global weights

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs) -> None:
        if self.site.done:
            control.should_training_stop = True
            return
        tokens = state.num_input_tokens_seen - self._tokens_seen
        self._tokens_seen = state.num_input_tokens_seen
        self.site.step(tokens=tokens if tokens > 0 else int(self.tokens_per_step or 0))
        if self.site.done:
            control.should_training_stop = True

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs) -> None:
        if not self.site.done:
            log.warning(
                "trainer_stopped_before_run_end",
                round=self.site.round,
                steps_to_sync=self.site.steps_to_sync,
                hint="give the Trainer at least rounds × H steps (max_steps)",
            )
