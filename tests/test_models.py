"""Models a cluster can train: the built-in GPT, Hugging Face presets and config.json files, module:function
entries, local safetensors weights, and their pipeline split (worker/models/, worker/train/pipeline_stage.py)."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from torch import nn

from dilocox.common.config.run import ModelConfig
from dilocox.worker.models.build import build_model, model_param_specs
from dilocox.worker.models.contract import ModelContractError, causal_lm_loss, lm_loss, logits_of
from dilocox.worker.models.spec import ModelSpecError, preset_names, resolve_model
from dilocox.worker.train.pipeline_stage import PipelineSplitError, build_stage

pytest.importorskip("transformers")


def _same(a: nn.Module, b: nn.Module) -> bool:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    return pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)


def test_presets_are_shipped_and_sized_as_named():
    assert {"llama-tiny", "llama-20m", "gpt2-small", "llama-350m", "llama-1b"} <= set(preset_names())
    counts = {
        name: sum(torch.Size(s).numel() for _, s in model_param_specs(ModelConfig(model=name), vocab))
        for name, vocab in [("llama-20m", 8192), ("gpt2-small", 50257), ("llama-350m", 32000), ("llama-1b", 32000)]
    }
    assert 17e6 < counts["llama-20m"] < 23e6
    assert 120e6 < counts["gpt2-small"] < 130e6
    assert 330e6 < counts["llama-350m"] < 400e6
    assert 0.95e9 < counts["llama-1b"] < 1.25e9
    # The planning presets (`dilocox plan`, docs/performance.md): Llama-3's shapes and the paper's 107B scale.
    big = {
        name: sum(torch.Size(s).numel() for _, s in model_param_specs(ModelConfig(model=name), 128256))
        for name in ("llama-3-8b", "llama-3-70b", "dense-107b")
    }
    assert (
        7.9e9 < big["llama-3-8b"] < 8.1e9
        and 70.0e9 < big["llama-3-70b"] < 71.0e9
        and 106e9 < big["dense-107b"] < 108.5e9
    )


@pytest.mark.parametrize("name", ["gpt", "llama-tiny"])
def test_every_cluster_builds_the_same_initial_model(name):
    config = ModelConfig(model=name, block_size=32)
    first, again, other = build_model(config, 300, 11), build_model(config, 300, 11), build_model(config, 300, 12)
    assert _same(first, again)
    assert not _same(first, other)
    assert [(n, tuple(p.shape)) for n, p in first.named_parameters()] == model_param_specs(config, 300)


def test_the_vocabulary_comes_from_the_tokenizer():
    for name in ("gpt", "llama-tiny"):
        model = build_model(ModelConfig(model=name, block_size=16), 1000, 0)
        x = torch.randint(0, 1000, (2, 16))
        assert logits_of(model(x)).shape == (2, 16, 1000)


def test_a_config_json_keeps_its_vocabulary_and_must_hold_the_tokenizers(tmp_path):
    preset = dict(resolve_model("llama-tiny").hf_config)
    preset["vocab_size"] = 512
    path = tmp_path / "config.json"
    path.write_text(json.dumps(preset))
    model = build_model(ModelConfig(model=str(path), block_size=16), 300, 0)
    assert model.get_input_embeddings().weight.shape[0] == 512  # its own, not the tokenizer's 300
    assert resolve_model(str(tmp_path)).kind == "hf"  # a folder holding config.json
    with pytest.raises(ModelSpecError, match="smaller than the tokenizer's vocabulary"):
        build_model(ModelConfig(model=str(path), block_size=16), 600, 0)


@pytest.mark.parametrize(
    "text, message",
    [
        ("{not json", "not valid JSON"),
        (json.dumps({"hidden_size": 8}), 'no "model_type"'),
        (json.dumps({"model_type": "no-such-architecture"}), "not a usable Hugging Face configuration"),
    ],
)
def test_a_malformed_config_json_is_refused_clearly(tmp_path, text, message):
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(ModelSpecError, match=message):
        build_model(ModelConfig(model=str(path)), 256, 0)


def test_unknown_models_name_the_choices():
    with pytest.raises(ModelSpecError, match="llama-20m") as error:
        resolve_model("llama-2O")
    assert "module:function" in str(error.value)
    with pytest.raises(ModelSpecError, match="does not exist"):
        resolve_model("missing/config.json")
    with pytest.raises(ModelSpecError, match="exceeds its 1024 positions"):
        build_model(ModelConfig(model="llama-tiny", block_size=2048), 256, 0)


def _write_entry_module(tmp_path, body: str) -> str:
    (tmp_path / "my_team_model.py").write_text(body)
    sys.path.insert(0, str(tmp_path))
    return "my_team_model"


ENTRY = """
import torch
from torch import nn

