"""Training tokens, their train/eval split, per-cluster batch sampling, and evaluation.

Each cluster samples only from its own contiguous shard of the training tokens so that clusters see
different data, as DiLoCo's clusters would; every random choice goes through a per-cluster
`torch.Generator` so that a run is reproducible and resumable without touching global RNG state. The
tokens are 1-D: bytes of a small corpus read whole (`load_corpus`, the byte-level default), text
tokenised into memory, or a prepared token file read window by window (worker/data/token_file.py).
"""

from __future__ import annotations

import os
import pathlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from dilocox.worker.data.sources import CorpusError, default_corpus_path, input_files
from dilocox.worker.data.token_file import TokenFile
from dilocox.worker.models.contract import lm_loss


def load_corpus(path: str | os.PathLike | None = None, block_size: int | None = None) -> bytes:
    """Read a corpus whole (small corpora, byte-level): None -> the bundled default; a file -> its bytes;
    a folder -> every regular, non-hidden file under it (worker/data/sources.py's order) joined by
    b"\n". With `block_size`, also check it holds one training window. Large corpora go through
    `dilocox data prepare` and a token file streamed from disk instead (worker/data/token_file.py)."""
    p = default_corpus_path() if path is None else pathlib.Path(path)
    files = input_files(p)
    pieces = [file.read_bytes() for file in files]
    if p.is_file() and not pieces[0]:
        raise CorpusError(f"corpus file is empty: {p}")
    if not any(pieces):
        raise CorpusError(f"corpus folder has no non-empty, non-hidden regular files: {p}")
    data = b"\n".join(pieces)
    if block_size is not None:
        check_size(len(data), block_size)
    return data


def _eval_len(n_bytes: int, eval_fraction: float) -> int:
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    return int(n_bytes * eval_fraction)


def check_size(n_bytes: int, block_size: int, *, eval_fraction: float = 0.0, num_shards: int = 1) -> None:
    """Raise CorpusError unless every training shard (and the eval set, if any) holds at least one
    window of block_size + 1 tokens (inputs plus the shifted targets). Call it before training so
    the error names the corpus rather than surfacing as an indexing failure deep in a sampler."""
    n_eval = _eval_len(n_bytes, eval_fraction)
    check_split(n_bytes - n_eval, n_eval, block_size, num_shards, eval_fraction)


def check_split(
    n_train: int, n_eval: int, block_size: int, num_shards: int = 1, eval_fraction: float | None = None
) -> None:
    """`check_size` for a split already made (a prepared token file's manifest fixes its own)."""
    if block_size <= 0 or num_shards <= 0:
        raise ValueError("block_size and num_shards must be positive")
    need = block_size + 1
    smallest_shard = n_train // num_shards
    split = f"eval_fraction={eval_fraction}" if eval_fraction is not None else f"{n_eval} eval tokens"
    if smallest_shard < need:
        raise CorpusError(
            f"corpus too small: {n_train + n_eval} tokens gives {smallest_shard} training tokens per shard "
            f"({num_shards} shard(s), {split}); need at least {need} (block_size {block_size} + 1)"
        )
    if (eval_fraction is None or eval_fraction > 0) and n_eval < need:
        raise CorpusError(
            f"corpus too small: eval set is {n_eval} tokens, need at least {need} (block_size {block_size} + 1)"
        )


