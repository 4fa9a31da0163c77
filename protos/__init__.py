"""Wire formats of every RPC between pdserve processes (see pdserve.proto).

The generated modules are built from pdserve.proto on first import (protos.build).
"""

from protos.build import generate as _generate

_generate()

from protos import pdserve_pb2, pdserve_pb2_grpc  # noqa: E402

__all__ = ["pdserve_pb2", "pdserve_pb2_grpc"]
