#!/usr/bin/env python3
"""Generate the Python protobuf and gRPC code in hixl/v1/ from proto/hixl/v1/*.proto.

    python scripts/gen_proto.py            # regenerate in place
    python scripts/gen_proto.py --out DIR  # generate under DIR (the drift test uses this)

The proto package hixl.v1 maps onto the Python package hixl.v1, so the generated
imports (`from hixl.v1 import agent_pb2`) resolve inside the installed distribution.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"


def generate(out: Path) -> list[Path]:
    from grpc_tools import protoc  # imported here: only needed by developers

    protos = sorted(PROTO_ROOT.glob("hixl/v1/*.proto"))
    out.mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).parent / "_proto"
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={out}",
            f"--pyi_out={out}", f"--grpc_python_out={out}", *map(str, protos)]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    generated = sorted((out / "hixl" / "v1").glob("*_pb2*.py*"))
    return generated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT, help="output root (default: repo root)")
    args = parser.parse_args()
    for path in generate(args.out):
        print(path.relative_to(args.out), file=sys.stderr)


if __name__ == "__main__":
    main()