def split_corpus(data: bytes, eval_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, eval) uint8 tensors; eval is the LAST eval_fraction of the bytes, so it is a
    contiguous held-out text that no training window overlaps."""
    n_eval = _eval_len(len(data), eval_fraction)
    all_bytes = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    split = len(data) - n_eval
    return all_bytes[:split].clone(), all_bytes[split:].clone()


def _mix_seed(seed: int, shard_index: int) -> int:
    """One 63-bit seed per (seed, shard): neighbouring shards must not get correlated streams."""
    x = (seed * 0x9E3779B97F4A7C15 + shard_index * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) % 2**64
    x ^= x >> 31
    x = (x * 0xBF58476D1CE4E5B9) % 2**64
    x ^= x >> 29
    return x % 2**63


def as_token_array(tokens: np.ndarray | torch.Tensor | TokenFile) -> np.ndarray | TokenFile:
    """1-D token ids: a CPU tensor as a numpy view of its memory, a token file as it is."""
    if isinstance(tokens, TokenFile):
        return tokens
    array = tokens.numpy() if isinstance(tokens, torch.Tensor) else tokens
    return array.reshape(-1)


def gather_windows(tokens: np.ndarray | TokenFile, starts: np.ndarray, length: int) -> torch.Tensor:
    """int64 [len(starts), length]: the windows of `length` tokens at `starts`; from a token file only
    those tokens are read."""
    if isinstance(tokens, TokenFile):
        rows = tokens.windows(starts, length)
    else:
        rows = tokens[starts.astype(np.int64)[:, None] + np.arange(length, dtype=np.int64)[None, :]]
    return torch.from_numpy(rows.astype(np.int64))


SPLITS = ("interleaved", "contiguous")  # how BatchSampler cuts its part out of the tokens it is given
OWN_DATA_SEED_STRIDE = 7919  # "own": sites' samplers differ even if two sites were given the same data


@dataclass(frozen=True)
class DataPart:
    """Which part of its --data one replica of one site samples from, by the run's `data_split`."""

    index: int
    count: int
    split: str
    seed: int


def data_part(
    data_split: str, seed: int, cluster_index: int, num_clusters: int, replica: int = 0, replicas: int = 1
) -> DataPart:
    """ "interleaved"/"contiguous": the sites share one corpus, each replica of each site a 1/(M·dp) part;
    "own": each site's data is its own, its replicas split all of it (interleaved)."""
    if data_split == "own":
        return DataPart(replica, replicas, "interleaved", seed + OWN_DATA_SEED_STRIDE * cluster_index)
    return DataPart(cluster_index * replicas + replica, num_clusters * replicas, data_split, seed)


INTERLEAVE_TOKENS = 4096  # chunk of the interleaved split (smaller only where a shard would not get one)


