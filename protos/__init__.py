"""Wire formats of every RPC between pdserve processes (see pdserve.proto).

The generated modules are committed (regenerate with `make protos`; protos/build.py says
how, and the test suite checks they match the .proto). Importing this package only imports.
"""

from pdserve.protos import pdserve_pb2, pdserve_pb2_grpc

__all__ = ["pdserve_pb2", "pdserve_pb2_grpc"]
