"""The committed gRPC bindings match proto/dilocox.proto (regenerated with grpc_tools and compared)."""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import re

import pytest
from google.protobuf import descriptor_pb2

from dilocox.proto import dilocox_pb2

PROTO_DIR = pathlib.Path(__file__).parents[1] / "proto"


def _load_generate_module():
    path = PROTO_DIR / "generate.py"
    spec = importlib.util.spec_from_file_location("dilocox_proto_generate", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _serialized_file_literal(source: str) -> bytes:
    """The bytes passed to `AddSerializedFile(...)` in a generated *_pb2.py, read without importing it."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "AddSerializedFile"
        ):
            assert len(node.args) == 1
            found.append(ast.literal_eval(node.args[0]))
    assert len(found) == 1, f"expected one AddSerializedFile call, found {len(found)}"
    assert isinstance(found[0], bytes)
    return found[0]


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory) -> pathlib.Path:
    pytest.importorskip("grpc_tools")
    out = tmp_path_factory.mktemp("proto_gen")
    written = _load_generate_module().generate(out)
    assert sorted(p.name for p in written) == ["dilocox_pb2.py", "dilocox_pb2_grpc.py"]
    return out


def test_committed_descriptor_matches_regenerated(regenerated):
    fresh = _serialized_file_literal((regenerated / "dilocox_pb2.py").read_text())
    committed = dilocox_pb2.DESCRIPTOR.serialized_pb
    if fresh != committed:
        a, b = descriptor_pb2.FileDescriptorProto(), descriptor_pb2.FileDescriptorProto()
        a.ParseFromString(fresh)
        b.ParseFromString(committed)
        pytest.fail(
            "proto/dilocox_pb2.py is stale; run `python proto/generate.py`.\n"
            f"messages now: {[m.name for m in a.message_type]}\ncommitted:    {[m.name for m in b.message_type]}"
        )
    # The committed module's own source literal is what it registered (nobody hand-edited one but not the other).
    assert _serialized_file_literal((PROTO_DIR / "dilocox_pb2.py").read_text()) == committed


def test_committed_grpc_stub_matches_regenerated(regenerated):
    def rpcs(text: str) -> set[str]:
        return set(re.findall(r"'/dilocox\.v1\.Aggregator/(\w+)'", text))

    fresh = (regenerated / "dilocox_pb2_grpc.py").read_text()
    committed = (PROTO_DIR / "dilocox_pb2_grpc.py").read_text()
    assert (
        rpcs(committed)
        == rpcs(fresh)
        == {m.name for m in dilocox_pb2.DESCRIPTOR.services_by_name["Aggregator"].methods}
    )
    # The stub imports the messages through the package, not as a bare top-level module.
    assert "from dilocox.proto import dilocox_pb2" in committed


def test_proto_declares_versioned_package():
    text = (PROTO_DIR / "dilocox.proto").read_text()
    assert re.search(r"^package dilocox\.v1;\s*$", text, re.MULTILINE)
    assert re.search(r'^syntax = "proto3";', text, re.MULTILINE)
    assert dilocox_pb2.DESCRIPTOR.package == "dilocox.v1"
    assert dilocox_pb2.DESCRIPTOR.services_by_name["Aggregator"].full_name == "dilocox.v1.Aggregator"


def test_wire_contract_has_the_chunk_fields_framing_relies_on():
    fields = {f.name: f.number for f in dilocox_pb2.TensorChunk.DESCRIPTOR.fields}
    for name in (
        "name",
        "row_start",
        "row_stop",
        "codec",
        "dtype",
        "shape",
        "payload_bytes",
        "offset",
        "raw_bytes",
        "zstd_frame",
        "version",
    ):
        assert name in fields, name


def test_check_detects_a_stale_binding(tmp_path):
    """The comparison above is sensitive: one added field in the .proto changes the descriptor."""
    pytest.importorskip("grpc_tools")
    generate = _load_generate_module()
    edited = tmp_path / "src"
    edited.mkdir()
    text = (PROTO_DIR / "dilocox.proto").read_text()
    text, n = re.subn(r"(message TensorChunk \{)", r"\1\n  int64 added_field = 99;", text)
    assert n == 1
    (edited / "dilocox.proto").write_text(text)
    generate.PROTO_DIR = edited  # generate() reads the .proto from its module's PROTO_DIR
    out = tmp_path / "out"
    generate.generate(out)
    fresh = _serialized_file_literal((out / "dilocox_pb2.py").read_text())
    assert fresh != dilocox_pb2.DESCRIPTOR.serialized_pb
    parsed = descriptor_pb2.FileDescriptorProto()
    parsed.ParseFromString(fresh)
    [chunk] = [m for m in parsed.message_type if m.name == "TensorChunk"]
    assert "added_field" in {f.name for f in chunk.field}