class Bigram(nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.table = nn.Embedding(vocab, vocab)
    def forward(self, idx):
        return self.table(idx)

def build(model_config, vocab_size):
    return Bigram(vocab_size)

def not_a_module(model_config, vocab_size):
    return 42
"""


def test_a_module_function_entry_builds_a_seeded_model(tmp_path):
    module = _write_entry_module(tmp_path, ENTRY)
    try:
        config = ModelConfig(model=f"{module}:build", block_size=8)
        a, b = build_model(config, 64, 3), build_model(config, 64, 3)
        assert _same(a, b) and [n for n, _ in a.named_parameters()] == ["table.weight"]
        x = torch.randint(0, 64, (2, 8))
        assert float(lm_loss(a, x, x)) > 0
        with pytest.raises(ModelSpecError, match="returned int, not an nn.Module"):
            build_model(ModelConfig(model=f"{module}:not_a_module"), 64, 0)
        with pytest.raises(ModelSpecError, match="has no function nothing"):
            build_model(ModelConfig(model=f"{module}:nothing"), 64, 0)
        with pytest.raises(PipelineSplitError, match="cannot split Bigram"):
            build_stage(config, 64, 0, 0, 2)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(module, None)


def test_the_forward_contract_reads_tensors_tuples_and_outputs():
    logits = torch.randn(2, 3, 5)
    holder = type("Out", (), {"logits": logits})()
    assert logits_of(logits) is logits and logits_of((logits, None)) is logits and logits_of(holder) is logits
    with pytest.raises(ModelContractError, match="expected logits"):
        logits_of({"logits": logits})
    with pytest.raises(ModelContractError, match="do not match targets"):
        causal_lm_loss(logits, torch.zeros(2, 4, dtype=torch.long))


def test_local_safetensors_weights_continue_a_model(tmp_path):
    from safetensors.torch import save_file

    config = ModelConfig(model="llama-tiny", block_size=16)
    trained = build_model(config, 256, 99)
    save_file({n: p.detach().contiguous() for n, p in trained.named_parameters()}, str(tmp_path / "model.safetensors"))
    resumed = build_model(ModelConfig(model="llama-tiny", block_size=16, weights=str(tmp_path)), 256, 1)
    assert _same(resumed, trained)
    other = build_model(ModelConfig(model="gpt", block_size=16), 256, 0)
    save_file({n: p.detach().contiguous() for n, p in other.named_parameters()}, str(tmp_path / "gpt.safetensors"))
    with pytest.raises(ModelSpecError, match="no tensor for"):
        build_model(ModelConfig(model="llama-tiny", weights=str(tmp_path / "gpt.safetensors")), 256, 0)
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelSpecError, match="not a readable safetensors file"):
        build_model(ModelConfig(model="llama-tiny", weights=str(tmp_path / "bad.safetensors")), 256, 0)


@pytest.mark.parametrize("name, pp", [("gpt", 2), ("llama-tiny", 2), ("llama-tiny", 3)])
def test_pipeline_stages_compose_to_the_whole_model(name, pp):
    """Stages keep the full model's parameter names and, run one after another, give its logits bit for bit."""
    config = ModelConfig(model=name, n_layer=3, block_size=24)
    whole = build_model(config, 300, 5).eval()
    stages = [build_stage(config, 300, 5, s, pp).eval() for s in range(pp)]
    x = torch.randint(0, 300, (2, 24))
    hidden = x
    with torch.no_grad():
        for stage in stages:
            hidden = stage(hidden)
        assert torch.equal(hidden, logits_of(whole(x)))
    names = [n for stage in stages for n, _ in stage.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in whole.named_parameters()) and len(names) == len(set(names))


def test_architectures_the_pipeline_cannot_split_are_refused_by_name(tmp_path):
    with pytest.raises(PipelineSplitError, match="cannot split GPT2LMHeadModel"):
        build_stage(ModelConfig(model="gpt2-small"), 256, 0, 0, 2)
    tied = dict(resolve_model("llama-tiny").hf_config, tie_word_embeddings=True, vocab_size=256)
    (tmp_path / "config.json").write_text(json.dumps(tied))
    with pytest.raises(PipelineSplitError, match="tie_word_embeddings"):
        build_stage(ModelConfig(model=str(tmp_path / "config.json")), 256, 0, 1, 2)
    assert build_stage(ModelConfig(model=str(tmp_path / "config.json")), 256, 0, 0, 1) is not None  # one stage: fine
