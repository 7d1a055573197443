"""The run's global model, assembled from the shards, each of which holds some of its slices.

From the running shards (`from_servers`: a read-only observer, it joins no round, so training is never held
up) or offline from the shards' checkpoint files (`from_checkpoints`), checking that every slice of the run
is there and that all of them belong to one version (`ExportError` otherwise, `not_ready` when only not
*yet*), with what provenance.json records of where it came from and the shards' rounds chains.

Its own module because reading the model is what every caller needs — `dilocox export`
(worker/export/export_cli.py) writes it as files (worker/export/export_folder.py), `sim/global_eval.py`
evaluates it live as a run goes — and it needs none of the writing's Hugging Face and tokenizer code.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import grpc
import torch

from dilocox.common.config.run import RunConfig, WireConfig, from_dict
from dilocox.common.security import TlsFiles, explain_hostname_mismatch, is_hostname_mismatch, open_channel
from dilocox.common.wire import codecs
from dilocox.common.wire.assignment import ParamSlice, SliceMap, assign_slices
from dilocox.common.wire.checkpoint_format import CheckpointError, slice_key, snapshot_version, verified
from dilocox.common.wire.errors import DilocoxError
from dilocox.common.wire.framing import SliceKey
from dilocox.common.wire.slice_assembly import assemble_units
from dilocox.proto import dilocox_pb2 as pb
from dilocox.proto import dilocox_pb2_grpc as pb_grpc
from dilocox.worker.export.chain import chain_of_checkpoint, export_section, fetch_chain
from dilocox.worker.export.checkpoints import gather, pick_versions


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
