"""DiLoCoX from your own training loop.

    from dilocox import DiLoCoX, RunConfig

    with DiLoCoX(model, servers="127.0.0.1:50051", config=RunConfig(rounds=8), cluster="site-a") as dx:
        while not dx.done:
            loss = my_train_step(model, optimizer, next(batches))
            dx.step(tokens=tokens_in_batch, loss=loss)

Every name below is the stable, documented surface (docs/api.md); everything under `dilocox.worker`,
`dilocox.server` and `dilocox.common` is internal and may change between releases. `DiLoCoXCallback`
(the Hugging Face `Trainer` callback) needs the `models` extra.

This package is the `dilocox` namespace's root; in the repository it lives in worker/api/ (the top-level
layout is fixed; docs/decisions.md, "The public API's home").
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# name -> the module that defines it. Imported on first use: every `dilocox.*` module (a shard's, the
# console script's) loads this package first, and a shard must not pay for torch.distributed or the
# worker's code it never runs.
_HOMES = {
    "AggregatorError": "dilocox.worker.exchange.aggregator_client",
    "CompressionConfig": "dilocox.common.config.run",
    "DiLoCoX": "dilocox.site",
    "DiLoCoXCallback": "dilocox.hf_trainer",
    "InnerConfig": "dilocox.common.config.run",
    "LateJoin": "dilocox.worker.exchange.admission",
    "LightAdamW": "dilocox.worker.train.light_adamw",
    "ModelConfig": "dilocox.common.config.run",
    "OuterConfig": "dilocox.common.config.run",
    "ParallelConfig": "dilocox.common.config.run",
    "RoundReport": "dilocox.worker.exchange.round_report",
    "RunConfig": "dilocox.common.config.run",
    "RunFinished": "dilocox.worker.exchange.admission",
    "RunLengthMismatch": "dilocox.worker.exchange.admission",
    "SiteMesh": "dilocox.worker.site.mesh",
    "TlsFiles": "dilocox.common.security",
    "configure_logging": "dilocox.common.logs",
    "WireConfig": "dilocox.common.config.run",
    "load_run_config": "dilocox.common.config.load",
    "MaterializeError": "dilocox.worker.models.materialize",
    "materialize": "dilocox.worker.models.materialize",
    "meta_skeleton": "dilocox.worker.models.materialize",
    "parameters_on_meta": "dilocox.worker.models.materialize",
    "tokenizer_identity": "dilocox.site",
}
__all__ = sorted(_HOMES)

if TYPE_CHECKING:
    from dilocox.common.config.load import load_run_config
    from dilocox.common.config.run import (
        CompressionConfig,
        InnerConfig,
        ModelConfig,
        OuterConfig,
        ParallelConfig,
        RunConfig,
        WireConfig,
    )
    from dilocox.common.logs import configure_logging
    from dilocox.common.security import TlsFiles
    from dilocox.hf_trainer import DiLoCoXCallback
    from dilocox.site import DiLoCoX, tokenizer_identity
    from dilocox.worker.exchange.admission import LateJoin, RunFinished, RunLengthMismatch
    from dilocox.worker.exchange.aggregator_client import AggregatorError
    from dilocox.worker.exchange.round_report import RoundReport
    from dilocox.worker.models.materialize import MaterializeError, materialize, meta_skeleton, parameters_on_meta
    from dilocox.worker.site.mesh import SiteMesh
    from dilocox.worker.train.light_adamw import LightAdamW


def __getattr__(name: str) -> object:
    if name in _HOMES:
        value = getattr(importlib.import_module(_HOMES[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'dilocox' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))
