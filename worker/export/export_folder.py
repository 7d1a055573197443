"""The export folder: the global model written as files a user can load, and its loss measured from them.

`write_export` writes, whole or not at all:

* `model.safetensors` — every parameter by its full name, fp32;
* `export.json` — run id, version, parameter count, the run's configuration;
* `provenance.json` — where the model came from, every file's digest (worker/export/provenance.py) and the
  shards' rounds chains up to the exported version (worker/export/chain.py), and
  with a signer `dilocox-signature.json` over all of them, which `dilocox verify` checks
  (worker/export/signing.py);
* for a Hugging Face model also `config.json` (+ `tokenizer.json` and `tokenizer_config.json` where the
  run's tokenizer is found), so `AutoModelForCausalLM.from_pretrained(folder)` loads it; the built-in GPT
  loads with `dilocox worker --weights folder` or `build_model(config, vocab, seed)` with `weights` set.

`evaluate_export` then reports the exported model's loss on the run's eval split (worker/data/), the same
windows a cluster evaluates on.

Its own module because writing is the one part of an export that needs the model and data code (Hugging
Face configurations, the run's tokenizer, building the model to evaluate it, all imported late), while
assembling the model from the shards (worker/export/model.py) needs none of it.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import torch

from dilocox.common.atomic_file import atomic_folder
from dilocox.common.config.run import RunConfig, from_dict, in_use
from dilocox.common.signing_keys import Signer
from dilocox.worker.export.model import ExportError, GlobalModel
from dilocox.worker.export.provenance import write_provenance

EXPORT_FORMAT = "dilocox-export"


def _input_embedding_name(model: torch.nn.Module) -> str | None:
    get = getattr(model, "get_input_embeddings", None)
    embedding = get() if get is not None else None
    weight = getattr(embedding, "weight", None)
    return next((name for name, p in model.named_parameters() if p is weight), None)


def _hf_config(config: RunConfig, tensors: dict[str, torch.Tensor]):
    """The Hugging Face configuration the run trained (its vocabulary read off the exported embedding), or
    None for a model that is not a Hugging Face one."""
    from dilocox.worker.models.hf import hf_config
    from dilocox.worker.models.spec import resolve_model

    spec = resolve_model(config.model.model)
    if spec.kind != "hf":
        return None
    import transformers

    probe = hf_config(spec, config.model.block_size, 1)
    with torch.device("meta"):
        name = _input_embedding_name(transformers.AutoModelForCausalLM.from_config(probe))
    vocab = tensors[name].shape[0] if name in tensors else probe.vocab_size
    return hf_config(spec, config.model.block_size, vocab)


def run_tokenizer(
    model: GlobalModel, config: RunConfig, data: str | None, text_field: str = "text", tokenizer_path: str | None = None
):
    """The tokenizer the run trained with — never a new one: the shards' record of it, or the one from
    `--tokenizer`/`--data` checked against the recorded digest. None for byte-level runs."""
    from dilocox.worker.data.tokenizer import HFTokenizer, TokenizerError, load_tokenizer_text, resolve_tokenizer

    recorded = model.tokenizer_digest
    if config.tokenizer == "byte" and recorded in ("", "byte") and not tokenizer_path:
        return None
    given = None
    if tokenizer_path or data is not None:
        try:
            given = resolve_tokenizer(tokenizer_path or config.tokenizer, data, text_field)
        except (TokenizerError, ValueError, OSError) as error:
            raise ExportError(f"the run's tokenizer from {tokenizer_path or data}: {error}") from None
        if recorded and given.digest != recorded:
            raise ExportError(
                f"the tokenizer from {tokenizer_path or data} ({given.digest[:19]}…) is not the run's "
                f"({recorded[:19]}…, as its shards recorded it): the model would be shipped with other ids"
            )
    if model.tokenizer_json:
        return load_tokenizer_text(model.tokenizer_json, config.tokenizer)
    if recorded == "byte" or (given is not None and given.digest == "byte"):
        return None
    if not isinstance(given, HFTokenizer):
        raise ExportError(
            f"the run's tokenizer ({config.tokenizer}) was not recorded by its shards (a run started before "
            "dilocox recorded it): pass --tokenizer with its tokenizer.json, or --data with the run's data"
        )
    return given


def special_token_ids(tokenizer) -> dict[str, int | None]:  # noqa: ANN001
    """bos/eos/pad ids for the exported config, from the tokenizer itself: its end-of-text token ends a
    generation and pads a batch (a byte-level BPE has no other special token)."""
    from dilocox.worker.data.tokenizer import END_OF_TEXT

    if tokenizer is None:
        return {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}  # bytes: no special tokens

    def first_id(names: tuple[str, ...], default: int | None) -> int | None:
        ids = (tokenizer.tokenizer.token_to_id(name) for name in names)
        return next((i for i in ids if i is not None), default)

    eos = first_id((END_OF_TEXT, "</s>", "<|end_of_text|>", "<eos>"), None)
    return {
        "bos_token_id": first_id(("<s>", "<|begin_of_text|>", "<bos>"), eos),
        "eos_token_id": eos,
        "pad_token_id": first_id(("<pad>",), eos),
    }


def _write_tokenizer(tokenizer, config: RunConfig, folder: pathlib.Path) -> str:  # noqa: ANN001
    """The run's tokenizer beside the weights; returns what was written, for the record."""
    if tokenizer is None:
        return "byte-level: token ids are the text's bytes, no tokenizer file"
    tokenizer.save(folder / "tokenizer.json")
    ids = special_token_ids(tokenizer)
    names = {key.replace("_id", ""): tokenizer.tokenizer.id_to_token(i) for key, i in ids.items() if i is not None}
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "model_max_length": config.model.block_size,
                **names,
            },
            indent=2,
        )
        + "\n"
    )
    return f"{tokenizer.spec} ({tokenizer.digest})"


