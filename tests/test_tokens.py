"""Tokenizers, `dilocox data prepare`, token files streamed from disk, and how clusters read them
(worker/data/tokenizer.py, prepare.py, token_data.py, corpus.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from dilocox.worker.data.corpus import BatchSampler, load_corpus
from dilocox.worker.data.manifest import TOKENS_FILE, read_manifest
from dilocox.worker.data.prepare import prepare_tokens
from dilocox.worker.data.sources import CorpusError
from dilocox.worker.data.token_data import load_run_data, load_token_data, open_prepared
from dilocox.worker.data.token_file import TokenFile
from dilocox.worker.data.tokenizer import ByteTokenizer, TokenizerError, load_tokenizer_file, resolve_tokenizer

pytest.importorskip("tokenizers")

TEXT = load_corpus(None)[:120_000]


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DILOCOX_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture
def corpus_dir(tmp_path):
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_bytes(TEXT[:80_000])
    (folder / "sub" / "b.txt").write_bytes(TEXT[80_000:])
    (folder / ".hidden").write_text("never read")
    return folder


def test_bpe_is_trained_once_cached_by_content_and_deterministic(corpus_dir, tmp_path):
    first = resolve_tokenizer("bpe:600", corpus_dir)
    cached = list((tmp_path / "cache" / "tokenizers").glob("bpe600-*.json"))
    assert len(cached) == 1 and first.vocab_size == 600
    again = resolve_tokenizer("bpe:600", corpus_dir)  # from the cache
    assert again.digest == first.digest
    cached[0].unlink()
    retrained = resolve_tokenizer("bpe:600", corpus_dir)  # trained anew: the same tokenizer
    assert retrained.digest == first.digest
    (corpus_dir / "a.txt").write_bytes(TEXT[:70_000])  # other content, another cache entry
    resolve_tokenizer("bpe:600", corpus_dir)
    assert len(list((tmp_path / "cache" / "tokenizers").glob("bpe600-*.json"))) == 2


def test_tokenizer_json_round_trip(corpus_dir, tmp_path):
    trained = resolve_tokenizer("bpe:500", corpus_dir)
    trained.save(tmp_path / "tok" / "tokenizer.json")
    loaded = load_tokenizer_file(tmp_path / "tok")
    assert loaded.digest == trained.digest and loaded.vocab_size == 500
    text = TEXT[:2000].decode()
    ids = loaded.encode(text)
    assert ids.dtype == np.uint16 and len(ids) < len(text) and loaded.decode(ids) == text
    assert resolve_tokenizer(str(tmp_path / "tok" / "tokenizer.json")).digest == trained.digest
    byte = ByteTokenizer()
    assert byte.decode(byte.encode("héllo")) == "héllo"


@pytest.mark.parametrize(
    "spec, message", [("bpe:100", "above 257"), ("bpe:many", "above 257"), ("nope/tokenizer.json", "does not exist")]
)
def test_bad_tokenizer_specs_are_refused(spec, message):
    with pytest.raises(TokenizerError, match=message):
        resolve_tokenizer(spec)


def test_malformed_tokenizer_json_is_refused(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(TokenizerError, match="not a Hugging Face tokenizer.json"):
        load_tokenizer_file(tmp_path / "tokenizer.json")


def test_prepare_a_text_folder_gives_the_corpus_bytes_streamed_from_disk(corpus_dir, tmp_path):
    manifest = prepare_tokens(corpus_dir, ByteTokenizer(), tmp_path / "out")
    assert manifest.dtype == "uint8" and manifest.documents == 2
    assert (tmp_path / "out" / TOKENS_FILE).read_bytes() == load_corpus(corpus_dir)  # the corpus as it always was
    data = open_prepared(tmp_path / "out", ByteTokenizer())
    assert data.streamed and isinstance(data.train, TokenFile)
    assert bytes(data.train.read(0, 100)) == load_corpus(corpus_dir)[:100]
    assert data.num_tokens == manifest.num_tokens and len(data.eval) == manifest.eval_tokens


def test_prepare_jsonl_and_parquet_with_a_bpe(tmp_path):
    records = [
        {"text": f"Record {i}: {TEXT[i * 300 : (i + 1) * 300].decode(errors='replace')}", "id": i} for i in range(120)
    ]
    (tmp_path / "r.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    tokenizer = resolve_tokenizer("bpe:400", tmp_path / "r.jsonl")
    jsonl = prepare_tokens(tmp_path / "r.jsonl", tokenizer, tmp_path / "jsonl")
    assert jsonl.documents == 120 and jsonl.dtype == "uint16" and jsonl.tokenizer_spec == "bpe:400"
    assert (tmp_path / "jsonl" / "tokenizer.json").is_file()
    tokens = np.fromfile(tmp_path / "jsonl" / TOKENS_FILE, dtype=np.uint16)
    eot = tokenizer.separator[0]
    assert int((tokens == eot).sum()) == 119  # documents separated by <|endoftext|>
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"body": [r["text"] for r in records]}), tmp_path / "r.parquet")
    parquet = prepare_tokens(tmp_path / "r.parquet", tokenizer, tmp_path / "parquet", text_field="body")
    assert parquet.num_tokens == jsonl.num_tokens  # the same documents, the same tokens
    assert (tmp_path / "parquet" / TOKENS_FILE).read_bytes() == (tmp_path / "jsonl" / TOKENS_FILE).read_bytes()
    with pytest.raises(CorpusError, match="no column 'text'"):
        prepare_tokens(tmp_path / "r.parquet", tokenizer, tmp_path / "nope")
    assert not (tmp_path / "nope").exists() and not list(tmp_path.glob(".nope.partial-*"))


def test_bad_inputs_leave_no_output(tmp_path, corpus_dir):
    (tmp_path / "tiny.txt").write_text("abc")
    with pytest.raises(CorpusError, match="too small for the split"):
        prepare_tokens(tmp_path / "tiny.txt", ByteTokenizer(), tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial-*"))
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"other": 1}\n')
    with pytest.raises(CorpusError, match="bad.jsonl:2: no text field 'text'"):
        prepare_tokens(tmp_path / "bad.jsonl", ByteTokenizer(), tmp_path / "out")
    prepare_tokens(corpus_dir, ByteTokenizer(), tmp_path / "done")
    with pytest.raises(CorpusError, match="already exists"):
        prepare_tokens(corpus_dir, ByteTokenizer(), tmp_path / "done")


def test_data_prepared_with_another_tokenizer_is_refused(corpus_dir, tmp_path):
    prepare_tokens(corpus_dir, ByteTokenizer(), tmp_path / "bytes")
    bpe = resolve_tokenizer("bpe:500", corpus_dir)
    with pytest.raises(TokenizerError, match="prepared with tokenizer byte"):
        load_token_data(tmp_path / "bytes", bpe)
    with pytest.raises(TokenizerError, match="prepared with --tokenizer byte"):
        load_run_data("bpe:500", tmp_path / "bytes")
    manifest = json.loads((tmp_path / "bytes" / "manifest.json").read_text())
    (tmp_path / "bytes" / "manifest.json").write_text(
        json.dumps({**manifest, "num_tokens": manifest["num_tokens"] + 1})
    )
    with pytest.raises(CorpusError, match="the manifest says"):
        read_manifest(tmp_path / "bytes")


def test_a_prepared_bpe_folder_brings_its_own_tokenizer(corpus_dir, tmp_path):
    bpe = resolve_tokenizer("bpe:500", corpus_dir)
    prepare_tokens(corpus_dir, bpe, tmp_path / "prepared")
    data = load_run_data("bpe:500", tmp_path / "prepared")
    assert data.streamed and data.vocab_size == 500 and data.tokenizer_digest == bpe.digest
    on_the_fly = load_run_data("bpe:500", corpus_dir)  # a text path, tokenised at start-up: the same tokens
    assert np.array_equal(
        np.concatenate([data.train.read(), data.eval.read()]), np.concatenate([on_the_fly.train, on_the_fly.eval])
    )


def test_clusters_and_replicas_read_disjoint_windows(corpus_dir, tmp_path):
    prepare_tokens(corpus_dir, ByteTokenizer(), tmp_path / "p")
    data = open_prepared(tmp_path / "p", ByteTokenizer())
    clusters, dp, block = 2, 2, 16
    seen = []
    for cluster in range(clusters):
        for replica in range(dp):
            sampler = BatchSampler(
                data.train, block, 8, seed=3, shard_index=cluster * dp + replica, num_shards=clusters * dp
            )
            start, end = sampler.shard_range
            covered = set()
            for _ in range(50):
                covered |= {int(s) + k for s in sampler.next_starts() for k in range(block + 1)}
            assert min(covered) >= start and max(covered) < end  # no window crosses into a neighbour's part
            seen.append(covered)
    for i in range(len(seen)):
        for j in range(i + 1, len(seen)):
            assert seen[i].isdisjoint(seen[j])


def test_resume_continues_the_read_position_on_a_token_file(corpus_dir, tmp_path):
    prepare_tokens(corpus_dir, ByteTokenizer(), tmp_path / "p")
    data = open_prepared(tmp_path / "p", ByteTokenizer())
    uninterrupted = BatchSampler(data.train, 32, 4, seed=9, shard_index=1, num_shards=2)
    stream = [uninterrupted.next_batch()[0] for _ in range(6)]
    first = BatchSampler(data.train, 32, 4, seed=9, shard_index=1, num_shards=2)
    for _ in range(3):
        first.next_batch()
    state = first.state_dict()
    resumed = BatchSampler(
        open_prepared(tmp_path / "p", ByteTokenizer()).train, 32, 4, seed=9, shard_index=1, num_shards=2
    )
    resumed.load_state_dict(state)
    assert all(torch.equal(resumed.next_batch()[0], want) for want in stream[3:])


def test_data_prepare_command(corpus_dir, tmp_path):
    cli = [sys.executable, "-m", "dilocox.common.cli", "data"]
    env = {"DILOCOX_CACHE_DIR": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [*cli, "prepare", str(corpus_dir), "--out", str(tmp_path / "out"), "--tokenizer", "bpe:500"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert "with tokenizer bpe:500" in done.stdout
    assert "tokenising" not in done.stderr and "\r" not in done.stderr  # stderr is a pipe, not a terminal: no bar
    info = subprocess.run([*cli, "info", str(tmp_path / "out")], capture_output=True, text=True, timeout=60, env=env)
    assert json.loads(info.stdout)["tokenizer_spec"] == "bpe:500"
    refused = subprocess.run(
        [*cli, "prepare", str(tmp_path / "missing"), "--out", str(tmp_path / "x")],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert refused.returncode == 1 and "corpus path does not exist" in refused.stderr
