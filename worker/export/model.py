"""`dilocox export`: the run's global model, out of the aggregation service, as files a user can load.

The global model lives only on the shards, each holding some slices. Export assembles it — from the
running shards (a read-only observer: it joins no round, so training is never held up) or offline from
the shards' checkpoint files — checks that every slice of the run is there and that all of them belong
to one version, and writes a folder:

* `model.safetensors` — every parameter by its full name, fp32;
* `export.json` — run id, version, parameter count, the run's configuration;
* `provenance.json` — where the model came from, every file's digest (worker/export/provenance.py) and the
  shards' rounds chains up to the exported version (worker/export/chain.py), and
  with `--sign-key` `dilocox-signature.json` over all of them, which `dilocox verify` checks
  (worker/export/signing.py);
* for a Hugging Face model also `config.json` (+ `tokenizer.json` and `tokenizer_config.json` where the
  run's tokenizer is found), so `AutoModelForCausalLM.from_pretrained(folder)` loads it; the built-in GPT
  loads with `dilocox worker --weights folder` or `build_model(config, vocab, seed)` with `weights` set.

`--eval` then reports the exported model's loss on the run's eval split (worker/data/), the same windows
a cluster evaluates on.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import grpc
import torch

from dilocox.common.atomic_file import atomic_folder
from dilocox.common.config.run import RunConfig, WireConfig, from_dict, in_use
from dilocox.common.security import (
    TlsFiles,
    add_security_arguments,
    explain_hostname_mismatch,
    is_hostname_mismatch,
    open_channel,
    security_from_args,
)
from dilocox.common.signing_keys import Signer, SigningError, load_signer, signs_code
from dilocox.common.wire import codecs
from dilocox.common.wire.assignment import ParamSlice, SliceMap, assign_slices
from dilocox.common.wire.checkpoint_format import CheckpointError, slice_key, snapshot_version, verified
from dilocox.common.wire.errors import DilocoxError
from dilocox.common.wire.framing import SliceKey
from dilocox.common.wire.slice_assembly import assemble_units
from dilocox.proto import dilocox_pb2 as pb
from dilocox.proto import dilocox_pb2_grpc as pb_grpc
from dilocox.worker.data.token_data import add_data_arguments
from dilocox.worker.export.chain import chain_of_checkpoint, export_section, fetch_chain
from dilocox.worker.export.checkpoints import gather, pick_versions
from dilocox.worker.export.provenance import write_provenance

EXPORT_FORMAT = "dilocox-export"


class ExportError(ValueError):
    """The global model cannot be assembled: a shard missing, a slice missing, mixed versions, …
    `not_ready`: only not *yet* — nothing published, shards a version apart, a shard that has no model yet
    or cannot be reached now — so a watcher may ask again (`sim/global_eval.py`)."""

    def __init__(self, message: str, not_ready: bool = False) -> None:
        super().__init__(message)
        self.not_ready = not_ready


@dataclass
class GlobalModel:
    run_id: str
    version: int
    run_config_json: str
    tensors: dict[str, torch.Tensor]  # full parameters by name, in the run's parameter order
    tokenizer_digest: str = ""  # the run's tokenizer as the shards recorded it ("" = not recorded)
    tokenizer_json: str = ""
    source: dict[str, list[str]] = dataclasses.field(
        default_factory=dict
    )  # where it was read from, for provenance.json
    rounds_chain: dict = dataclasses.field(default_factory=dict)  # the shards' rounds chains, for provenance.json

    @property
    def num_params(self) -> int:
        return sum(t.numel() for t in self.tensors.values())

    @property
    def run_config(self) -> RunConfig:
        try:
            return from_dict(json.loads(self.run_config_json or "{}"))
        except (ValueError, TypeError) as error:
            raise ExportError(f"the run's recorded configuration cannot be read by this dilocox: {error}") from None


def assemble(
    run_id: str,
    assignment: list[ParamSlice],
    parts: dict[int, tuple[int, dict[SliceKey, torch.Tensor]]],
    run_config_json: str,
    num_shards: int,
) -> GlobalModel:
    """Full tensors from every shard's (version, slices); refuses a missing shard or slice, or mixed versions."""
    missing_shards = sorted(set(range(num_shards)) - set(parts))
    if missing_shards:
        raise ExportError(f"no weights from shard(s) {missing_shards} of {num_shards}: every shard is needed")
    versions = {shard: version for shard, (version, _) in parts.items()}
    if len(set(versions.values())) != 1:
        listed = ", ".join(f"shard {s}: version {v}" for s, v in sorted(versions.items()))
        raise ExportError(
            not_ready=True,
            message=f"the shards hold different versions ({listed}): export when they agree (the run's last "
            "round closed on all of them), or from checkpoints of one version",
        )
    version = next(iter(versions.values()))
    if version < 0:
        raise ExportError("the shards hold no published weights yet", not_ready=True)
    slices = {key: tensor for _, (_, held) in parts.items() for key, tensor in held.items()}
    tensors: dict[str, torch.Tensor] = {}
    for s in assignment:
        tensor = slices.get(s.key)
        if tensor is None or tuple(tensor.shape) != s.slice_shape:
            problem = "missing" if tensor is None else f"shaped {list(tensor.shape)}, not {list(s.slice_shape)}"
            raise ExportError(f"slice {s.name}[{s.row_start}:{s.row_stop}] of shard {s.shard} is {problem}")
        full = tensors.setdefault(s.name, torch.empty(s.shape, dtype=torch.float32))
        (full[s.row_start : s.row_stop] if full.dim() else full).copy_(tensor.reshape(s.slice_shape))
    return GlobalModel(run_id, version, run_config_json, tensors)


