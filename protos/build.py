"""Generate the protobuf/gRPC Python modules from pdserve.proto.

Run `python -m protos.build` (or `make protos`); importing `protos` also regenerates them
when the .proto changed since the last build, so nothing generated is ever committed or
edited by hand. Generation is locked and atomic, so concurrent processes are safe.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO = HERE / "pdserve.proto"
OUTPUTS = ("pdserve_pb2.py", "pdserve_pb2_grpc.py", "pdserve_pb2.pyi")
STAMP = HERE / ".pdserve_proto.sha1"


def _digest() -> str:
    import grpc_tools

    return hashlib.sha1(PROTO.read_bytes() + grpc_tools.__file__.encode()).hexdigest()


def is_current() -> bool:
    return STAMP.exists() and STAMP.read_text() == _digest() and all(
        (HERE / name).exists() for name in OUTPUTS
    )


def generate(force: bool = False) -> None:
    with open(HERE / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not force and is_current():
            return
        from grpc_tools import protoc

        root = HERE.parent
        with tempfile.TemporaryDirectory(dir=HERE) as tmp:
            include = Path(protoc.__file__).parent / "_proto"
            args = ["protoc", f"-I{root}", f"-I{include}", f"--python_out={tmp}",
                    f"--pyi_out={tmp}", f"--grpc_python_out={tmp}", str(PROTO)]
            if protoc.main(args) != 0:
                raise RuntimeError(f"protoc failed on {PROTO}")
            for name in OUTPUTS:
                os.replace(Path(tmp) / "protos" / name, HERE / name)
            shutil.rmtree(Path(tmp) / "protos", ignore_errors=True)
        STAMP.write_text(_digest())


if __name__ == "__main__":
    generate(force="--force" in sys.argv)
    print(f"generated {', '.join(OUTPUTS)} in {HERE}")
