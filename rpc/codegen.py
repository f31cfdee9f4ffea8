"""Generate ``rpc/``'s gRPC code from ``proto/trioserve.proto`` with
grpcio-tools: ``python -m trioserve.rpc.codegen`` (``make proto``).

The generated modules are committed rather than built at install time, so
an install needs neither protoc nor grpcio-tools (a dev dependency only);
``tests/test_grpc.py`` regenerates them and checks they match. The proto is
compiled under the virtual path ``trioserve/rpc/`` so the generated service
module imports its messages as ``trioserve.rpc.trioserve_pb2``.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
PROTO = PACKAGE_DIR.parent / "proto" / "trioserve.proto"
GENERATED = ("trioserve_pb2.py", "trioserve_pb2.pyi", "trioserve_pb2_grpc.py")


def generate(out_dir: Path, proto: Path = PROTO) -> dict[str, str]:
    """Compile ``proto`` into ``out_dir``; returns each generated file's text by name."""
    from grpc_tools import protoc

    args = [
        "grpc_tools.protoc",
        f"--proto_path=trioserve/rpc={proto.parent}",
        f"--proto_path={Path(protoc.__file__).parent / '_proto'}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(proto),
    ]
    status = protoc.main(args)
    if status != 0:
        raise RuntimeError(f"protoc failed with status {status} on {proto}")
    return {name: (out_dir / "trioserve" / "rpc" / name).read_text() for name in GENERATED}


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        for name in generate(Path(tmp)):
            shutil.copyfile(Path(tmp) / "trioserve" / "rpc" / name, PACKAGE_DIR / name)
            print(f"wrote {PACKAGE_DIR / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