def from_checkpoints(
    locations: Iterable[str | pathlib.Path], report: Callable[[str], None] | None = None
) -> GlobalModel:
    """Offline: the shards' checkpoint files (one per shard), or folders holding them. In a folder a shard
    has its newest `shard-<i>.pt` and the versions kept before it (`shard-<i>.v<N>.pt`): the newest
    version every shard has intact (its digest checked) is used, damaged newer files are skipped
    (worker/export/checkpoints.py). `report` gets one line per shard naming the file and version used,
    and one per file skipped."""
    report = report or (lambda line: None)
    try:
        chosen = pick_versions(*gather(locations), report)
    except CheckpointError as error:
        raise ExportError(str(error)) from None
    first = next(iter(chosen.values()))[1]
    for file, state in chosen.values():
        for field in ("run_id", "num_shards", "digest"):
            if state[field] != first[field]:
                raise ExportError(f"{file} is from another run ({field} {state[field]!r}, not {first[field]!r})")
    parts: dict[int, tuple[int, dict[SliceKey, torch.Tensor]]] = {}
    for index, (file, state) in sorted(chosen.items()):
        snap, version = state["snapshot"], snapshot_version(state)
        parts[index] = (version, {} if snap is None else {slice_key(k): t for k, t in snap["tensors"].items()})
        report(f"shard {index}: {file} (version {version}{'' if verified(state) else ', format 1: unverified'})")
    assignment = assign_slices(first["param_specs"], first["num_shards"])
    model = assemble(first["run_id"], assignment, parts, first["run_config_json"], first["num_shards"])
    model.tokenizer_digest, model.tokenizer_json = _recorded_tokenizer(
        (st.get("tokenizer_digest", ""), st.get("tokenizer_json", "")) for _, st in chosen.values()
    )
    model.source = {"checkpoints": [str(file) for _, (file, _) in sorted(chosen.items())]}
    model.rounds_chain = export_section(
        {i: chain_of_checkpoint(st) for i, (_, st) in chosen.items()}, model.version, assignment
    )
    return model


def _recorded_tokenizer(records: Iterable[tuple[str, str]]) -> tuple[str, str]:
    """The run's tokenizer (digest, tokenizer.json) from every shard's record: the fullest one (a shard
    restored from a checkpoint older than the record has none; every shard that has one has the same)."""
    return max(records, key=lambda t: (len(t[1]), len(t[0])), default=("", ""))