class BatchSampler:
    """Random (x, y) windows from this cluster's 1/num_shards of the training tokens.

    `train` is 1-D token ids — in memory, or a prepared token file read window by window, never whole.
    `split`: which part is this shard's. "contiguous": the k-th contiguous 1/num_shards — on one text
    corpus each cluster then sees its own stretch of it (the sites-own-their-data case, non-IID).
    "interleaved": chunks of `INTERLEAVE_TOKENS` dealt round-robin (k, k + num_shards, …; a tail shorter
    than a chunk is left out) — every shard a sample of the whole corpus, as when one corpus is split
    across sites (docs/decisions.md). Windows never cross a shard's bounds (or a chunk's), so clusters
    (and the data-parallel replicas inside one) train on disjoint data. The read position is the
    generator's state plus the batch count, both in `state_dict`, so a resumed worker draws exactly the
    batches an uninterrupted one would have.
    """

    def __init__(
        self,
        train: np.ndarray | torch.Tensor | TokenFile,
        block_size: int,
        batch_size: int,
        seed: int,
        shard_index: int = 0,
        num_shards: int = 1,
        split: str = "contiguous",
    ) -> None:
        if num_shards <= 0 or not 0 <= shard_index < num_shards:
            raise ValueError(f"shard_index must be in [0, {num_shards}), got {shard_index}")
        if block_size <= 0 or batch_size <= 0:
            raise ValueError("block_size and batch_size must be positive")
        if split not in SPLITS:
            raise ValueError(f"data split must be one of {', '.join(SPLITS)}, got {split!r}")
        self._tokens = tokens = as_token_array(train)
        n = len(tokens)
        self.block_size = block_size
        self.batch_size = batch_size
        self.seed = seed
        self.shard_index = shard_index
        self.num_shards = num_shards
        self.split = split
        if split == "contiguous":
            self.start, self.end = n * shard_index // num_shards, n * (shard_index + 1) // num_shards
            self._chunk, self._chunk_starts = self.end - self.start, np.array([self.start], dtype=np.int64)
        else:
            self._chunk = min(INTERLEAVE_TOKENS, n // num_shards)  # a small corpus: one chunk per shard (contiguous)
            self._chunk_starts = (
                np.arange(shard_index, n // max(1, self._chunk), num_shards, dtype=np.int64) * self._chunk
            )
            self.start, self.end = (
                (int(self._chunk_starts[0]), int(self._chunk_starts[-1]) + self._chunk)
                if len(self._chunk_starts)
                else (0, 0)
            )
        held = self._chunk * len(self._chunk_starts)
        if self._chunk < block_size + 1:
            raise CorpusError(
                f"shard {shard_index}/{num_shards} has {held} tokens ({split} split), need at least "
                f"{block_size + 1} (block_size + 1)"
                + (f" in each chunk of {self._chunk}" if split == "interleaved" else "")
            )
        self._per_chunk = self._chunk - block_size  # every start of block_size + 1 tokens inside a chunk
        self._num_windows = self._per_chunk * len(self._chunk_starts)
        self._gen = torch.Generator().manual_seed(_mix_seed(seed, shard_index))
        self.batches_drawn = 0

    @property
    def shard_range(self) -> tuple[int, int]:
        """[start, end) of this shard in the training tokens (interleaved: of its first and last chunk)."""
        return self.start, self.end

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * self.block_size

    def next_starts(self) -> np.ndarray:
        """The starts of the next batch's windows in the training tokens (advances the stream)."""
        ix = torch.randint(0, self._num_windows, (self.batch_size,), generator=self._gen).numpy().astype(np.int64)
        self.batches_drawn += 1
        return self._chunk_starts[ix // self._per_chunk] + ix % self._per_chunk

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """x, y: int64 [batch_size, block_size]; y is x shifted left by one token."""
        w = gather_windows(self._tokens, self.next_starts(), self.block_size + 1)
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()

    def state_dict(self) -> dict[str, Any]:
        """Generator state + count, plus the identity of the stream so a mismatched resume fails."""
        return {
            "generator": self._gen.get_state(),
            "batches_drawn": self.batches_drawn,
            "seed": self.seed,
            "shard_index": self.shard_index,
            "num_shards": self.num_shards,
            "block_size": self.block_size,
            "batch_size": self.batch_size,
            "split": self.split,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("seed", "shard_index", "num_shards", "block_size", "batch_size", "split"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(f"sampler state is for {key}={state[key]}, this sampler has {getattr(self, key)}")
        self._gen.set_state(state["generator"])
        self.batches_drawn = int(state["batches_drawn"])


def eval_windows(n_tokens: int, block_size: int, count: int) -> torch.Tensor:
    """`count` window starts spread evenly over the eval data: fixed, so eval losses are comparable
    across rounds and clusters without any randomness."""
    last = n_tokens - (block_size + 1)
    if last < 0:
        raise CorpusError(f"eval data has {n_tokens} tokens, need at least {block_size + 1} (block_size + 1)")
    return torch.linspace(0, last, count, dtype=torch.float64).round().long()


@torch.no_grad()
def evaluate(
    model: nn.Module,
    eval_data: np.ndarray | torch.Tensor | TokenFile,
    block_size: int,
    batch_size: int,
    num_batches: int,
) -> float:
    """Mean loss (nats) over a fixed set of evenly spaced eval windows; the model's mode is restored."""
    if batch_size <= 0 or num_batches <= 0:
        raise ValueError("batch_size and num_batches must be positive")
    tokens = as_token_array(eval_data)
    starts = eval_windows(len(tokens), block_size, batch_size * num_batches).numpy()
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    was_training = model.training
    model.eval()
    try:
        total = 0.0
        for b in range(num_batches):
            w = gather_windows(tokens, starts[b * batch_size : (b + 1) * batch_size], block_size + 1).to(device)
            total += float(lm_loss(model, w[:, :-1], w[:, 1:]))
        return total / num_batches
    finally:
        model.train(was_training)


def evaluate_run(model: nn.Module, config, eval_data: np.ndarray | torch.Tensor | TokenFile) -> float:  # noqa: ANN001 - RunConfig
    """`evaluate` as a run evaluates: `config.eval_batches` batches of `config.inner.batch_size` windows of
    `config.model.block_size` tokens (the sim's global eval, an export's --eval and a cluster's agree)."""
    return evaluate(model, eval_data, config.model.block_size, config.inner.batch_size, config.eval_batches)
