"""Regenerate the committed Python bindings of `dilocox.proto`.

The bindings are committed so that a fresh clone installs without a code-generation step; this script
(and `tests/test_proto.py`, which checks they match the .proto) keeps them honest. protoc derives the
generated module's import path from the .proto's path under the include root, so the file is staged
as `dilocox/proto/dilocox.proto`: the gRPC stub then imports `dilocox.proto.dilocox_pb2` instead of a
bare top-level `dilocox_pb2`.

    python proto/generate.py            # rewrite proto/dilocox_pb2.py and dilocox_pb2_grpc.py
"""

from __future__ import annotations

import pathlib
import shutil
import sys
import tempfile

PROTO_DIR = pathlib.Path(__file__).resolve().parent
GENERATED = ("dilocox_pb2.py", "dilocox_pb2_grpc.py")


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Compile dilocox.proto and write the two generated modules into `out_dir`."""
    from grpc_tools import protoc  # a development dependency only

    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        staged = root / "dilocox" / "proto"
        staged.mkdir(parents=True)
        shutil.copy(PROTO_DIR / "dilocox.proto", staged / "dilocox.proto")
        code = protoc.main(
            [
                "protoc",
                f"-I{root}",
                f"--python_out={root}",
                f"--grpc_python_out={root}",
                str(staged / "dilocox.proto"),
            ]
        )
        if code != 0:
            raise RuntimeError(f"protoc failed with exit code {code}")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for name in GENERATED:
            target = out_dir / name
            shutil.copy(staged / name, target)
            written.append(target)
        return written


if __name__ == "__main__":
    for path in generate(PROTO_DIR):
        print(f"wrote {path}")
    sys.exit(0)
