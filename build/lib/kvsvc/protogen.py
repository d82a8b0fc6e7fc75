"""Regenerate (or, with --check, verify) the committed Python stubs of protos/ in kvsvc/v1/."""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO = "kvsvc/v1/kv_transfer.proto"
OUTPUTS = ("kv_transfer_pb2.py", "kv_transfer_pb2.pyi", "kv_transfer_pb2_grpc.py")


def generate(out_dir: Path) -> None:
    import grpc_tools
    from grpc_tools import protoc  # dev dependency; imported here so the package never needs it

    include = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc", f"-I{ROOT / 'protos'}", f"-I{include}",
        f"--python_out={out_dir}", f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}",
        str(ROOT / "protos" / PROTO),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--check", action="store_true", help="fail if the committed stubs are stale")
    opts = ap.parse_args()
    if not opts.check:
        generate(ROOT)
        print(f"regenerated {', '.join(OUTPUTS)} in kvsvc/v1/")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        stale = [f for f in OUTPUTS if not filecmp.cmp(Path(tmp) / "kvsvc/v1" / f, ROOT / "kvsvc/v1" / f, shallow=False)]
    if stale:
        print(f"stale generated code: {stale}; run `make proto`", file=sys.stderr)
        return 1
    print("generated code is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