def _rpc_error(address: str, error: grpc.RpcError) -> ExportError:
    code = error.code() if hasattr(error, "code") else None
    details = error.details() if hasattr(error, "details") else str(error)
    if is_hostname_mismatch(details or ""):
        details = explain_hostname_mismatch(address)
    waiting = code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)  # no model yet; down for now
    return ExportError(f"shard at {address}: {code.name if code else 'error'}: {details}", not_ready=waiting)


def served_run_id(
    addresses: list[str], tls: TlsFiles | None = None, token: str | None = None, timeout: float = 60.0
) -> str:
    """The run every shard at `addresses` serves (`ExportError` when one cannot be asked or they differ):
    so that an export needs no --run-id, whichever id the run was started with."""
    runs: dict[str, str] = {}
    for address in addresses:
        channel = open_channel(address, [], tls, token)
        try:
            runs[address] = pb_grpc.AggregatorStub(channel).Status(pb.StatusRequest(), timeout=timeout).run_id
        except grpc.RpcError as error:
            raise ExportError(
                f"{address}: cannot ask which run it serves: {error.code().name}: {error.details()}"
            ) from None
        finally:
            channel.close()
    if len(set(runs.values())) != 1:
        raise ExportError(f"the shards serve different runs: {runs}; name one with --run-id")
    return next(iter(runs.values()))


def from_servers(
    addresses: list[str],
    run_id: str,
    tls: TlsFiles | None = None,
    token: str | None = None,
    timeout: float = 60.0,
    wire: WireConfig | None = None,
    min_version: int = 0,
    wait_seconds: float = 0.0,
) -> GlobalModel:
    """Live: every shard's latest weights, read as an observer (no membership, no round waits for it);
    with `min_version`, each shard's pull waits up to `wait_seconds` for a version at least that new."""
    wire = wire or WireConfig()
    options = [
        ("grpc.max_receive_message_length", wire.max_message_bytes),
        ("grpc.max_send_message_length", wire.max_message_bytes),
    ]
    parts: dict[int, tuple[int, dict[SliceKey, torch.Tensor]]] = {}
    assignment: list[ParamSlice] = []
    run_config_json, num_shards = "", len(addresses)
    records: list[tuple[str, str]] = []
    chains: dict[int, dict | None] = {}
    for address in addresses:
        channel = open_channel(address, options, tls, token)
        try:
            stub = pb_grpc.AggregatorStub(channel)
            reply = stub.Join(pb.JoinRequest(run_id=run_id, observer=True), timeout=timeout)
            assignment = [
                ParamSlice(s.name, tuple(s.shape), s.row_start, s.row_stop, s.shard) for s in reply.assignment
            ]
            run_config_json, num_shards = reply.run_config_json, reply.num_shards
            records.append((reply.tokenizer_digest, reply.tokenizer_json))
            slice_map = SliceMap.of(assignment)
            expected = {s.key: s for s in assignment if s.shard == reply.shard_index}

            def vet(key: SliceKey, chunk: pb.TensorChunk, expected=expected, shard=reply.shard_index) -> int:
                if (
                    key not in expected
                    or tuple(chunk.shape) != expected[key].slice_shape
                    or chunk.is_delta
                    or chunk.momentum
                ):
                    raise ExportError(f"shard {shard} sent {key}, which is not one of its weight slices")
                return codecs.max_payload_bytes(chunk.codec, expected[key].slice_shape)

            request = pb.PullRequest(run_id=run_id, observer=True, min_version=min_version, wait_seconds=wait_seconds)
            units = list(assemble_units(stub.Pull(request, timeout=timeout), vet, slice_map.entries))
            chains[reply.shard_index] = fetch_chain(
                stub, run_id, timeout
            )  # read after the weights: it reaches their version
        except grpc.RpcError as error:
            raise _rpc_error(address, error) from None
        except DilocoxError as error:
            raise ExportError(f"shard at {address} sent a malformed stream: {error}") from None
        finally:
            channel.close()
        versions = {u.meta.version for u in units}
        if len(versions) > 1:
            raise ExportError(f"shard at {address} sent slices of versions {sorted(versions)} in one pull")
        parts[reply.shard_index] = (versions.pop() if versions else reply.version, {u.key: u.decode() for u in units})
    model = assemble(run_id, assignment, parts, run_config_json, num_shards)
    model.tokenizer_digest, model.tokenizer_json = _recorded_tokenizer(records)
    model.source = {"servers": list(addresses)}
    model.rounds_chain = export_section(chains, model.version, assignment)
    return model