def write_export(
    model: GlobalModel,
    out: str | pathlib.Path,
    data: str | None = None,
    text_field: str = "text",
    model_override: str | None = None,
    tokenizer_path: str | None = None,
    signer: Signer | None = None,
) -> pathlib.Path:
    """Write the export folder whole or not at all, its provenance.json last, signed by `signer` if given;
    returns its path."""
    from safetensors.torch import save_file

    config = model.run_config
    if model_override:
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, model=model_override))
    hf = _hf_config(config, model.tensors)
    tokenizer = run_tokenizer(model, config, data, text_field, tokenizer_path)
    if hf is not None:
        for key, value in special_token_ids(tokenizer).items():
            setattr(hf, key, value)
        hf.use_cache = True  # trained without a key/value cache; generating with one is about twice as fast
    out = pathlib.Path(out)
    with atomic_folder(out) as folder:
        save_file(
            {name: t.contiguous() for name, t in model.tensors.items()},
            str(folder / "model.safetensors"),
            metadata={"format": "pt", "run_id": model.run_id, "version": str(model.version)},
        )
        if hf is not None:
            hf.save_pretrained(str(folder))
        tokenizer_note = _write_tokenizer(tokenizer, config, folder)
        record = {
            "format": EXPORT_FORMAT,
            "run_id": model.run_id,
            "version": model.version,
            "num_params": model.num_params,
            "model": config.model.model,
            "huggingface": hf is not None,
            "tokenizer": tokenizer_note,
            "run_config": in_use(config),
        }
        (folder / "export.json").write_text(json.dumps(record, indent=2) + "\n")
        digest = tokenizer.digest if tokenizer is not None else "byte"
        write_provenance(
            folder,
            model.run_id,
            model.version,
            config.rounds,
            config.final_version,
            digest,
            record["run_config"],
            model.source,
            signer,
            model.rounds_chain,
        )
    return out


def evaluate_export(folder: str | pathlib.Path, data: str | None = None, text_field: str = "text") -> float:
    """The exported model's mean loss on the run's eval split (the windows a cluster evaluates on)."""
    from dilocox.worker.data.corpus import evaluate_run
    from dilocox.worker.data.token_data import load_run_data
    from dilocox.worker.models.build import build_model

    folder = pathlib.Path(folder)
    record = json.loads((folder / "export.json").read_text())
    config = from_dict(record["run_config"])
    shipped = folder / "tokenizer.json"  # the run's own (export never trains one)
    tokens = load_run_data(str(shipped) if shipped.is_file() else config.tokenizer, data, text_field)
    model = build_model(
        dataclasses.replace(config.model, weights=str(folder / "model.safetensors")), tokens.vocab_size, config.seed
    )
    return evaluate_run(model, config, tokens.eval)
