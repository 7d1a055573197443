"""Typed configuration of a run.

Every knob of a run is a field of one of these dataclasses; the CLI flags are generated from the same
names (run_flags.py) so that a flag, a TOML key and a field never drift apart. Defaults are the embedded local
simulation (`dilocox sim` with no arguments): a small byte-level GPT on the bundled corpus that trains
to a useful loss on two CPU cores in a few minutes.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field

from dilocox.common.config.parallel import PIPELINE_SCHEDULES, ParallelConfig  # noqa: F401  (re-exported: the run's layout)
from dilocox.common.config.sources import GROUP_FLAG_PREFIXES
from dilocox.common.wire.compression import CompressionConfig
from dilocox.common.wire.staleness import STALE_WEIGHTINGS


@dataclass(frozen=True)
class ModelConfig:
    """Which model a cluster trains, and the built-in GPT's shape.

    `model`: `gpt` (the built-in nanoGPT-style model, shaped by the fields below), a preset name
    (`llama-tiny`, `llama-20m`, `gpt2-small`, `llama-350m`, `llama-1b`: Hugging Face configurations
    shipped with the project), a path to a Hugging Face `config.json`, or `module:function` returning an
    `nn.Module` (worker/models/). `block_size` is the training context of every model. The vocabulary
    comes from the run's tokenizer (`vocab_size` is the byte-level default); a `config.json` keeps its
    own and must hold the tokenizer's. `weights`: a local `.safetensors` file to continue from.
    """

    model: str = "gpt"
    weights: str = ""
    vocab_size: int = 256
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


# The built-in GPT's shape: a Hugging Face model (a preset or a config.json) has its own in its
# configuration, so records of such a run leave these out (`in_use`).
GPT_SHAPE_FIELDS = ("vocab_size", "n_layer", "n_head", "n_embd", "dropout")


def in_use(config: RunConfig) -> dict:
    """`config` as a dict without the fields its model ignores: a Hugging Face model's run carries no
    GPT shape (the built-in GPT and `module:function` models, which are handed the ModelConfig, keep it)."""
    data = as_dict(config)
    model = config.model.model
    if model != "gpt" and ":" not in model:
        data["model"] = {k: v for k, v in data["model"].items() if k not in GPT_SHAPE_FIELDS}
    return data


@dataclass(frozen=True)
class InnerConfig:
    """The inner (local) optimiser: AdamW for `steps` (H) steps per round."""

    steps: int = 50
    batch_size: int = 16
    grad_accum: int = 1  # micro-steps whose gradients add up to one inner step (batch_size each)
    lr: float = 3e-3
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    warmup_steps: int = 20
    # Grow H (up to max_steps) when a round's exchange takes longer than its compute; single-process
    # clusters only (a pipeline's ranks keep H fixed so their schedules stay in step). Off by default:
    # the exchange time includes waiting for the slowest cluster, and runs compare at equal tokens.
    adaptive_steps: bool = False
    max_steps: int = 200
    # Time-boxed rounds: > 0 makes every site train about this many seconds per round, setting
    # its own H from its measured step time (within min_steps..max_steps), so uneven sites deliver
    # together; its pseudo-gradient carries its true tokens. 0: every site trains H = `steps` (the paper).
    round_time_s: float = 0.0
    min_steps: int = 1

    def __post_init__(self) -> None:
        if self.grad_accum < 1:
            raise ValueError(f"grad_accum must be ≥ 1, got {self.grad_accum}")
        if self.round_time_s < 0:
            raise ValueError(f"inner round_time_s must be ≥ 0 (0: fixed H), got {self.round_time_s}")
        if not 1 <= self.min_steps <= max(self.steps, self.max_steps):
            raise ValueError(f"inner min_steps must be in [1, max(steps, max_steps)], got {self.min_steps}")


@dataclass(frozen=True)
class OuterConfig:
    """The outer optimiser run by the shards: SGD with Nesterov momentum.

    DiLoCo's 0.7/0.9 suit synchronous rounds; with the one-step delay and compressed pseudo-gradients
    with error feedback a lower momentum measured better for both forms (docs/decisions.md).
    """

    lr: float = 0.9
    momentum: float = 0.3

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"outer lr must be positive, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"outer momentum must be in [0, 1), got {self.momentum}")


@dataclass(frozen=True)
class WireConfig:
    """How tensors travel: chunk size (well under gRPC's 4 MiB default) and zstd level."""

    chunk_bytes: int = 2 * 1024 * 1024
    zstd_level: int = 1
    max_message_bytes: int = 8 * 1024 * 1024
    # Compare each replayed outer step with the shard's state digest (32 bytes per shard and round) and
    # pull in full on a mismatch; off only to talk to shards from before the check.
    replay_check: bool = True
    # gRPC keepalive: a connection silent this long is pinged, and one whose ping goes unanswered for as
    # long again is dropped, so a half-open connection (a partition that lost a reply or a reset) fails
    # its call in ≤ 2× this and the site's outage path retries it (worker/exchange/shard_wait.py). 30 s
    # is far above a WAN's round trip and well below NAT/firewall idle timeouts (often ≥ 60 s).
    keepalive_s: float = 30.0
    # torch threads for a rank's exchange, apart from the training thread's own count (torchrun's
    # OMP_NUM_THREADS=1 otherwise leaves the exchange one core); 0: automatic (worker/exchange/threads.py).
    exchange_threads: int = 0

    def __post_init__(self) -> None:
        if self.exchange_threads < 0:
            raise ValueError(f"wire exchange_threads must be ≥ 0 (0: automatic), got {self.exchange_threads}")
        if not self.keepalive_s > 0:
            raise ValueError(f"wire keepalive_s must be positive, got {self.keepalive_s}")

    def keepalive_options(self, server: bool = False) -> list[tuple[str, int]]:
        """gRPC channel/server options for `keepalive_s`. The server also accepts pings as often as a
        client may send them (its default refuses pings more often than every 5 min with GOAWAY)."""
        ms = int(self.keepalive_s * 1000)
        options = [
            ("grpc.keepalive_time_ms", ms),
            ("grpc.keepalive_timeout_ms", ms),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.http2.min_ping_interval_without_data_ms", ms),
            ("grpc.http2.ping_timeout_ms", ms),
        ]
        if server:
            options += [
                ("grpc.http2.min_recv_ping_interval_without_data_ms", min(ms, 1000)),
                ("grpc.http2.max_ping_strikes", 0),
            ]
        return options


# worker/data/corpus.py, data_part: "own" = every site's --data is its own, trained on whole by that site
DATA_SPLITS = ("interleaved", "contiguous", "own")
DELAYED_STARTS = ("own", "eager", "estimate")  # worker/exchange/delayed_start.py


@dataclass(frozen=True)
class RunConfig:
    """Everything a cluster needs to take part in a run.

    Defaults are the embedded simulation's; the outer optimiser's are chosen for the one-step delay
    (see docs/decisions.md, "Outer learning rate and momentum").
    """

    run_id: str = "dilocox-sim"
    rounds: int = 16
    # 1: one-step-delay overlap (DiLoCoX); 0: synchronous DiLoCo, the reference.
    delay: int = 1
    # With the delay: the first `sync_rounds` rounds synchronous (a warm-up, while pseudo-gradients are
    # large), and where the next round starts: "own" (θ_{t-1} − Δ_t, DESIGN.md §3), "eager" (Eager updates,
    # arXiv 2502.12996) or "estimate" (the outer step on an estimate of the round's mean), see
    # worker/exchange/delayed_start.py.
    sync_rounds: int = 0
    delayed_start: str = "own"
    # With the delay: take the previous round's merged model in from this many inner steps into the next
    # round on (Streaming DiLoCo's overlap τ), at the first step it is back, instead of at that round's
    # end; 0 (or ≥ H): at the end, the plain one-step delay. Never waits mid-round: what is not back by
    # the round's end the boundary takes in (worker/exchange/cluster.py, docs/decisions.md). With the
    # `own` start only: the other rules take it in at the round's end.
    overlap_steps: int = 1
    # How work pushed later than the round it was trained for weighs (a carried part, a late site catching
    # up): "inverse" (its tokens × 1/(1 + age in rounds)), "lenient" (a round late counts whole, older work
    # 1/age) or "full" (its tokens); the shards cap it at the mean of the round's on-time contributions
    # either way (common/wire/staleness.py).
    stale_weighting: str = "inverse"
    seed: int = 1234
    eval_batches: int = 8
    # byte (the default: bytes are tokens), bpe:VOCAB (a byte-level BPE trained on the training data,
    # cached by content), or a path to a tokenizer.json; see worker/data/tokenizer.py.
    tokenizer: str = "byte"
    # Which part of the training tokens each cluster (and each replica inside one) samples from:
    # "interleaved" (round-robin chunks: a sample of the whole corpus, as when one corpus is split across
    # sites) or "contiguous" (its own stretch: non-IID on one text); worker/data/corpus.py, BatchSampler;
    # docs/decisions.md, "Splitting one corpus across clusters". "own": each site's --data is its own
    # (the data already lives at each site), so the site trains on all of it, its replicas interleaved.
    data_split: str = "interleaved"
    model: ModelConfig = field(default_factory=ModelConfig)
    inner: InnerConfig = field(default_factory=InnerConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    wire: WireConfig = field(default_factory=WireConfig)
    # Uplink pseudo-gradients; the sim gives its shards the same settings for the downlink.
    compress: CompressionConfig = field(default_factory=CompressionConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    @property
    def final_version(self) -> int:
        """The global version a run ends on: one per round, plus the end-of-run flush of the residuals
        where the clusters keep them locally (worker/exchange/cluster.py, docs/decisions.md)."""
        flushes = self.compress.codec != "fp32" and self.compress.flushes_residuals  # fp32: no compressor, no residual
        return self.rounds + (1 if flushes else 0)

    def __post_init__(self) -> None:
        if self.delay not in (0, 1):
            raise ValueError(f"delay must be 0 or 1, got {self.delay}")
        if self.sync_rounds < 0:
            raise ValueError(f"sync_rounds must be ≥ 0, got {self.sync_rounds}")
        if self.overlap_steps < 0:
            raise ValueError(f"overlap_steps must be ≥ 0, got {self.overlap_steps}")
        if self.data_split not in DATA_SPLITS:
            raise ValueError(f"data_split must be one of {', '.join(DATA_SPLITS)}, got {self.data_split!r}")
        if self.delayed_start not in DELAYED_STARTS:
            raise ValueError(f"delayed_start must be one of {', '.join(DELAYED_STARTS)}, got {self.delayed_start!r}")
        if self.stale_weighting not in STALE_WEIGHTINGS:
            raise ValueError(
                f"stale_weighting must be one of {', '.join(STALE_WEIGHTINGS)}, got {self.stale_weighting!r}"
            )
        if self.rounds < 1:
            raise ValueError(f"rounds must be ≥ 1, got {self.rounds}")
        if self.parallel.pp > 1 and self.inner.batch_size % self.parallel.microbatches:
            raise ValueError(
                f"batch size {self.inner.batch_size} is not divisible into {self.parallel.microbatches} microbatches"
            )
        par = self.parallel
        for m in (
            {par.microbatches, par.microbatches * self.inner.grad_accum}
            if par.schedule.startswith("interleaved")
            else ()
        ):
            if m % max(1, m // par.pp):  # torch's interleaved schedules run m in rounds of m // (m // pp)
                raise ValueError(
                    f"--schedule {par.schedule} runs {m} microbatches in {m // par.pp} rounds, which must divide "
                    f"them: use --microbatches (× --inner-grad-accum) a multiple of --pp {par.pp}, or fewer than it"
                )


def as_dict(config: object) -> dict:
    """A plain, JSON-serialisable dict of a (nested) config dataclass."""
    return dataclasses.asdict(config)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- dicts and files (flags: run_flags.py)
# The groups a nested dict or a file's tables name (`[inner]`, `[outer]`, …), the fields of the others top level.
_GROUPS = GROUP_FLAG_PREFIXES  # defined in config/sources.py, which reads `[inner] steps` from files


def from_dict(data: dict, base: RunConfig | None = None) -> RunConfig:
    """Overlay a nested dict (as read from TOML/JSON) on `base`; unknown keys are an error."""
    base = base or RunConfig()
    known = {f.name for f in dataclasses.fields(RunConfig)}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"unknown config keys: {sorted(unknown)}; known: {sorted(known)}")
    top = {}
    for key, value in data.items():
        if key in _GROUPS:
            current = getattr(base, key)
            sub_known = {f.name for f in dataclasses.fields(current)}
            bad = set(value) - sub_known
            if bad:
                raise ValueError(f"unknown keys in [{key}]: {sorted(bad)}; known: {sorted(sub_known)}")
            top[key] = dataclasses.replace(current, **value)
        else:
            top[key] = value
    return dataclasses.replace(base, **top)


def toml_value(v: object) -> str:
    """One TOML value: booleans, numbers (nan/inf too), strings; paths as strings."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return repr(v) if v == v and abs(v) != float("inf") else ("nan" if v != v else ("inf" if v > 0 else "-inf"))
    if isinstance(v, int):
        return str(v)
    if isinstance(v, (str, os.PathLike)):
        return json.dumps(str(v))  # JSON's string escapes are valid TOML basic-string escapes
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def to_toml(config: RunConfig, only_in_use: bool = False) -> str:
    """`config` as a TOML file that `--config` (and `from_dict`) read back to an equal RunConfig;
    `only_in_use`: without the fields its model ignores (`in_use`), for people to read."""
    data = in_use(config) if only_in_use else as_dict(config)
    top, tables = [], []
    for key, v in data.items():
        if isinstance(v, dict):
            tables.append(f"\n[{key}]")
            tables += [f"{name} = {toml_value(x)}" for name, x in v.items()]
        else:
            top.append(f"{key} = {toml_value(v)}")
    return "\n".join(top + tables) + "\n"


def _recorded(run_config_json: str) -> RunConfig | None:
    """A run configuration recorded as JSON (the first cluster's, on the shards); None if unknown or unreadable."""
    try:
        data = json.loads(run_config_json or "{}")
        return from_dict(data) if data else None
    except (ValueError, TypeError):
        return None


def flush_version_of(run_config_json: str) -> int | None:
    """The version the end-of-run flush of the residuals makes, of a run recorded as JSON; None where the run
    has no flush or is unknown. The shards' update check does not judge it by training rounds' rules."""
    config = _recorded(run_config_json)
    return config.final_version if config is not None and config.final_version > config.rounds else None


def final_version_of(run_config_json: str) -> int | None:
    """The final version of a run recorded as JSON (the first cluster's, on the shards); None if unknown."""
    config = _recorded(run_config_json)
    return config.final_version if config is not None else None
