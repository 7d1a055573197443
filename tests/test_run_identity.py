"""What makes a run one run, checked where it could silently split: one tokenizer (recorded by the shards
at the first join, checked at every join, kept for export), special tokens in the exported config taken
from that tokenizer, each site's share of its data, and a run's length (no push past its end; extended
only on purpose)."""

from __future__ import annotations

import json

import grpc
import pytest
import torch

from dilocox.common.config.run import ModelConfig, RunConfig, as_dict
from dilocox.common.wire.assignment import model_digest, tokenizer_digest_of
from dilocox.common.wire.errors import InvalidFrame, RunOver, TokenizerMismatch
from dilocox.server.serving.grpc_server import start_server
from dilocox.server.shard import Shard
from dilocox.server.state import checkpoint
from dilocox.worker.data.corpus import data_part
from dilocox.worker.exchange.aggregator_client import AggregatorClient, AggregatorError

PARAMS = [("w", (4, 3)), ("b", (4,))]
RUN = "identity-run"
TEXT = "To be, or not to be, that is the question.\nWhether 'tis nobler in the mind to suffer\n" * 40


def _bpe(vocab: int = 300, text: str = TEXT):
    pytest.importorskip("tokenizers")
    from dilocox.worker.data.tokenizer import train_bpe

    return train_bpe([text], vocab, f"bpe:{vocab}")


def _shard(rounds: int = 2) -> Shard:
    shard = Shard(0, 1, RUN, outer_lr=0.7, outer_momentum=0.9, min_clusters=1)
    shard.join(
        RUN,
        "site-a",
        model_digest(PARAMS),
        PARAMS,
        json.dumps(as_dict(RunConfig(run_id=RUN, rounds=rounds))),
        "byte",
        "",
    )
    return shard


def test_the_first_joiners_tokenizer_is_the_runs_and_another_is_refused_with_both_digests():
    a, b = _bpe(300), _bpe(300, TEXT.upper())
    assert a.digest != b.digest and a.digest == tokenizer_digest_of(a.definition)
    shard = Shard(0, 1, RUN, outer_lr=0.7, outer_momentum=0.9)
    shard.join(RUN, "site-a", model_digest(PARAMS), PARAMS, "", a.digest, a.definition)
    shard.join(RUN, "site-a2", model_digest(PARAMS), PARAMS, "", a.digest, "")  # the same digest, no file: fine
    shard.join(RUN, "old-client", model_digest(PARAMS), PARAMS, "", "", "")  # a client from before the check
    with pytest.raises(TokenizerMismatch) as refused:
        shard.join(RUN, "site-b", model_digest(PARAMS), PARAMS, "", b.digest, b.definition)
    assert a.digest in str(refused.value) and b.digest in str(refused.value) and "site-b" not in shard.members
    with pytest.raises(InvalidFrame, match="does not match the tokenizer.json"):
        shard.join(RUN, "site-c", model_digest(PARAMS), PARAMS, "", a.digest, b.definition)
    # A restarted shard keeps the record: the checkpoint holds the digest and the file (for export).
    restored = Shard(0, 1, RUN, outer_lr=0.7, outer_momentum=0.9)
    checkpoint.restore(restored, checkpoint.shard_state(shard))
    assert (restored.tokenizer_digest, restored.tokenizer_json) == (a.digest, a.definition)
    with pytest.raises(TokenizerMismatch):
        restored.join(RUN, "site-b", model_digest(PARAMS), PARAMS, "", b.digest, b.definition)
    assert restored.describe(RUN).tokenizer_json == a.definition


def test_a_site_with_another_tokenizer_is_refused_over_grpc_and_observers_get_the_runs():
    a, b = _bpe(300), _bpe(300, TEXT.upper())
    shard = Shard(0, 1, RUN, outer_lr=0.7, outer_momentum=0.9)
    server, port = start_server(shard, "127.0.0.1", 0)
    try:
        address = [f"127.0.0.1:{port}"]
        with AggregatorClient(address, RUN, "site-a", connect_timeout=10, tokenizer=(a.digest, a.definition)) as client:
            client.join(PARAMS)
        with AggregatorClient(address, RUN, "site-b", connect_timeout=10, tokenizer=(b.digest, b.definition)) as client:
            with pytest.raises(AggregatorError) as refused:
                client.join(PARAMS)
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert a.digest in refused.value.details and b.digest in refused.value.details
        from dilocox.proto import dilocox_pb2 as pb
        from dilocox.proto import dilocox_pb2_grpc as pb_grpc

        with grpc.insecure_channel(address[0]) as channel:
            reply = pb_grpc.AggregatorStub(channel).Join(pb.JoinRequest(run_id=RUN, observer=True), timeout=10)
        assert (reply.tokenizer_digest, reply.tokenizer_json) == (a.digest, a.definition)
    finally:
        server.stop(0)


