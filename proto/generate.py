"""Regenerate the checked-in Python code from ``deadweight/v1/deadweight.proto``.

grpc's generator writes absolute imports (``from deadweight.v1 import ...``) that only work
when the proto root is on ``sys.path``; they are rewritten to relative imports so the code
lives inside the ``deadweight.proto`` package. A test regenerates into a temporary folder and
asserts that nothing changes.
"""

from __future__ import annotations

import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PROTO_FILE = "deadweight/v1/deadweight.proto"
GENERATED = ("deadweight_pb2.py", "deadweight_pb2.pyi", "deadweight_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    """Write the generated modules for the schema into out_dir/deadweight/v1; return them."""
    from grpc_tools import protoc  # build-time dependency only

    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(PROTO_ROOT / PROTO_FILE),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO_FILE}")
    written = [out_dir / "deadweight" / "v1" / name for name in GENERATED]
    grpc_module = written[2]
    text = grpc_module.read_text()
    grpc_module.write_text(
        text.replace("from deadweight.v1 import deadweight_pb2", "from . import deadweight_pb2")
    )
    return written


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_ROOT):
        print(path)
