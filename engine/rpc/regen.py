"""Regenerate the committed gRPC stubs from ``proto/sluice/v1/engine.proto``.

    python -m sluice.engine.rpc.regen            # rewrite engine/rpc/engine_pb2*.py(i)
    python -m sluice.engine.rpc.regen --out DIR  # write them into DIR instead (the staleness test does)

protoc emits ``from sluice.v1 import engine_pb2`` in the service module because the proto's
package path is ``sluice/v1``; the stubs live flat in ``engine/rpc``, so that one import is
rewritten to a package-relative one. Nothing else is touched.
"""
from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO_ROOT / "proto"
PROTO_FILE = Path("sluice/v1/engine.proto")
STUB_DIR = Path(__file__).resolve().parent
GENERATED = ("engine_pb2.py", "engine_pb2.pyi", "engine_pb2_grpc.py")
_ABSOLUTE_IMPORT = re.compile(r"^from sluice\.v1 import (\w+_pb2) as", re.MULTILINE)


def run_protoc(out_dir: Path, proto_root: Path = PROTO_ROOT) -> None:
    """Run grpcio-tools' protoc; files land in ``out_dir/sluice/v1/``."""
    from grpc_tools import protoc  # a dev dependency: only needed to regenerate

    args = [
        "grpc_tools.protoc",
        f"-I{proto_root}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(proto_root / PROTO_FILE),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {proto_root / PROTO_FILE}")


def generate(out_dir: Path) -> list[Path]:
    """Generate the stubs into ``out_dir`` (flat, with package-relative imports)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    with tempfile.TemporaryDirectory() as tmp:
        run_protoc(Path(tmp))
        for name in GENERATED:
            text = (Path(tmp) / PROTO_FILE.parent / name).read_text()
            text = _ABSOLUTE_IMPORT.sub(r"from . import \1 as", text)
            target = out_dir / name
            target.write_text(text)
            written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=STUB_DIR, help="output folder (default: engine/rpc)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
