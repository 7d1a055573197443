"""Tests of the corpus loading, split, batch sampling and evaluation in dilocox.worker.data.corpus."""

from __future__ import annotations

import math

import pytest
import torch

from dilocox.common.config.run import ModelConfig
from dilocox.worker.data.corpus import (
    BatchSampler,
    CorpusError,
    check_size,
    default_corpus_path,
    evaluate,
    load_corpus,
    split_corpus,
)
from dilocox.worker.models.gpt import GPT


def test_default_corpus():
    path = default_corpus_path()
    assert path.name == "tinyshakespeare.txt" and path.is_file()
    data = load_corpus(None)
    assert data == path.read_bytes()
    assert data.startswith(b"First Citizen") and len(data) > 1_000_000


def test_load_file(tmp_path):
    f = tmp_path / "c.txt"
    f.write_bytes(b"hello\x00\xffworld")
    assert load_corpus(f) == b"hello\x00\xffworld"
    assert load_corpus(str(f)) == b"hello\x00\xffworld"


def test_load_folder_sorted_recursive_hidden_skipped(tmp_path):
    (tmp_path / "b.txt").write_bytes(b"B")
    (tmp_path / "a.txt").write_bytes(b"A")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_bytes(b"C")
    (tmp_path / ".hidden.txt").write_bytes(b"H1")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "x.txt").write_bytes(b"H2")
    (tmp_path / "sub" / ".y").write_bytes(b"H3")
    assert load_corpus(tmp_path) == b"A\nB\nC"


def test_missing_and_empty_errors(tmp_path):
    with pytest.raises(CorpusError, match="does not exist"):
        load_corpus(tmp_path / "nope")
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(CorpusError, match="empty"):
        load_corpus(empty)
    folder = tmp_path / "d"
    folder.mkdir()
    (folder / ".only_hidden").write_bytes(b"x")
    with pytest.raises(CorpusError, match="no non-empty"):
        load_corpus(folder)
    assert issubclass(CorpusError, ValueError)


def test_too_small_errors(tmp_path):
    f = tmp_path / "small.txt"
    f.write_bytes(b"x" * 10)
    with pytest.raises(CorpusError, match="too small"):
        load_corpus(f, block_size=10)
    assert load_corpus(f, block_size=9) == b"x" * 10
    check_size(1000, 64, eval_fraction=0.1, num_shards=1)
    with pytest.raises(CorpusError, match="eval"):
        check_size(500, 64, eval_fraction=0.1)
    with pytest.raises(CorpusError, match="shard"):
        check_size(1000, 64, eval_fraction=0.1, num_shards=16)


def test_split_sizes_and_eval_is_tail():
    data = bytes(range(256)) * 4  # 1024 bytes
    train, ev = split_corpus(data, 0.1)
    assert train.dtype == torch.uint8 and ev.dtype == torch.uint8
    assert train.numel() + ev.numel() == 1024 and ev.numel() == 102
    assert bytes(ev.tolist()) == data[-102:]
    assert bytes(train.tolist()) == data[:-102]
    with pytest.raises(ValueError):
        split_corpus(data, 1.0)


def _train_tensor(n: int = 4000) -> torch.Tensor:
    return torch.arange(n, dtype=torch.int64).remainder(251).to(torch.uint8)


def test_sampler_shapes_shift_and_determinism():
    train = _train_tensor()
    a = BatchSampler(train, block_size=16, batch_size=5, seed=3)
    b = BatchSampler(train, block_size=16, batch_size=5, seed=3)
    c = BatchSampler(train, block_size=16, batch_size=5, seed=4)
    assert a.tokens_per_batch == 80
    xa, ya = a.next_batch()
    assert xa.shape == ya.shape == (5, 16) and xa.dtype == ya.dtype == torch.int64
    assert torch.equal(xa[:, 1:], ya[:, :-1])
    xb, yb = b.next_batch()
    assert torch.equal(xa, xb) and torch.equal(ya, yb)
    xc, _ = c.next_batch()
    assert not torch.equal(xa, xc)
    before = torch.random.get_rng_state()
    a.next_batch()
    assert torch.equal(before, torch.random.get_rng_state())  # global RNG untouched