# --------------------------------------------------------------------------- writing
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


# --------------------------------------------------------------------------- command
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="the folder to write (must not exist, or be empty)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--servers", help="comma-separated host:port of every running shard (read-only: no round waits)"
    )
    source.add_argument("--checkpoints", help="comma-separated shard checkpoint files or folders (offline)")
    parser.add_argument(
        "--run-id",
        help="the run's id, for --servers (default: the run the shards serve, as their Status says; they must agree)",
    )
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per shard call (default 120)")
    add_data_arguments(
        parser,
        "the run's data: the eval split for --eval (and, for a run whose shards did not record "
        "its tokenizer, where to find it; checked against the shards' record where there is one)",
    )
    parser.add_argument(
        "--tokenizer",
        dest="tokenizer_path",
        metavar="TOKENIZER_JSON",
        help="the run's tokenizer.json, checked against the one the shards recorded (needed only for "
        "runs whose shards did not record one)",
    )
    parser.add_argument("--model", help="where the run's --model (a config.json path) is on this machine, if elsewhere")
    parser.add_argument(
        "--eval", action="store_true", help="then report the exported model's loss on the run's eval split"
    )
    parser.add_argument(
        "--sign-key",
        metavar="KEY_PEM",
        help="sign the export with this private key (PEM: ECDSA as `dilocox certs` "
        "makes, Ed25519 or RSA): writes dilocox-signature.json, which `dilocox verify` checks",
    )
    parser.add_argument(
        "--sign-cert",
        metavar="CERT_PEM",
        help="with --sign-key: the key's certificate (then any intermediates), "
        "put in the signature so that `dilocox verify --cert CA.pem` can check who signed",
    )
    add_security_arguments(parser, "worker")


def run(args: argparse.Namespace) -> int:
    from dilocox.worker.data.sources import CorpusError
    from dilocox.worker.data.tokenizer import TokenizerError
    from dilocox.worker.models.spec import ModelSpecError

    try:
        if args.sign_cert and not args.sign_key:
            raise SigningError("--sign-cert needs --sign-key (the certificate's private key)")
        signer = (
            load_signer(args.sign_key, args.sign_cert) if args.sign_key else None
        )  # a bad key fails before the export
        if signer is not None and signer.certificates and not signs_code(signer.certificates[0]):
            raise SigningError(
                f"--sign-cert {args.sign_cert}: not a signer's certificate (no code-signing usage: a TLS "
                "server's or client's), which `dilocox verify --cert` refuses; issue one with `dilocox certs "
                "--out DIR --ca CA-DIR --role signer`"
            )
        if args.servers:
            tls, token = security_from_args(args, "worker")
            addresses = [a.strip() for a in args.servers.split(",") if a.strip()]
            run_id = args.run_id or served_run_id(addresses, tls, token, args.timeout)
            model = from_servers(addresses, run_id, tls, token, args.timeout)
        else:
            model = from_checkpoints([c.strip() for c in args.checkpoints.split(",") if c.strip()], report=print)
        out = write_export(model, args.out, args.data, args.text_field, args.model, args.tokenizer_path, signer)
        print(f"exported run {model.run_id} version {model.version}: {model.num_params:,} parameters to {out}")
        if signer is not None:
            check = "--cert <the CA's ca.pem>" if signer.certificates else "--key <the signer's public key>"
            print(f"signed by {signer.describe()}: check it with `dilocox verify {out} {check}`")
        if args.eval:
            print(f"eval loss {evaluate_export(out, args.data, args.text_field):.4f}")
    except (ExportError, ModelSpecError, TokenizerError, CorpusError, FileExistsError, ValueError) as error:
        print(f"dilocox export: {error}", file=sys.stderr)
        return 1
    return 0
