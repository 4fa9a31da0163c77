"""Regenerate the committed protobuf/gRPC modules from pdserve.proto (`make protos`).

The generated modules are committed, so importing `protos` never runs protoc and never
writes into an installed package. They are generated with `grpcio-tools==GENERATOR_PIN`:
its gencode (protobuf 6.31) runs on protobuf 6.31 through 7.x and grpcio >= 1.75.1, the
floors `pyproject.toml` declares. `make protos` installs that pin into a throwaway venv.

`python protos/build.py --check` (and tests/unit/test_protos.py) compiles pdserve.proto with
whatever protoc is installed and compares the descriptor with the committed module's, so a
.proto edited without regenerating fails the suite regardless of the generator's version.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO = HERE / "pdserve.proto"
OUTPUTS = ("pdserve_pb2.py", "pdserve_pb2_grpc.py", "pdserve_pb2.pyi")
GENERATOR_PIN = "1.75.1"


def _protoc(out_dir: Path, *outputs: str) -> None:
    """Compile PROTO as `pdserve/protos/pdserve.proto`, the path of its installed module, so the
    generated code imports `pdserve.protos.pdserve_pb2`; outputs go under out_dir/pdserve/protos."""
    from grpc_tools import protoc

    include = Path(protoc.__file__).parent / "_proto"
    staged = out_dir / "pdserve" / "protos" / PROTO.name
    staged.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(PROTO, staged)
    args = ["protoc", f"-I{out_dir}", f"-I{include}", *outputs, str(staged)]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO}")


def compiled_descriptor() -> bytes:
    """pdserve.proto as protoc compiles it now: a serialized FileDescriptorProto."""
    from google.protobuf import descriptor_pb2

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "set.pb"
        _protoc(Path(tmp), f"--descriptor_set_out={out}")
        (file,) = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file
    _drop_json_names(file.message_type)  # protoc adds them; generated Python code leaves them out
    return file.SerializeToString(deterministic=True)


def _drop_json_names(messages) -> None:
    for message in messages:
        for field in message.field:
            field.ClearField("json_name")
        _drop_json_names(message.nested_type)


def committed_descriptor() -> bytes:
    """The descriptor the committed pdserve_pb2 module was generated from."""
    from google.protobuf import descriptor_pb2

    from pdserve.protos import pdserve_pb2

    file = descriptor_pb2.FileDescriptorProto.FromString(pdserve_pb2.DESCRIPTOR.serialized_pb)
    return file.SerializeToString(deterministic=True)


def generate() -> None:
    """Write OUTPUTS next to the .proto with the installed grpc_tools (use GENERATOR_PIN)."""
    import grpc_tools

    version = getattr(grpc_tools, "__version__", None)
    if version is None:
        from importlib.metadata import version as dist_version

        version = dist_version("grpcio-tools")
    if version != GENERATOR_PIN:
        print(f"warning: grpcio-tools {version} is not the pinned {GENERATOR_PIN}; the generated code "
              "may need a newer protobuf runtime than pyproject.toml declares", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=HERE) as tmp:
        _protoc(Path(tmp), f"--python_out={tmp}", f"--pyi_out={tmp}", f"--grpc_python_out={tmp}")
        for name in OUTPUTS:
            os.replace(Path(tmp) / "pdserve" / "protos" / name, HERE / name)


def main(argv: list[str]) -> int:
    if "--check" in argv:
        if compiled_descriptor() != committed_descriptor():
            print(f"{PROTO.name} changed since protos/pdserve_pb2.py was generated: run `make protos`",
                  file=sys.stderr)
            return 1
        print("generated modules match pdserve.proto")
        return 0
    generate()
    print(f"generated {', '.join(OUTPUTS)} in {HERE}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