def test_shards_disjoint_and_stay_in_range():
    # Shard k holds only values in [60k, 60k + 50), so every sampled byte reveals its shard.
    num_shards, n = 4, 4000
    train = torch.cat([torch.arange(n // num_shards).remainder(50) + 60 * k for k in range(num_shards)]).to(torch.uint8)
    ranges = []
    for k in range(num_shards):
        s = BatchSampler(train, block_size=32, batch_size=8, seed=1, shard_index=k, num_shards=num_shards)
        ranges.append(s.shard_range)
        for _ in range(20):
            x, y = s.next_batch()
            for t in (x, y):
                assert t.min().item() >= 60 * k and t.max().item() < 60 * k + 50
    ranges.sort()
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    for (s0, e0), (s1, _) in zip(ranges, ranges[1:]):
        assert e0 == s1 and s0 < e0


def test_resume_from_state_dict():
    train = _train_tensor()
    a = BatchSampler(train, block_size=16, batch_size=4, seed=9, shard_index=1, num_shards=2)
    for _ in range(3):
        a.next_batch()
    state = a.state_dict()
    expected = [a.next_batch() for _ in range(3)]
    b = BatchSampler(train, block_size=16, batch_size=4, seed=9, shard_index=1, num_shards=2)
    b.load_state_dict(state)
    assert b.batches_drawn == 3
    for ex, ey in expected:
        x, y = b.next_batch()
        assert torch.equal(x, ex) and torch.equal(y, ey)
    wrong = BatchSampler(train, block_size=16, batch_size=4, seed=9, shard_index=0, num_shards=2)
    with pytest.raises(ValueError):
        wrong.load_state_dict(state)


def test_sampler_rejects_tiny_shard_and_bad_index():
    with pytest.raises(CorpusError):
        BatchSampler(_train_tensor(40), block_size=16, batch_size=2, seed=0, shard_index=0, num_shards=4)
    with pytest.raises(ValueError):
        BatchSampler(_train_tensor(), block_size=16, batch_size=2, seed=0, shard_index=2, num_shards=2)


def test_evaluate_deterministic_and_restores_mode():
    # Heavy dropout: if evaluate forgot model.eval(), two calls would differ.
    cfg = ModelConfig(block_size=32, n_layer=1, n_head=2, n_embd=32, dropout=0.5)
    torch.manual_seed(0)
    model = GPT(cfg)
    _, ev = split_corpus(load_corpus(None)[:20000], 0.2)
    model.train()
    l1 = evaluate(model, ev, block_size=32, batch_size=4, num_batches=3)
    assert model.training
    model.eval()
    l2 = evaluate(model, ev, block_size=32, batch_size=4, num_batches=3)
    assert not model.training
    assert l1 == l2
    assert abs(l1 - math.log(256)) < 0.3
    with pytest.raises(CorpusError):
        evaluate(model, ev[:10], block_size=32, batch_size=4, num_batches=1)


def test_interleaved_split_deals_chunks_round_robin_and_keeps_windows_inside_them():
    """Each shard samples every num_shards-th chunk of the corpus (a sample of the whole of it), shards
    stay disjoint, no window crosses a chunk's end, and the stream resumes exactly."""
    from dilocox.worker.data.corpus import INTERLEAVE_TOKENS

    num_shards, block = 3, 32
    n = INTERLEAVE_TOKENS * 10 + 100  # 10 whole chunks and a tail that no shard samples
    train = torch.arange(n, dtype=torch.int64)
    chunks_seen = []
    for k in range(num_shards):
        s = BatchSampler(
            train, block_size=block, batch_size=16, seed=2, shard_index=k, num_shards=num_shards, split="interleaved"
        )
        seen = set()
        for _ in range(200):
            x, y = s.next_batch()
            assert torch.equal(x[:, 1:], y[:, :-1])
            first, last = x[:, 0] // INTERLEAVE_TOKENS, y[:, -1] // INTERLEAVE_TOKENS
            assert torch.equal(first, last)  # inside one chunk
            seen |= set(first.tolist())
        assert seen == set(range(k, 10, num_shards))  # every one of its chunks, and only those
        chunks_seen.append(seen)
    assert set().union(*chunks_seen) == set(range(10))
    a = BatchSampler(train, block, 4, seed=5, shard_index=1, num_shards=2, split="interleaved")
    a.next_batch()
    b = BatchSampler(train, block, 4, seed=5, shard_index=1, num_shards=2, split="interleaved")
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.next_batch()[0], b.next_batch()[0])
    with pytest.raises(ValueError, match="sampler state is for split=interleaved"):
        BatchSampler(train, block, 4, seed=5, shard_index=1, num_shards=2).load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="data split must be one of"):
        BatchSampler(train, block, 4, seed=5, split="random")