def test_export_ships_the_runs_tokenizer_and_takes_special_tokens_from_it(tmp_path):
    transformers = pytest.importorskip("transformers")
    from dilocox.worker.export.export_folder import write_export
    from dilocox.worker.export.model import ExportError, GlobalModel
    from dilocox.worker.models.build import build_model

    tokenizer = _bpe(300)
    config = RunConfig(run_id=RUN, tokenizer="bpe:300", model=ModelConfig(model="llama-tiny", block_size=32))
    tensors = {n: p.detach().clone() for n, p in build_model(config.model, tokenizer.vocab_size, 1).named_parameters()}
    recorded = GlobalModel(RUN, 3, json.dumps(as_dict(config)), tensors, tokenizer.digest, tokenizer.definition)
    out = write_export(recorded, tmp_path / "model")
    assert tokenizer_digest_of((out / "tokenizer.json").read_text()) == tokenizer.digest
    eot = tokenizer.tokenizer.token_to_id("<|endoftext|>")
    hf = json.loads((out / "config.json").read_text())
    assert (hf["bos_token_id"], hf["eos_token_id"], hf["pad_token_id"]) == (eot, eot, eot) == (0, 0, 0)
    loaded = transformers.AutoTokenizer.from_pretrained(str(out))
    assert loaded.eos_token == "<|endoftext|>" and loaded.pad_token_id == eot
    assert loaded("To be, or not")["input_ids"] == tokenizer.encode("To be, or not").tolist()

    # Not recorded (a run from before the record) and nothing given: refused, never a freshly trained one.
    unrecorded = GlobalModel(RUN, 3, recorded.run_config_json, tensors)
    with pytest.raises(ExportError, match="was not recorded by its shards"):
        write_export(unrecorded, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    other = _bpe(300, TEXT.upper())
    other.save(tmp_path / "other.json")
    with pytest.raises(ExportError, match="is not the run's"):
        write_export(recorded, tmp_path / "refused", tokenizer_path=str(tmp_path / "other.json"))
    tokenizer.save(tmp_path / "same.json")
    out = write_export(unrecorded, tmp_path / "given", tokenizer_path=str(tmp_path / "same.json"))
    assert tokenizer_digest_of((out / "tokenizer.json").read_text()) == tokenizer.digest


def test_a_prepared_folders_tokenizer_is_the_runs_when_none_is_given(tmp_path):
    from dilocox.worker.data.prepare import prepare_tokens
    from dilocox.worker.data.token_data import load_run_data, run_tokenizer_spec

    (tmp_path / "text.txt").write_text(TEXT)
    shipped = _bpe(300)
    shipped.save(tmp_path / "tokenizer.json")
    from dilocox.worker.data.tokenizer import load_tokenizer_file

    prepare_tokens(tmp_path / "text.txt", load_tokenizer_file(tmp_path / "tokenizer.json"), tmp_path / "prepared")
    spec = run_tokenizer_spec("byte", tmp_path / "prepared")
    assert spec == str(tmp_path / "prepared" / "tokenizer.json")
    assert load_run_data(spec, tmp_path / "prepared").tokenizer_digest == shipped.digest
    assert run_tokenizer_spec("bpe:300", tmp_path / "prepared") == "bpe:300"  # given: kept (and checked on load)
    assert run_tokenizer_spec("byte", tmp_path / "text.txt") == "byte"


def test_own_data_trains_a_site_on_all_of_its_data_and_shared_data_on_its_part():
    shared = [data_part("interleaved", 5, c, 2, r, 2) for c in range(2) for r in range(2)]
    assert [(p.index, p.count, p.seed) for p in shared] == [(0, 4, 5), (1, 4, 5), (2, 4, 5), (3, 4, 5)]
    own = [data_part("own", 5, c, 2, r, 2) for c in range(2) for r in range(2)]
    assert [(p.index, p.count, p.split) for p in own] == [(0, 2, "interleaved"), (1, 2, "interleaved")] * 2
    assert own[0].seed != own[2].seed  # two sites given the same files still draw different batches
    with pytest.raises(ValueError, match="data_split must be one of"):
        RunConfig(data_split="mine")


def test_no_push_past_the_runs_end_and_extending_it_is_explicit():
    shard = _shard(rounds=2)
    final = shard.final_version  # its rounds, and the end-of-run flush of the default compression
    assert final == 3
    shard.commit_push("site-a", 0, 1.0, [(s.key, torch.zeros(s.slice_shape)) for s in shard.owned.values()])
    with pytest.raises(RunOver, match="--resume --rounds"):
        shard.check_push(RUN, "site-a", final + 1, 1.0)
    with pytest.raises(ValueError, match="extended, not shortened"):
        shard.extend_rounds(1)
    shard.extend_rounds(5)
    assert shard.final_version == final + 3 and json.loads(shard.run_config_json)["rounds"] == 5
    with pytest.raises(ValueError, match="no recorded run configuration"):
        Shard(0, 1, RUN, outer_lr=0.7, outer_momentum=0.9).extend_rounds(5)
